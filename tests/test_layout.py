"""optimize(..., memory_format=...): channels_last on request, or where it is known to pay ("auto")."""

import copy
import pickle

import pytest
import torch
from torch import nn

import fxfuse
from fxfuse.errors import ConfigurationError
from fxfuse.fusion import layout
from fxfuse.testing import assert_equivalent

F64 = torch.float64
CL = torch.channels_last


def cnn():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )


class LosesFormat(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)

    def forward(self, x):
        return self.bn(self.conv(x)).contiguous()  # NCHW from here on


def test_channels_last_converts_the_model_and_its_inputs_exactly():
    model = cnn().to(F64)
    x = torch.randn(2, 3, 8, 8, dtype=F64)
    optimized = fxfuse.optimize(copy.deepcopy(model), x, memory_format="channels_last")
    assert optimized[0].weight.is_contiguous(memory_format=CL)
    for a, b in zip(model.state_dict().values(), optimized.state_dict().values()):
        assert torch.equal(a, b)
    assert optimized.fxfuse_report.layout == "channels_last (memory_format='channels_last')"
    assert "layout: channels_last" in str(optimized.fxfuse_report)
    assert_equivalent(model, optimized, x, steps=2)
    features = nn.Sequential(*list(optimized.children())[:3])
    assert fxfuse.optimize(features, x, memory_format="channels_last")(x).is_contiguous(memory_format=CL)


def test_preserve_is_the_default_and_changes_no_layout():
    model = cnn()
    optimized = fxfuse.optimize(model, torch.randn(2, 3, 8, 8))
    assert optimized[0].weight.is_contiguous()
    assert optimized.fxfuse_report.layout == "as given (memory_format='preserve')"


@pytest.mark.parametrize("faster", [True, False])
def test_auto_converts_only_where_channels_last_measures_faster(monkeypatch, faster):
    monkeypatch.setattr(layout, "_step_seconds", lambda model, inputs: (1.0, 0.5 if faster else 1.5))
    optimized = fxfuse.optimize(cnn(), torch.randn(2, 3, 8, 8), memory_format="auto")
    assert optimized[0].weight.is_contiguous(memory_format=CL) is faster
    assert optimized.fxfuse_report.layout.startswith(
        "channels_last (auto: no format loss, and 0.50x"
        if faster
        else "as given (auto: channels_last measured no faster"
    )


def test_auto_keeps_the_layout_where_the_audit_finds_a_loss(monkeypatch):
    monkeypatch.setattr(layout, "_step_seconds", lambda model, inputs: pytest.fail("timed despite the loss"))
    report = fxfuse.explain(LosesFormat(), torch.randn(2, 3, 8, 8), memory_format="auto")
    assert report.layout.startswith("as given (auto: channels_last would be lost at aten.clone")


def test_auto_keeps_a_model_that_is_channels_last_already(monkeypatch):
    # A 1x1 conv's (O, C, 1, 1) weight is both contiguous and channels_last: it must not hide the layout.
    monkeypatch.setattr(layout, "_step_seconds", lambda model, inputs: pytest.fail("timed an already-CL model"))
    model = nn.Sequential(cnn(), nn.Unflatten(1, (4, 1, 1)), nn.Conv2d(4, 4, 1)).to(memory_format=CL)
    assert layout.decide(model, (torch.randn(2, 3, 8, 8),), "auto") == layout.LayoutDecision(
        True, "auto: the model is channels_last already"
    )


def test_auto_keeps_the_layout_where_only_backward_loses_the_format(monkeypatch):
    class Bicubic(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)

        def forward(self, x):
            return nn.functional.interpolate(self.conv(x), scale_factor=2, mode="bicubic")

    monkeypatch.setattr(layout, "_step_seconds", lambda model, inputs: pytest.fail("timed despite the loss"))
    reason = layout.decide(Bicubic(), (torch.randn(2, 3, 8, 8),), "auto").reason
    assert reason.startswith("auto: channels_last would be lost at aten.upsample_bicubic2d_backward")


def test_step_seconds_times_each_layout_in_its_own_format(monkeypatch):
    seen = []

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3)

        def forward(self, x):
            seen.append(x.is_contiguous(memory_format=CL) and self.conv.weight.is_contiguous(memory_format=CL))
            return self.conv(x)

    def timed(fn):
        fn()
        return 3.0 if seen[-1] else 5.0  # channels_last "runs" faster

    monkeypatch.setattr(layout.measure, "timed", timed)
    assert layout._step_seconds(Probe(), (torch.randn(2, 3, 8, 8),)) == (5.0, 3.0)


def test_to_channels_last_converts_only_4d_floating_tensors():
    image, mask, flat = torch.randn(2, 3, 4, 4), torch.ones(2, 3, 4, 4, dtype=torch.int64), torch.randn(2, 3)
    out = layout.to_channels_last((image, mask, flat, "tag"))
    assert out[0].is_contiguous(memory_format=CL) and not out[0].is_contiguous()
    assert out[1] is mask and out[2] is flat and out[3] == "tag"


def test_auto_times_the_example_inputs_as_given_and_leaves_the_model_alone():
    """At batch 1 a layout's speed says little about training (ResNet-50: 1.02x at batch 1, 0.63x at
    batch 8), and a BatchNorm1d after pooling cannot even train on one sample: the timing runs the
    example inputs as given, on copies."""
    model = nn.Sequential(cnn(), nn.BatchNorm1d(4))
    state = copy.deepcopy(model.state_dict())
    current, converted = layout._step_seconds(model, (torch.randn(2, 3, 8, 8),))
    assert current > 0 and converted > 0
    assert model[0][0].weight.grad is None
    for name, value in model.state_dict().items():
        assert torch.equal(value, state[name]), name
    assert model[0][0].weight.is_contiguous()


def test_auto_needs_conv_and_a_4d_input():
    assert "no Conv2d" in fxfuse.explain(nn.Sequential(nn.Linear(4, 4), nn.GELU()), memory_format="auto").layout
    assert "needs a 4-D example input" in fxfuse.explain(cnn(), memory_format="auto").layout


def test_the_conversion_survives_deepcopy_and_pickle():
    model = cnn().to(F64)
    x = torch.randn(2, 3, 8, 8, dtype=F64)
    optimized = fxfuse.optimize(copy.deepcopy(model), x, memory_format="channels_last").eval()
    expected = model.eval()(x)
    for clone in (copy.deepcopy(optimized), pickle.loads(pickle.dumps(optimized))):
        torch.testing.assert_close(clone(x), expected, rtol=1e-12, atol=1e-14)
        assert clone[0].weight.is_contiguous(memory_format=CL)


def test_explain_changes_no_layout_and_bad_values_are_errors():
    model = cnn()
    assert fxfuse.explain(model, torch.randn(2, 3, 8, 8), memory_format="channels_last").layout.startswith(
        "channels_last"
    )
    assert model[0].weight.is_contiguous()
    with pytest.raises(ConfigurationError, match="memory_format must be one of"):
        fxfuse.optimize(model, memory_format="nhwc")


def test_cli_optimize_memory_format(capsys):
    from fxfuse.cli import main

    assert (
        main(["optimize", "tests.test_layout:cnn", "--input-shape", "2,3,8,8", "--memory-format", "channels_last"]) == 0
    )
    assert "layout: channels_last (memory_format='channels_last')" in capsys.readouterr().out
