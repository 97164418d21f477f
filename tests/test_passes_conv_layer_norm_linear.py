"""Conv2d → permute → LayerNorm → Linear ⇒ fxfuse::conv_layer_norm_linear (passes/conv_layer_norm_linear.py):
what it takes, what it leaves, exactness, the bytes it frees, and how the budget ranks it."""

import copy

import pytest
import timm
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

import fxfuse
from fxfuse import measure
from fxfuse.testing import assert_equivalent


def _ops(model):
    return sorted(s.op for s in model.fxfuse_report.fused)


class Block(nn.Module):
    """ConvNeXt's block start; `tap` also returns the conv output (which must then be kept)."""

    def __init__(self, c=16, functional_norm=False, tap=False):
        super().__init__()
        self.dw = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm = nn.LayerNorm(c, eps=1e-6)
        self.fc1, self.fc2 = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)
        self.functional_norm, self.tap = functional_norm, tap

    def forward(self, x):
        y = self.dw(x)
        z = y.permute(0, 2, 3, 1)
        if self.functional_norm:
            z = F.layer_norm(z, self.norm.normalized_shape, self.norm.weight, self.norm.bias, 1e-6)
        else:
            z = self.norm(z)
        out = self.fc2(F.gelu(self.fc1(z)))
        return (out, y) if self.tap else out


def _x(c=16):
    return torch.randn(2, c, 9, 9).contiguous(memory_format=torch.channels_last)


def test_memory_mode_takes_it_and_is_exact():
    model, x = Block(), _x()
    optimized = fxfuse.optimize(copy.deepcopy(model), (x,), mode="memory")
    assert "fxfuse::conv_layer_norm_linear" in _ops(optimized)
    site = next(s for s in optimized.fxfuse_report.fused if s.op == "fxfuse::conv_layer_norm_linear")
    assert site.modules == ("dw", "norm", "fc1")
    assert_equivalent(model, optimized, x, dtype=torch.float64)
    assert_equivalent(model, optimized, x)


def test_frees_the_conv_output():
    model, x = Block(c=32), _x(32)
    fast = fxfuse.optimize(copy.deepcopy(model), (x,), mode="fast")
    memory = fxfuse.optimize(copy.deepcopy(model), (x,), mode="memory")
    freed = measure.saved_activation_bytes(fast, (x,)) - measure.saved_activation_bytes(memory, (x,))
    assert freed >= x.numel() * x.element_size()  # at least the conv output (fc1's GELU input may go too)


def test_functional_norm():
    model, x = Block(functional_norm=True), _x()
    optimized = fxfuse.optimize(copy.deepcopy(model), (x,), mode="memory")
    assert "fxfuse::conv_layer_norm_linear" in _ops(optimized)
    assert_equivalent(model, optimized, x, dtype=torch.float64)


def test_fast_mode_leaves_it():
    optimized = fxfuse.optimize(Block(), (_x(),), mode="fast")
    assert "fxfuse::conv_layer_norm_linear" not in _ops(optimized)
    assert "fxfuse::layer_norm_linear" in _ops(optimized)


def test_conv_output_used_elsewhere_is_left():
    optimized = fxfuse.optimize(Block(tap=True), (_x(),), mode="memory")
    assert "fxfuse::conv_layer_norm_linear" not in _ops(optimized)


def test_timm_convnext_float64():
    model = timm.create_model("convnext_atto", num_classes=10, conv_mlp=False)  # timm's LayerNorm, F.layer_norm
    x = torch.randn(2, 3, 64, 64)
    optimized = fxfuse.optimize(copy.deepcopy(model), (x,), mode="memory")
    assert _ops(optimized).count("fxfuse::conv_layer_norm_linear") == 12
    assert_equivalent(model, optimized, x, dtype=torch.float64, steps=1)


@pytest.mark.parametrize("budget", [0.9, 0.6])
def test_budget_ranks_it_with_the_other_upgrades(budget):
    model = torchvision.models.convnext_tiny(num_classes=10)
    x = torch.randn(2, 3, 64, 64)
    optimized = fxfuse.optimize(copy.deepcopy(model), (x,), memory_budget=budget)
    decision = optimized.fxfuse_report
    saved = measure.saved_activation_bytes(optimized, (x,))
    assert saved <= budget * measure.saved_activation_bytes(model, (x,))
    assert decision.fused
