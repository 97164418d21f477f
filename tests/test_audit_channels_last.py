"""audit_channels_last on small synthetic models whose losers and keepers are known on this torch (CPU)."""

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxfuse.audit import ChannelsLastReport, audit_channels_last
from fxfuse.errors import AuditError, FxFuseError

SOURCE_LINES = Path(__file__).read_text().splitlines()


def line_of(marker: str) -> str:
    """'test_audit_channels_last.py:LINE' of the source line tagged with `# <marker>`."""
    line = next(i for i, text in enumerate(SOURCE_LINES, 1) if text.rstrip().endswith(f"# <{marker}>"))
    return f"{Path(__file__).name}:{line}"


class ConvThen(nn.Module):
    """conv -> bn -> relu (all keep channels_last), then `tail`."""

    def __init__(self, tail, channels: int = 8):
        super().__init__()
        self.conv = nn.Conv2d(4, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)
        self.tail = tail

    def forward(self, x):
        return self.tail(F.relu(self.bn(self.conv(x))))


class Lambda(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def audit(tail, **kwargs) -> ChannelsLastReport:
    return audit_channels_last(ConvThen(Lambda(tail)), torch.randn(2, 4, 8, 8), **kwargs)


FORWARD_LOSERS = {
    "contiguous": (lambda x: x.contiguous(), "aten.clone.default", "contiguous_format"),
    "softmax_over_channels": (lambda x: x.softmax(1), "aten._softmax.default", "no channels_last kernel"),
    "cumsum": (lambda x: x.cumsum(1), "aten.cumsum.default", "no channels_last kernel"),
    "layer_norm_chw": (lambda x: F.layer_norm(x, x.shape[1:]), "aten.native_layer_norm.default", "no channels_last"),
    "nchw_plus_x": (lambda x: torch.ones(2, 8, 8, 8) + x, "aten.add.Tensor", "mixed-format"),
    "cat_with_nchw": (lambda x: torch.cat([x, torch.ones(2, 8, 8, 8)], 1), "aten.cat.default", "mixed-format"),
    "inplace_into_nchw": (lambda x: torch.zeros(2, 8, 8, 8).add_(x), "aten.add_.Tensor", "in-place write"),
    "grid_sample": (
        lambda x: F.grid_sample(x, torch.zeros(2, 4, 4, 2), align_corners=False),
        "aten.grid_sampler_2d.default",
        "",
    ),
}


@pytest.mark.parametrize("name", FORWARD_LOSERS)
def test_forward_losers_are_found(name):
    tail, op, hint = FORWARD_LOSERS[name]
    report = audit(tail, backward=False)
    assert not report.ok
    [finding] = report.losses("forward")
    assert finding.op == op
    assert hint in finding.hint
    assert finding.module == "tail"
    assert any(t.memory_format == "channels_last" for t in finding.inputs)
    assert any(len(t.shape) == 4 and t.memory_format == "contiguous" for t in finding.outputs)


KEEPERS = {
    "identity": lambda x: x,
    "max_pool": lambda x: F.max_pool2d(x, 2),
    "avg_pool": lambda x: F.avg_pool2d(x, 2),
    "adaptive_avg_pool_3x3": lambda x: F.adaptive_avg_pool2d(x, 3),
    "bilinear_upsample": lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"),
    "pixel_shuffle": lambda x: F.pixel_shuffle(x, 2),
    "x_plus_nchw": lambda x: x + torch.ones(2, 8, 8, 8),
    "gelu_and_sigmoid": lambda x: torch.sigmoid(F.gelu(x)) * x,
}


@pytest.mark.parametrize("name", KEEPERS)
def test_keepers_pass_forward_and_backward(name):
    report = audit(KEEPERS[name])
    assert report.ok, str(report)
    assert report.backward
    assert report.ops_checked["forward"] >= 3  # conv, bn, relu at least
    assert report.ops_checked["backward"] >= 3


def test_backward_only_loss_is_attributed_to_the_forward_module_and_line():
    class Up(nn.Module):
        def forward(self, x):
            return F.interpolate(x, scale_factor=2, mode="bicubic")  # <bicubic>

    model = ConvThen(nn.Sequential(nn.ReLU(), Up()))
    report = audit_channels_last(model, torch.randn(2, 4, 8, 8))
    assert report.losses("forward") == []
    [finding] = report.losses("backward")
    assert finding.op == "aten.upsample_bicubic2d_backward.default"
    assert finding.module == "tail.1"
    assert finding.location.endswith(line_of("bicubic"))
    assert finding.autograd_node == "UpsampleBicubic2DBackward0"


def test_forward_finding_names_innermost_module_and_user_line():
    class Inner(nn.Module):
        def forward(self, x):
            return x.contiguous() * 2  # <inner-contiguous>

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 8, 1)
            self.block = nn.Sequential(nn.Identity(), Inner())

        def forward(self, x):
            return self.block(self.conv(x)).softmax(1)  # <outer-softmax>

    report = audit_channels_last(Outer(), torch.randn(2, 4, 8, 8), backward=False)
    by_op = {f.op: f for f in report.findings}
    assert by_op["aten.clone.default"].module == "block.1"
    assert by_op["aten.clone.default"].location.endswith(line_of("inner-contiguous"))
    # x.contiguous() made the product NCHW already: softmax gets no channels_last input.
    assert "aten._softmax.default" not in by_op


