"""timm's norm-act family, fused exactly as eager: BatchNormAct2d (with its act and drop) and Conv2dSame."""

import copy
import re

import pytest
import torch
from torch import nn

import fxfuse
from fxfuse.fusion.known_modules import is_conv2d_same, is_known_leaf, is_norm_act, pad_same
from fxfuse.testing import assert_equivalent

timm_layers = pytest.importorskip("timm.layers")
BatchNormAct2d, Conv2dSame = timm_layers.BatchNormAct2d, timm_layers.Conv2dSame
F64 = torch.float64

ACTS = {
    "relu-inplace": dict(act_layer=nn.ReLU, inplace=True),
    "silu": dict(act_layer=nn.SiLU, inplace=False),
    "hardswish": dict(act_layer="hard_swish"),
    "gelu-timm": dict(act_layer="gelu"),
    "leaky": dict(act_layer=nn.LeakyReLU, act_kwargs={"negative_slope": 0.2}),
    "no-act": dict(apply_act=False),
}


class ConvNormAct(nn.Module):
    def __init__(self, conv, norm):
        super().__init__()
        self.conv, self.bn = conv, norm

    def forward(self, x):
        return self.bn(self.conv(x))


def _check(model, x, fused_patterns, steps=3):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimized = fxfuse.optimize(copy.deepcopy(model), x)
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert sorted(s.pattern for s in optimized.fxfuse_report.fused) == sorted(fused_patterns), optimized.fxfuse_report
    assert_equivalent(model, optimized, x, steps=steps)
    return optimized


def test_recognised_by_forward_not_by_name():
    assert is_norm_act(BatchNormAct2d(4)) and is_known_leaf(BatchNormAct2d(4))
    assert is_conv2d_same(Conv2dSame(3, 4, 3)) and not is_conv2d_same(nn.Conv2d(3, 4, 3))

    class Scaled(BatchNormAct2d):
        def forward(self, x):
            return 2 * super().forward(x)

    assert not is_norm_act(Scaled(4)) and not is_norm_act(nn.BatchNorm2d(4))


@pytest.mark.parametrize("act", ACTS)
def test_conv_norm_act_is_fused_and_exact(act):
    torch.manual_seed(0)
    model = ConvNormAct(nn.Conv2d(3, 8, 3, padding=1), BatchNormAct2d(8, **ACTS[act])).to(F64)
    x = torch.randn(2, 3, 8, 8, dtype=F64)
    name = {
        "relu-inplace": "relu",
        "silu": "silu",
        "hardswish": "hardswish",
        "gelu-timm": "gelu",
        "leaky": "leaky_relu(0.2)",
        "no-act": None,
    }[act]
    _check(model, x, ["conv2d→batch_norm2d" + (f"→{name}" if name else "")])


@pytest.mark.parametrize("momentum", [0.1, None])
def test_counters_and_running_stats_in_train_and_eval(momentum):
    torch.manual_seed(0)
    model = ConvNormAct(nn.Conv2d(3, 8, 3), BatchNormAct2d(8, momentum=momentum)).to(F64)
    x = torch.randn(2, 3, 8, 8, dtype=F64)
    optimized = _check(model, x, ["conv2d→batch_norm2d→relu"])
    for m in (model, optimized):
        m.train()
        for _ in range(3):
            m(x).sum().backward()
        m.eval()(x)
    assert optimized.bn.num_batches_tracked.item() == model.bn.num_batches_tracked.item() == 3
    for key in ("running_mean", "running_var"):
        torch.testing.assert_close(getattr(optimized.bn, key), getattr(model.bn, key), rtol=1e-12, atol=1e-14)


def test_standalone_norm_act_is_fused_as_bn_act():
    torch.manual_seed(0)

    class PreAct(nn.Module):  # DenseNet-style: the BN input is not a conv output
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 6, 3, padding=1)
            self.bn = BatchNormAct2d(9, act_layer=nn.SiLU)

        def forward(self, x):
            return self.bn(torch.cat([x, self.conv(x)], 1))

    # the concatenation is kept as its pieces (x is kept by the conv anyway): passes/cat_input.py
    _check(PreAct().to(F64), torch.randn(2, 3, 8, 8, dtype=F64), ["batch_norm2d→silu", "cat→fused op"])


def test_drop_layer_is_not_fused_and_says_why():
    model = ConvNormAct(nn.Conv2d(3, 8, 3), BatchNormAct2d(8, drop_layer=lambda: nn.Dropout(0.5)))
    report = fxfuse.explain(model)
    assert not report.fused
    assert [s.reason for s in report.skipped] == ["BatchNormAct2d.drop is Dropout, which the fused op does not apply"]


