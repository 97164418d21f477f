"""LayerScale merge (passes/layer_scale.py): a per-feature scale after a Linear joins it as
fxfuse::act_linear_scale; what it takes, what it leaves, exactness and bytes."""

import copy

import pytest
import torch
import torchvision
from support.autocast_training import assert_trains_like_eager_autocast
from torch import nn

import fxfuse
from fxfuse import measure
from fxfuse.testing import assert_equivalent


def _ops(model):
    return sorted(s.op for s in model.fxfuse_report.fused)


class TorchvisionStyle(nn.Module):
    """torchvision's CNBlock tail: layer_scale (C, 1, 1) * permute(fc2(gelu(fc1(x))))."""

    def __init__(self, width=8):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        self.layer_scale = nn.Parameter(torch.rand(width, 1, 1) + 0.5)

    def forward(self, x):  # x: (N, H, W, C)
        return self.layer_scale * torch.permute(self.fc2(self.act(self.fc1(x))), [0, 3, 1, 2])


class TimmStyle(nn.Module):
    """timm's ConvNeXt tail: drop2 (Dropout(0)), .permute(0, 3, 1, 2), .mul(gamma.reshape(1, -1, 1, 1))."""

    def __init__(self, width=8, p=0.0):
        super().__init__()
        self.fc, self.drop = nn.Linear(width, width), nn.Dropout(p)
        self.gamma = nn.Parameter(torch.rand(width) + 0.5)

    def forward(self, x):
        return self.drop(self.fc(x)).permute(0, 3, 1, 2).mul(self.gamma.reshape(1, -1, 1, 1))


class LayerScale(nn.Module):
    """timm's / CaiT's LayerScale after an attention projection: x * gamma."""

    def __init__(self, width=8):
        super().__init__()
        self.proj, self.gamma = nn.Linear(width, width), nn.Parameter(torch.rand(width) + 0.5)

    def forward(self, x):
        return x + self.proj(x) * self.gamma


@pytest.mark.parametrize("mode", ["fast", "memory"])
@pytest.mark.parametrize("model", [TorchvisionStyle(), TimmStyle(), LayerScale()], ids=lambda m: type(m).__name__)
def test_scale_merges_into_the_linear(mode, model):
    x = torch.randn(2, 3, 4, 8)
    optimized = fxfuse.optimize(copy.deepcopy(model), x, mode=mode)
    assert "fxfuse::act_linear_scale" in _ops(optimized)
    site = next(s for s in optimized.fxfuse_report.fused if s.op == "fxfuse::act_linear_scale")
    assert site.pattern == "linear→layer_scale" and site.modules[1] in ("layer_scale", "gamma")
    assert_equivalent(model, optimized, x, dtype=torch.float64)
    assert_equivalent(model, optimized, x)
    freed = measure.saved_activation_bytes(model, (x,)) - measure.saved_activation_bytes(optimized, (x,))
    others = sum(s.saved_bytes for s in optimized.fxfuse_report.fused if s is not site)
    assert freed == others + site.saved_bytes and site.saved_bytes == 2 * 3 * 4 * 8 * 4  # the linear's output


def test_dropout_switched_on_after_optimize_runs_eagerly():
    model, x = TimmStyle(), torch.randn(2, 3, 4, 8)
    optimized = fxfuse.optimize(copy.deepcopy(model), x, mode="fast")
    assert _ops(optimized) == ["fxfuse::act_linear_scale"]
    model.drop.p = optimized.drop.p = 0.5
    torch.manual_seed(0)
    ref = model(x)
    torch.manual_seed(0)
    assert torch.equal(optimized(x), ref)


class NotPerFeature(nn.Module):
    def __init__(self, scale_shape, buffer=False):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        scale = torch.rand(*scale_shape) + 0.5
        if buffer:
            self.register_buffer("gamma", scale)
        else:
            self.gamma = nn.Parameter(scale)

    def forward(self, x):
        return self.fc(x) * self.gamma


@pytest.mark.parametrize(
    "model, fused_at_call",
    [
        (NotPerFeature((8, 1)), None),  # scales rows (the shapes say so): left alone
        (NotPerFeature((1,)), None),  # one scalar for every feature: eager's broadcast
        (NotPerFeature((8,), buffer=True), None),  # not a parameter: left alone
        (NotPerFeature((8, 1)), False),  # without example inputs the pass cannot tell: the call runs eagerly
    ],
    ids=["rows", "scalar", "buffer", "rows-unseen"],
)
def test_other_scales(model, fused_at_call):
    x = torch.randn(2, 8, 8)
    optimized = fxfuse.optimize(copy.deepcopy(model), x if fused_at_call is None else None, mode="fast")
    assert ("fxfuse::act_linear_scale" in _ops(optimized)) == (fused_at_call is not None)
    assert_equivalent(model, optimized, x, dtype=torch.float64)
    if fused_at_call is False:  # eager keeps the linear output, and so does the eager run of the call
        assert measure.saved_activation_bytes(optimized, (x,)) == measure.saved_activation_bytes(model, (x,))


def test_linear_output_with_another_user_is_left_alone():
    class TwoUsers(LayerScale):
        def forward(self, x):
            y = self.proj(x)
            return y * self.gamma + y

    report = fxfuse.optimize(TwoUsers(), torch.randn(2, 8), mode="fast").fxfuse_report
    assert not report.fused


def test_convnext_blocks():
    convnext = torchvision.models.convnext_tiny()
    x = torch.randn(1, 3, 32, 32)
    eager_bytes = measure.saved_activation_bytes(convnext, (x,))
    report = fxfuse.optimize(convnext, x, mode="memory").fxfuse_report
    assert _ops(convnext).count("fxfuse::act_linear_scale") == 18
    site = next(s for s in report.fused if s.op == "fxfuse::act_linear_scale")
    assert site.modules == ("features.1.0.block.5", "features.1.0.layer_scale")
    act_linear = next(s for s in report.fused if s.modules == ("features.1.0.block.4", "features.1.0.block.5"))
    assert act_linear.merged_into == "features.1.0.layer_scale"
    assert "one fxfuse::act_linear_scale call" in act_linear.reason
    freed = eager_bytes - measure.saved_activation_bytes(convnext, (x,))
    assert freed >= sum(s.saved_bytes for s in report.fused)


def test_bfloat16_autocast_training_matches_eager_autocast():
    assert_trains_like_eager_autocast(TorchvisionStyle(), torch.randn(2, 3, 4, 8))