def test_repeated_calls_are_grouped_with_a_count():
    class Loop(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 1)

        def forward(self, x):
            out = 0
            for _ in range(3):
                out = out + self.conv(x).cumsum(1)
            return out

    report = audit_channels_last(Loop(), torch.randn(2, 4, 8, 8), backward=False)
    [finding] = report.findings
    assert finding.count == 3


def test_the_same_op_at_two_sites_is_two_findings():
    class TwoSites(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 1)
            self.a, self.b = Lambda(lambda x: x.cumsum(1)), Lambda(lambda x: x.cumsum(1))

        def forward(self, x):
            y = self.conv(x)
            return self.a(y) + self.b(y)

    report = audit_channels_last(TwoSites(), torch.randn(2, 4, 8, 8), backward=False)
    assert sorted((f.op, f.module, f.count) for f in report.findings) == [
        ("aten.cumsum.default", "a", 1),
        ("aten.cumsum.default", "b", 1),
    ]


def test_ops_run_only_by_torch_modules_have_no_user_line():
    model = nn.Sequential(nn.Conv2d(4, 8, 1), nn.Softmax(dim=1))
    [finding] = audit_channels_last(model, torch.randn(2, 4, 8, 8), backward=False).findings
    assert (finding.op, finding.module, finding.location) == ("aten._softmax.default", "1", None)


def test_views_that_reorder_dims_are_info_not_losses():
    # ConvNeXt's NHWC permute: output is NCHW-contiguous in (N, H, W, C) order, but nothing was copied.
    report = audit(lambda x: x.permute(0, 2, 3, 1), backward=False)
    assert report.ok
    assert [f.op for f in report.info] == ["aten.permute.default"]
    assert report.info[0].severity == "info"


@pytest.mark.parametrize(
    "tail, op, kind",
    [
        (lambda x: F.adaptive_avg_pool2d(x, 1), "aten.mean.dim", "NC11"),
        (lambda x: x.sum(1, keepdim=True), "aten.sum.dim_IntList", "N1HW"),
    ],
    ids=["NC11", "N1HW"],
)
def test_ambiguous_outputs_count_neither_as_kept_nor_lost(tail, op, kind):
    report = audit(tail, backward=False)
    assert report.ok
    [entry] = [a for a in report.ambiguous if a.op == op]
    assert kind in entry.hint
    assert entry.outputs[0].memory_format == "ambiguous"


def test_ambiguous_input_with_nchw_output_is_ambiguous_not_a_loss():
    # The upsample's only 4-D input is NC11: whether its NCHW result "lost" channels_last cannot be decided.
    report = audit(lambda x: F.interpolate(x.mean((2, 3), keepdim=True), size=(4, 4)), backward=False)
    assert report.ok
    [entry] = [a for a in report.ambiguous if a.op == "aten.upsample_nearest2d.default"]
    assert entry.hint == "NC11 input: cannot tell whether channels_last was lost"


def test_audit_converts_copies_and_never_touches_the_user_model():
    model = ConvThen(nn.Dropout(0.5))
    model.train()
    before = copy.deepcopy(model.state_dict())
    example = torch.randn(2, 4, 8, 8)
    example_before = example.clone()

    report = audit_channels_last(model, example, train=False)

    assert report.training is False
    assert model.training and model.tail.training
    assert all(p.grad is None for p in model.parameters())
    assert model.conv.weight.is_contiguous()  # not converted to channels_last
    after = model.state_dict()
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), key  # BN running stats included
    assert example.is_contiguous() and torch.equal(example, example_before)
    assert not model._forward_hooks and not model.conv._forward_pre_hooks


def test_train_none_keeps_the_model_mode_and_true_forces_training():
    model = ConvThen(nn.Identity()).eval()
    assert audit_channels_last(model, torch.randn(2, 4, 8, 8)).training is False
    assert audit_channels_last(model, torch.randn(2, 4, 8, 8), train=True).training is True
    assert not model.training


def test_backward_false_runs_forward_only():
    report = audit(lambda x: F.interpolate(x, scale_factor=2, mode="bicubic"), backward=False)
    assert report.ok and not report.backward
    assert report.ops_seen["backward"] == 0


