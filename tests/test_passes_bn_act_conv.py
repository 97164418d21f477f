"""passes/bn_act_conv.py: a rewritten BN→activation site merged into the one conv it feeds,
so the activation output is not kept for backward."""

import copy
import importlib

import pytest
import torch
from torch import nn

import fxfuse
from fxfuse.fusion import runtime
from fxfuse.measure import saved_activation_bytes
from fxfuse.testing import assert_equivalent

F64 = torch.float64
install_module = importlib.import_module("fxfuse.fusion.install")


class Chain(nn.Module):
    """conv → BN → ReLU → conv → BN → ReLU → conv → BN, plus the input (a ResNet bottleneck)."""

    def __init__(self, c=4, conv2=None, shared_relu_output=False):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = conv2 or nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv3, self.bn3 = nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)
        self.shared = shared_relu_output

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        extra = out * 0.5 if self.shared else 0.0  # a second user of bn1's activation output
        out = self.relu(self.bn2(self.conv2(out)))
        return self.bn3(self.conv3(out)) + x + extra


class PreActivation(nn.Module):
    """BN → ReLU → conv → BN, plus the input (a pre-activation residual unit)."""

    def __init__(self, c=4):
        super().__init__()
        self.bn0, self.conv1, self.bn1 = nn.BatchNorm2d(c), nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)

    def forward(self, x):
        return self.bn1(self.conv1(torch.relu(self.bn0(x)))) + x


def _ops(model):
    return [s.op for s in model.fxfuse_report.fused]


def _calls(model, target):
    state = model.__dict__[install_module._STATE]
    graph = state.fx_graphs[install_module._key(state, pattern=state.last_pattern)]
    return [n for n in graph.nodes if n.op == "call_function" and n.target is target]


@pytest.mark.parametrize("mode", ["fast", "auto"])
def test_merges_bn_activation_into_the_next_conv_exactly(mode):
    torch.manual_seed(0)
    model = Chain().to(F64)
    x = torch.randn(2, 4, 6, 6, dtype=F64)
    optimized = fxfuse.optimize(copy.deepcopy(model), x, mode=mode)
    assert _ops(optimized).count("fxfuse::bn_act_conv") == 2, optimized.fxfuse_report
    assert len(_calls(optimized, runtime.bn_act_conv_module)) == 2
    assert_equivalent(model, optimized, x, steps=2)


def test_merged_model_keeps_less_and_the_report_says_so():
    torch.manual_seed(0)
    model = Chain(c=8)
    x = torch.randn(4, 8, 16, 16)
    optimized = fxfuse.optimize(copy.deepcopy(model), x, mode="fast")
    eager_bytes = saved_activation_bytes(model, (x,))
    fused_bytes = saved_activation_bytes(optimized, (x,))
    activation = x.numel() * x.element_size()
    # Eager keeps each ReLU output for the next conv; the merged ops keep only the BN inputs.
    assert eager_bytes - fused_bytes == 2 * activation
    merged = [s for s in optimized.fxfuse_report.fused if s.op == "fxfuse::bn_act_conv"]
    assert all(s.saved_bytes == activation for s in merged)
    assert all("not kept: rebuilt in conv" in s.reason for s in merged)


def test_epilogue_merge_and_add_into_exact():
    """mode="memory": BN0→ReLU merges into conv1's Conv→BN site (the epilogue form, which
    recomputes conv1), and the residual add writes over the merged op's fresh output."""
    torch.manual_seed(0)
    model = PreActivation().to(F64)
    x = torch.randn(2, 4, 6, 6, dtype=F64)
    optimized = fxfuse.optimize(copy.deepcopy(model), x, mode="memory")
    (call,) = _calls(optimized, runtime.bn_act_conv_module)
    assert len(call.args) == 8 and call.args[6] == "none"
    (add,) = _calls(optimized, runtime.add_into)
    assert add.args[0] is call
    assert_equivalent(model, optimized, x, steps=2)


@pytest.mark.parametrize(
    "why",
    ["second user", "reflect padding", "hook"],
)
def test_not_merged(why):
    torch.manual_seed(0)
    conv2 = nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect", bias=False) if why == "reflect padding" else None
    model = Chain(conv2=conv2, shared_relu_output=why == "second user").to(F64)
    if why == "hook":
        model.conv2.register_forward_hook(lambda m, i, o: None)
    x = torch.randn(2, 4, 6, 6, dtype=F64)
    optimized = fxfuse.optimize(copy.deepcopy(model), x, mode="fast")
    merged = [s.modules for s in optimized.fxfuse_report.fused if s.op == "fxfuse::bn_act_conv"]
    assert merged == [("bn2", "relu")], optimized.fxfuse_report
    if why != "hook":
        assert_equivalent(model, optimized, x, steps=2)


def test_autocast_follows_eager_precision():
    """Under CPU bfloat16 autocast the merged op runs the conv on bfloat16 operands, as eager does."""
    torch.manual_seed(0)
    model = Chain()
    x = torch.randn(2, 4, 6, 6)
    optimized = fxfuse.optimize(copy.deepcopy(model), x, mode="fast")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, ref = optimized(x), model(x)
    assert out.dtype == ref.dtype  # float32: the residual add promotes the bfloat16 BN output
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


class LeakyPreActivation(nn.Module):
    """BN → LeakyReLU(0.2) → conv: the merged op must apply the activation's parameter."""

    def __init__(self, c=4):
        super().__init__()
        self.bn0, self.act, self.conv1 = nn.BatchNorm2d(c), nn.LeakyReLU(0.2), nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return self.conv1(self.act(self.bn0(x)))


@pytest.mark.parametrize("mode", ["fast", "memory"])
def test_merged_activation_keeps_its_parameter(mode):
    torch.manual_seed(0)
    model = LeakyPreActivation().to(F64)
    x = torch.randn(2, 4, 6, 6, dtype=F64)
    optimized = fxfuse.optimize(copy.deepcopy(model), x, mode=mode)
    (call,) = _calls(optimized, runtime.bn_act_conv_module)
    assert call.args[2:4] == ("leaky_relu", 0.2)
    assert_equivalent(model, optimized, x, steps=2)
