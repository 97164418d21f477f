"""Large-kernel depthwise convs ⇒ fxfuse::conv2d (passes/depthwise_conv.py): what it takes, what it
leaves, exactness, and that it keeps what eager keeps."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxfuse
from fxfuse import measure
from fxfuse.testing import assert_equivalent


def _ops(model):
    return sorted(s.op for s in model.fxfuse_report.fused)


class ConvNeXtBlock(nn.Module):
    """torchvision's CNBlock, minus the layer scale: 7×7 depthwise conv, LayerNorm, MLP."""

    def __init__(self, c=16, kernel=7, groups=None):
        super().__init__()
        self.dw = nn.Conv2d(c, c, kernel, padding=kernel // 2, groups=c if groups is None else groups)
        self.norm = nn.LayerNorm(c)
        self.fc1, self.fc2 = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)

    def forward(self, x):
        y = self.dw(x).permute(0, 2, 3, 1)
        y = self.fc2(F.gelu(self.fc1(self.norm(y))))
        return x + y.permute(0, 3, 1, 2)


class Functional(nn.Module):
    def __init__(self, c=8):
        super().__init__()
        self.w = nn.Parameter(torch.randn(c, 1, 5, 5) / 5)
        self.c = c

    def forward(self, x):
        return F.conv2d(x, self.w, None, 1, 2, 1, self.c).relu()


def _x(c=16):
    return torch.randn(2, c, 10, 10).contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("mode", ["fast", "memory"])
def test_convnext_block_exact(mode):
    model, x = ConvNeXtBlock(), _x()
    optimized = fxfuse.optimize(copy.deepcopy(model), (x,), mode=mode)
    # mode="memory" takes the conv with the norm and fc1 (passes/conv_layer_norm_linear.py)
    assert ("fxfuse::conv2d" if mode == "fast" else "fxfuse::conv_layer_norm_linear") in _ops(optimized)
    assert_equivalent(model, optimized, x, dtype=torch.float64)
    assert_equivalent(model, optimized, x)


def test_functional_form():
    model, x = Functional(), _x(8)
    optimized = fxfuse.optimize(copy.deepcopy(model), (x,))
    assert _ops(optimized) == ["fxfuse::conv2d"]
    assert optimized.fxfuse_report.fused[0].pattern == "depthwise_conv"
    assert_equivalent(model, optimized, x, dtype=torch.float64)


@pytest.mark.parametrize("case", ["3x3", "grouped", "dense"])
def test_other_convs_are_left_alone(case):
    kernel, groups = {"3x3": (3, None), "grouped": (7, 8), "dense": (7, 1)}[case]
    model = ConvNeXtBlock(kernel=kernel, groups=groups)
    optimized = fxfuse.optimize(copy.deepcopy(model), (_x(),))
    assert "fxfuse::conv2d" not in _ops(optimized)


def test_conv_with_hooks_is_left_alone():
    model = ConvNeXtBlock()
    model.dw.register_forward_hook(lambda *a: None)
    optimized = fxfuse.optimize(copy.deepcopy(model), (_x(),))
    assert "fxfuse::conv2d" not in _ops(optimized)


def test_keeps_what_eager_keeps():
    model, x = ConvNeXtBlock(c=32), _x(32)
    optimized = fxfuse.optimize(copy.deepcopy(model), (x,), mode="fast")
    only_conv = fxfuse.optimize(nn.Sequential(copy.deepcopy(model.dw)), (x,))
    assert _ops(only_conv) == ["fxfuse::conv2d"]
    eager_conv = nn.Sequential(model.dw)
    assert measure.saved_activation_bytes(only_conv, (x,)) == measure.saved_activation_bytes(eager_conv, (x,))
    assert measure.saved_activation_bytes(optimized, (x,)) < measure.saved_activation_bytes(model, (x,))


def test_state_dict_and_module_are_the_users():
    model = ConvNeXtBlock()
    optimized = fxfuse.optimize(model, (_x(),))
    assert optimized.state_dict().keys() == ConvNeXtBlock().state_dict().keys()
    assert optimized.get_submodule("dw") is model.dw