def test_backward_is_skipped_with_a_reason_when_nothing_requires_grad():
    model = ConvThen(nn.Identity()).requires_grad_(False)
    report = audit_channels_last(model, torch.randn(2, 4, 8, 8))
    assert not report.backward
    assert report.backward_skipped == "no output requires grad"
    assert "backward not audited" in str(report)


def test_nested_inputs_and_outputs_with_non_tensors():
    class Nested(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 8, 3, padding=1)

        def forward(self, batch, extras, scale=1.0):
            x = self.conv(batch["image"]) * batch["gain"] * scale
            mask, unused = extras
            assert unused is None
            return {"logits": x.contiguous().mean((2, 3)), "mask": [mask.float() * 2, "tag"], "n": 3}

    batch = {"image": torch.randn(2, 4, 8, 8), "gain": 0.5}
    extras = (torch.ones(2, 1, 8, 8, dtype=torch.bool), None)
    report = audit_channels_last(Nested(), batch, extras, 2.0)
    assert report.input_shapes == [(2, 4, 8, 8), (2, 1, 8, 8)]
    assert [f.op for f in report.losses("forward")] == ["aten.clone.default"]
    assert report.backward


def test_model_without_4d_tensors_has_nothing_to_audit():
    mlp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    report = audit_channels_last(mlp, torch.randn(8, 16))
    assert report.nothing_to_audit and report.ok
    assert "nothing to audit" in str(report)
    assert json.loads(report.to_json())["nothing_to_audit"] is True


def test_model_rejecting_the_input_raises_an_error_naming_the_shape():
    with pytest.raises(AuditError, match=r"\(2, 3, 8, 8\)") as info:
        audit_channels_last(ConvThen(nn.Identity()), torch.randn(2, 3, 8, 8))
    assert isinstance(info.value, FxFuseError)
    assert "ConvThen" in str(info.value)


def test_report_renders_a_table_and_json():
    report = audit(lambda x: x.softmax(1))
    text = str(report)
    assert "aten._softmax.default" in text and "hint" in text and "module" in text
    data = json.loads(report.to_json())
    assert data["ok"] is False
    [forward] = [f for f in data["findings"] if f["phase"] == "forward"]
    assert forward["op"] == "aten._softmax.default"
    assert forward["module"] == "tail"
    assert forward["inputs"][0]["stride"] == [512, 1, 64, 8]
    assert forward["outputs"][0]["stride"] == [512, 64, 8, 1]


def test_fake_mode_matches_real_mode_on_synthetic_losers():
    tail = lambda x: (x.cumsum(1), F.interpolate(x, scale_factor=2, mode="bicubic"))

    def sites(report):
        return sorted((f.phase, f.op, f.module, f.location, f.count) for f in report.findings)

    real, fake = audit(tail), audit(tail, fake=True)
    assert fake.fake and not real.fake
    assert sites(fake) == sites(real)
    assert {f.phase for f in real.findings} == {"forward", "backward"}


def test_fake_mode_flags_ops_whose_fake_strides_differ():
    # ReLU6's backward meets an NCHW gradient (from .contiguous()): the CPU kernel follows the
    # gradient and returns NCHW, its fake decomposition follows the input and stays channels_last.
    tail = lambda x: F.relu6(x).contiguous()
    real, fake = audit(tail), audit(tail, fake=True)
    assert "aten.hardtanh_backward.default" in {f.op for f in real.losses("backward")}
    [caveat] = fake.caveats
    assert caveat.op == "aten.hardtanh_backward.default"
    assert "follows grad_output" in caveat.note
    assert not real.caveats


def test_fake_mode_notes_losses_downstream_of_a_fake_stride_difference():
    # roll keeps channels_last on CPU but not on fake tensors; the add after it then mixes formats.
    tail = lambda x: x.roll(1, 2) + x
    real, fake = audit(tail, backward=False), audit(tail, backward=False, fake=True)
    assert real.ok
    roll, add = fake.findings
    assert (roll.op, add.op) == ("aten.roll.default", "aten.add.Tensor")
    assert "CPU kernel keeps channels_last" in roll.note
    assert "derives from aten.roll.default" in add.note


def test_fake_mode_audits_a_meta_device_model_as_a_cpu_model():
    with torch.device("meta"):
        model = ConvThen(Lambda(lambda x: x.softmax(1)))
    report = audit_channels_last(model, torch.randn(2, 4, 8, 8, device="meta"), fake=True)
    # On the meta device itself convolution would return NCHW; faked as CPU it keeps channels_last.
    assert [f.op for f in report.losses("forward")] == ["aten._softmax.default"]