def test_subclass_that_changes_forward_runs_its_own_forward():
    class Scaled(BatchNormAct2d):
        def forward(self, x):
            return 2 * super().forward(x)

    torch.manual_seed(0)
    model = ConvNormAct(nn.Conv2d(3, 8, 3), Scaled(8)).to(F64)
    x = torch.randn(2, 3, 8, 8, dtype=F64)
    optimized = fxfuse.optimize(copy.deepcopy(model), x)
    # Not taken as a BatchNormAct2d: its forward is traced through, and what it computes is fused.
    assert [s.modules for s in optimized.fxfuse_report.fused] == [("conv", "bn:batch_norm")]
    assert_equivalent(model, optimized, x, steps=3)


def test_bad_input_raises_what_eager_raises():
    model = ConvNormAct(nn.Conv2d(3, 8, 3), BatchNormAct2d(8))
    optimized = fxfuse.optimize(copy.deepcopy(model))
    bad_inputs = {
        "rank3": torch.randn(3, 8, 8),
        "channels": torch.randn(2, 4, 8, 8),
        "dtype": torch.randn(2, 3, 8, 8, dtype=F64),
        "rank5": torch.randn(1, 2, 3, 8, 8),
        "batch1-1x1-train": torch.randn(1, 3, 3, 3),  # BN sees one value per channel
    }
    for bad in bad_inputs.values():
        with pytest.raises(Exception) as eager:
            model(bad)
        first_line = str(eager.value).splitlines()[0]
        with pytest.raises(eager.type, match=re.escape(first_line)):
            optimized(bad)


@pytest.mark.parametrize("size,stride", [(9, 2), (8, 2), (7, 1)])
def test_conv2d_same_pads_per_call_and_is_fused(size, stride):
    torch.manual_seed(0)
    model = ConvNormAct(Conv2dSame(3, 8, 3, stride=stride), BatchNormAct2d(8, act_layer=nn.SiLU)).to(F64)
    x = torch.randn(2, 3, size, size, dtype=F64)
    _check(model, x, ["conv2d→batch_norm2d→silu"])
    assert torch.equal(
        pad_same(x, model.conv),
        timm_layers.pad_same(x, model.conv.weight.shape[-2:], model.conv.stride, model.conv.dilation),
    )


def test_timm_blocks_with_squeeze_excite():
    torch.manual_seed(0)
    model = nn.Sequential(
        timm_layers.ConvNormAct(3, 8, 3, stride=2, act_layer=nn.SiLU),
        timm_layers.SqueezeExcite(8),
        timm_layers.ConvNormAct(8, 8, 3, groups=8, act_layer=nn.ReLU),
        timm_layers.ConvNormAct(8, 16, 1, apply_act=False),
    ).to(F64)
    x = torch.randn(2, 3, 16, 16, dtype=F64)
    # The depthwise ConvNormAct's BN→ReLU feeds the 1×1 conv: merged into it (bn_act_conv), its conv not recomputed.
    _check(model, x, ["conv2d→batch_norm2d→silu", "batch_norm2d→relu", "conv2d→batch_norm2d"])


def test_conv2d_same_then_activation_is_fused():
    torch.manual_seed(0)
    model = nn.Sequential(Conv2dSame(3, 8, 3, stride=2), nn.SiLU()).to(F64)
    _check(model, torch.randn(2, 3, 9, 9, dtype=F64), ["conv2d→silu"])


def test_conv2d_same_pads_each_call_from_its_own_non_square_input():
    """Conv2dSame pads from the input's height and width on every call: a graph built for one size runs at
    others, and the height's padding is not the width's."""
    torch.manual_seed(0)
    model = ConvNormAct(Conv2dSame(3, 8, (3, 5), stride=2), BatchNormAct2d(8, act_layer=nn.SiLU)).to(F64)
    x = torch.randn(2, 3, 9, 8, dtype=F64)
    optimized = _check(model, x, ["conv2d→batch_norm2d→silu"])
    for size in ((11, 14), (9, 8), (8, 13)):
        y = torch.randn(2, 3, *size, dtype=F64)
        torch.testing.assert_close(optimized(y), model(y), rtol=1e-12, atol=1e-12)
    assert_equivalent(model, optimized, torch.randn(3, 3, 8, 13, dtype=F64), steps=2)
