"""Linear→GELU / Conv2d→GELU recompute fusion (mode="memory") and its interplay with the other passes.

A GELU that feeds a Linear merges into that Linear instead (passes/act_linear.py, same bytes,
no matmul recomputed): the MLPs here end in something else where linear_act is under test.
"""

import copy
import sys
from pathlib import Path

import pytest
import torch
import torchvision
from torch import nn

import fxfuse
from fxfuse import measure
from fxfuse.fusion import runtime
from fxfuse.testing import assert_equivalent

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from lenet5_gelu import LeNet5  # noqa: E402


def _ops(model):
    return sorted(s.op for s in model.fxfuse_report.fused)


def test_lenet5_gelu_is_exact_and_saves_the_gelu_inputs():
    model = LeNet5()
    x = torch.randn(8, 1, 28, 28)
    optimized = fxfuse.optimize(copy.deepcopy(model), x)
    # fc1→GELU→fc2→GELU→fc3: both GELUs merge into the Linear after them.
    assert _ops(optimized) == ["fxfuse::act_linear"] * 2 + ["fxfuse::conv_act"] * 2 + ["fxfuse::max_pool2d"] * 2
    assert_equivalent(model, optimized, x, dtype=torch.float64)
    saved = measure.saved_activation_bytes(model, (x,)) - measure.saved_activation_bytes(optimized, (x,))
    assert saved == optimized.fxfuse_report.saved_bytes


class MLP(nn.Module):
    def __init__(self, width=16, act=None):
        super().__init__()
        self.fc1 = nn.Linear(width, 4 * width)
        self.act = act or nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


class GatedHead(nn.Module):
    """Linear→act whose output is not a Linear's input (a gate): linear_act's pattern."""

    def __init__(self, width=16, act=None):
        super().__init__()
        self.fc = nn.Linear(width, 4 * width)
        self.act = act or nn.GELU(approximate="tanh")

    def forward(self, x):
        return (self.act(self.fc(x)) * x.repeat(1, 1, 4)).sum(-1)


@pytest.mark.parametrize("act", [nn.GELU(), nn.GELU(approximate="tanh"), nn.SiLU(), nn.Hardswish()])
def test_linear_act(act):
    model = GatedHead(act=act)
    optimized = fxfuse.optimize(copy.deepcopy(model))
    assert _ops(optimized) == ["fxfuse::linear_act"]
    assert_equivalent(model, optimized, torch.randn(2, 5, 16), dtype=torch.float64)
    # In a transformer MLP the activation merges into the next Linear instead.
    assert _ops(fxfuse.optimize(MLP(act=act))) == ["fxfuse::act_linear"]


def test_relu_and_inplace_activations_are_left_alone():
    # Their eager backward keeps the output, which the next layer keeps anyway: nothing to save.
    for act in (nn.ReLU(), nn.SiLU(inplace=True)):
        assert fxfuse.explain(MLP(act=act)).fused == []


def test_conv_bn_gelu_net_in_both_modes(monkeypatch):
    # ATen's kernels as on an AVX2 CPU, where the GELU pass rewrites a standalone GELU.
    monkeypatch.setattr(runtime, "aten_cpu_capability", lambda: "AVX2")
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.GELU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.GELU(),
        nn.Conv2d(8, 4, 1),
    )
    x = torch.randn(2, 3, 8, 8)
    memory = fxfuse.optimize(copy.deepcopy(model))
    fast = fxfuse.optimize(copy.deepcopy(model), mode="fast")
    assert _ops(memory) == ["fxfuse::conv_act", "fxfuse::conv_bn_act"]
    # fast mode never recomputes a conv; the conv's GELU is then standalone (picked per call at run time)
    assert _ops(fast) == ["fxfuse::bn_act_conv", "fxfuse::gelu"]  # BN→act merged into the conv after it
    for optimized in (memory, fast):
        assert_equivalent(model, optimized, x, dtype=torch.float64)


def test_convnext_tiny_is_exact():
    model = torchvision.models.convnext_tiny(num_classes=10)
    optimized = fxfuse.optimize(copy.deepcopy(model))
    assert _ops(optimized).count("fxfuse::act_linear") == 18  # every block's MLP
    assert_equivalent(model, optimized, torch.randn(2, 3, 32, 32), dtype=torch.float64)


@pytest.mark.parametrize("padding_mode", ["reflect", "circular"])
def test_conv_with_a_padding_mode_is_fused_like_every_module_site(padding_mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, padding_mode=padding_mode), nn.GELU()).double()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    optimized = fxfuse.optimize(copy.deepcopy(model), x)
    assert _ops(optimized) == ["fxfuse::conv_act"]
    assert_equivalent(model, optimized, x, steps=2)
