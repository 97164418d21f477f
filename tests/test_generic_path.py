"""The device-generic implementations (csrc/generic/: what CUDA, for the ops without a CUDA
kernel, and every other device run) on CPU, through fxfuse.ops.generic_path(): the switch
routes, an optimized model computes eager's function through them end to end, and each op
family holds no more memory than eager's ATen composition of the same work
(tests/generic_peaks.py; the README's table is benchmarks/generic_peaks.py)."""

import generic_peaks as gp
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxfuse
from fxfuse import _extension
from fxfuse.ops import generic_path
from fxfuse.ops.routing import generic_path_enabled
from fxfuse.testing import assert_equivalent

pytestmark = pytest.mark.skipif(not _extension.loaded(), reason="fxfuse._C is not built")


def test_switch_nests_and_restores():
    assert not generic_path_enabled()
    with generic_path():
        assert generic_path_enabled()
        with generic_path(False):
            assert not generic_path_enabled()
        assert generic_path_enabled()
    with pytest.raises(RuntimeError, match="inside"), generic_path():
        raise RuntimeError("inside")
    assert not generic_path_enabled()


def _op_names(fn) -> set:
    with torch.profiler.profile() as prof:
        fn()
    return {e.name for e in prof.events()}


def test_cpu_tensors_take_the_generic_kernels_inside_the_switch():
    x, m, v = torch.randn(2, 3, 4, 5), torch.zeros(3), torch.ones(3)

    def call():
        torch.ops.fxfuse.bn_act(x, m, v, None, None, 1e-5, "relu", 0.0)

    assert "aten::native_batch_norm" not in _op_names(call)  # the hand-written CPU kernel
    with generic_path():
        assert "aten::native_batch_norm" in _op_names(call)


class _EveryFamily(nn.Module):
    """conv_bn_act, bn_act_conv with an epilogue, conv_layer_norm_linear, act_linear_scale,
    conv_act, batch_norm_act, linear_act / act_linear (mode="memory")."""

    def __init__(self, c=8):
        super().__init__()
        self.stem, self.bn0 = nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.bn1, self.conv1, self.bn2 = nn.BatchNorm2d(c), nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.dw, self.ln = nn.Conv2d(c, c, 7, padding=3, groups=c), nn.LayerNorm(c)
        self.fc1, self.fc2 = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)
        self.gamma = nn.Parameter(torch.full((c,), 0.5))
        self.conv3, self.bn3 = nn.Conv2d(c, c, 1), nn.BatchNorm2d(c)
        self.head1, self.head2 = nn.Linear(c, 16), nn.Linear(16, 4)

    def forward(self, x):
        x = F.relu(self.bn0(self.stem(x)))
        y = F.gelu(self.bn2(self.conv1(F.silu(self.bn1(x)))))
        h = self.fc2(F.gelu(self.fc1(self.ln(self.dw(y).permute(0, 2, 3, 1)))))
        y = y + (h * self.gamma).permute(0, 3, 1, 2)
        y = F.relu6(self.bn3(F.hardswish(self.conv3(y))))
        return self.head2(F.gelu(self.head1(y.mean((2, 3)))))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_optimized_model_matches_eager_through_the_generic_path(dtype, channels_last):
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model = _EveryFamily().to(memory_format=fmt)
    optimized = fxfuse.optimize(_EveryFamily().to(memory_format=fmt), mode="memory")
    optimized.load_state_dict(model.state_dict())
    ops = {site.op.removeprefix("fxfuse::") for site in optimized.fxfuse_report.fused}
    assert {"conv_bn_act", "bn_act_conv", "conv_layer_norm_linear", "act_linear_scale", "conv_act"} <= ops, ops
    x = torch.randn(3, 3, 10, 10).contiguous(memory_format=fmt)
    with generic_path():
        # outputs, every gradient, running statistics and counters, train and eval
        assert_equivalent(model, optimized, x, dtype=dtype)


SLACK = 4096  # per-channel vectors (statistics, invstd, parameter gradients) of C = 32


def _usages(case):
    eager = gp.measure_step(case.eager, case.leaves, case.dy)
    with generic_path():
        generic = gp.measure_step(case.fused, case.leaves, case.dy)
    kernels = gp.measure_step(case.fused, case.leaves, case.dy)
    return eager, generic, kernels


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_each_op_family_holds_no_more_than_eager(channels_last, one_thread):
    over = []
    for case in gp.step_cases(torch.float32, channels_last, size=16):
        eager, generic, kernels = _usages(case)
        if generic.forward_peak > eager.forward_peak + SLACK or generic.backward_peak > eager.backward_peak + SLACK:
            over.append((case.name, eager, generic))
        # the rewrite keeps what the ops save
        assert generic.saved == kernels.saved <= eager.saved + SLACK, case.name
    if channels_last and [name for name, _, _ in over] == ["bn_act_conv[relu]"]:
        # Known: 693 against eager's 672 KiB at this shape (+3%); the prologue's generic
        # bn_act_backward_into_grad_ holds z, native_batch_norm_backward's grad_input and its
        # CPU temporary next to grad_x. Open; the CUDA kernel writes over grad_x in place.
        pytest.xfail(f"bn_act_conv channels_last backward above eager's: {over}")
    assert not over, over


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_primitive_ops_hold_no_more_than_eager(dtype, channels_last, one_thread):
    for case in gp.call_cases(dtype, channels_last, size=16):
        eager = gp.measure_call(case.eager)
        with generic_path():
            generic = gp.measure_call(case.fused)
        assert generic <= eager + SLACK, (case.name, generic, eager)
