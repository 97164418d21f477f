"""FLOP formulas of fxfuse's ops (fxfuse/ops/flops.py): FlopCounterMode counts an optimized model's
train step as eager's plus exactly the recompute each fused site reports."""

import copy

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import fxfuse
from fxfuse import _extension

pytestmark = pytest.mark.skipif(not _extension.loaded(), reason="fxfuse._C is not built")


class EveryLayerOp(nn.Module):
    """conv→BN→ReLU, BN→ReLU→conv (and a conv→BN after it), conv→GELU, LayerNorm→Linear,
    GELU→Linear→LayerScale and Linear→SiLU: one site of every op that holds a conv or a matmul."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.mid = nn.Sequential(nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8))
        self.tail = nn.Sequential(nn.Conv2d(8, 8, 1, groups=2), nn.GELU())
        self.norm, self.fc1, self.act, self.fc2 = nn.LayerNorm(8), nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)
        self.head = nn.Sequential(nn.Linear(8, 8), nn.SiLU())
        self.gamma = nn.Parameter(torch.rand(8))

    def forward(self, x):
        x = self.tail(self.mid(self.stem(x))).permute(0, 2, 3, 1)
        return self.head(self.fc2(self.act(self.fc1(self.norm(x)))) * self.gamma)


class Concatenating(nn.Module):
    """Every op with a conv that keeps a concatenation's pieces (ops/cat_input.py): cat→conv, cat→conv→BN→ReLU,
    cat→BN→ReLU→conv, as DenseNet's and CSP's layers run them."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(3, 4, 1)
        self.conv = nn.Conv2d(8, 4, 1)
        self.conv_bn = nn.Sequential(nn.Conv2d(8, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.bn_conv = nn.Sequential(nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3, padding=1))

    def forward(self, x):
        a, b = self.a(x), self.b(x)
        return self.conv(torch.cat([a, b], 1)) + self.conv_bn(torch.cat([b, a], 1)) + self.bn_conv(torch.cat([a, b], 1))


def _step_flops(model, x) -> int:
    with FlopCounterMode(display=False) as counter:
        model(x).square().sum().backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("mode", ["fast", "memory"])
def test_optimized_step_counts_eagers_flops_plus_the_reported_recompute(mode):
    model, x = EveryLayerOp(), torch.randn(2, 3, 8, 8)
    optimized = fxfuse.optimize(copy.deepcopy(model), x, mode=mode)
    ops = {s.op for s in optimized.fxfuse_report.fused}
    expected_ops = {"fxfuse::bn_act_conv", "fxfuse::layer_norm_linear", "fxfuse::act_linear_scale"}
    if mode == "memory":
        expected_ops |= {"fxfuse::conv_bn_act", "fxfuse::conv_act", "fxfuse::linear_act"}
    assert expected_ops <= ops
    recompute = sum(s.recompute_flops for s in optimized.fxfuse_report.fused)
    assert (recompute > 0) == (mode == "memory")
    assert _step_flops(optimized, x) == _step_flops(model, x) + recompute


def test_forward_counts_equal_eager():
    model, x = EveryLayerOp(), torch.randn(2, 3, 8, 8)
    optimized = fxfuse.optimize(copy.deepcopy(model), x, mode="memory")
    for m in (model, optimized):
        m.eval()
    counts = []
    for m in (model, optimized):
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            m(x)
        counts.append(counter.get_total_flops())
    assert counts[0] == counts[1] > 0


def test_ops_keeping_pieces_count_their_conv():
    """The counter sees cat_<op> alone: without its formula an optimized DenseNet counted none of its 1x1
    convs, and recompute regions were costed without them."""
    model, x = Concatenating(), torch.randn(2, 3, 8, 8)
    optimized = fxfuse.optimize(copy.deepcopy(model), x, mode="memory")
    assert {"fxfuse::cat_conv2d", "fxfuse::cat_conv_bn_act", "fxfuse::cat_bn_act_conv"} <= {
        s.op for s in optimized.fxfuse_report.fused
    }
    recompute = sum(s.recompute_flops or 0 for s in optimized.fxfuse_report.fused)
    assert _step_flops(optimized, x) == _step_flops(model, x) + recompute
