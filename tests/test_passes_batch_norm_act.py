"""BatchNorm2d → activation ⇒ fxfuse::batch_norm_act (passes/batch_norm_act.py): what it takes in each
mode, what it leaves, exactness against eager in float64 and the bytes it reports."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxfuse
from fxfuse import _extension, measure
from fxfuse.testing import assert_equivalent

pytestmark = pytest.mark.skipif(not _extension.loaded(), reason="fxfuse._C is not built")


def _ops(model):
    return sorted(s.op for s in model.fxfuse_report.fused)


class BnAct(nn.Module):
    """BN → activation whose output feeds no conv (else bn_act_conv merges it)."""

    def __init__(self, act, conv_first=False):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1) if conv_first else nn.Identity()
        self.bn = nn.BatchNorm2d(6 if conv_first else 3)
        self.act = act

    def forward(self, x):
        return F.adaptive_avg_pool2d(self.act(self.bn(self.conv(x))), 1).flatten(1)


class FunctionalBnAct(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(3) + 0.5)
        self.bias = nn.Parameter(torch.randn(3))
        self.register_buffer("running_mean", torch.zeros(3))
        self.register_buffer("running_var", torch.ones(3))

    def forward(self, x):
        y = F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, self.training, 0.1, 1e-5)
        return F.silu(y).mean((2, 3))


@pytest.mark.parametrize("mode", ["memory", "fast"])
@pytest.mark.parametrize("act", [nn.ReLU(), nn.SiLU(), nn.GELU(approximate="tanh"), nn.Hardswish()], ids=repr)
def test_bn_act_is_exact_in_every_mode(act, mode):
    model = BnAct(act)
    x = torch.randn(4, 3, 6, 5) * 2 + 1
    optimized = fxfuse.optimize(copy.deepcopy(model), x, mode=mode)
    assert _ops(optimized) == ["fxfuse::batch_norm_act"]
    assert_equivalent(model, optimized, x, dtype=torch.float64)


@pytest.mark.parametrize("act", [nn.SiLU(), nn.GELU(approximate="tanh")], ids=repr)
def test_reported_bytes_are_the_activation_input(act):
    # The BN output eager keeps for the activation's backward. (A ReLU keeps its output, which the
    # estimate leaves to the layer after it, usually a conv that keeps it anyway: it reports 0.)
    model = BnAct(act)
    x = torch.randn(4, 3, 6, 5)
    optimized = fxfuse.optimize(copy.deepcopy(model), x)
    saved = measure.saved_activation_bytes(model, (x,)) - measure.saved_activation_bytes(optimized, (x,))
    assert saved == optimized.fxfuse_report.saved_bytes == x.numel() * x.element_size()


def test_functional_batch_norm_and_activation():
    model = FunctionalBnAct()
    x = torch.randn(4, 3, 5, 5)
    optimized = fxfuse.optimize(copy.deepcopy(model), x)
    assert _ops(optimized) == ["fxfuse::batch_norm_act"]
    assert_equivalent(model, optimized, x, dtype=torch.float64)


def test_conv_bn_act_is_taken_whole_in_memory_mode_and_as_bn_act_in_fast_mode():
    model = BnAct(nn.SiLU(), conv_first=True)
    x = torch.randn(2, 3, 6, 6)
    assert _ops(fxfuse.optimize(copy.deepcopy(model), x, mode="memory")) == ["fxfuse::conv_bn_act"]
    fast = fxfuse.optimize(copy.deepcopy(model), x, mode="fast")
    (site,) = fast.fxfuse_report.fused
    assert site.op == "fxfuse::batch_norm_act" and "conv output kept" in site.reason
    assert_equivalent(model, fast, x, dtype=torch.float64)


def test_a_batch_norm_without_activation_is_left_alone():
    # A BN alone already keeps only its input: nothing to save.
    assert fxfuse.explain(BnAct(nn.Identity()), torch.randn(2, 3, 4, 4)).fused == []
