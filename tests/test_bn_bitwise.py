"""fxfuse's CPU BatchNorm training forward is eager's bit for bit.

Output, batch statistics, running statistics and num_batches_tracked of batch_norm_act,
conv_bn_act and an optimized model equal eager's exactly, so every ReLU input (and every
other activation branch) falls on the same side as in eager, and a pre-activation that
float32 rounding moves across a kink moves the same way in both (tests/test_accuracy.py
for why that matters). test_cpu_capabilities.py reruns this file under every CPU
capability ATen can pick here: ATen's AVX2 and AVX-512 kernels round z = x * alpha + beta
once (fused multiply-add), its baseline kernels twice, and fxfuse must follow.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from support import reference
from support.reference import ACTS
from torch import nn

import fxfuse
from fxfuse import _extension
from fxfuse.ops import batch_norm_act, conv_bn_act

pytestmark = pytest.mark.skipif(not _extension.loaded(), reason="fxfuse._C is not built")

# N*H*W = 8 (deep low-resolution layers), 1x1 spatial (ATen's row kernels), odd C and H*W
# (vector remainders), C above one vector, a ResNet-sized plane.
SHAPES = [(2, 8, 2, 2), (2, 3, 1, 1), (16, 33, 1, 1), (2, 7, 5, 3), (3, 17, 9, 11), (4, 40, 2, 2), (2, 64, 28, 28)]
LAYOUTS = [torch.contiguous_format, torch.channels_last]
DTYPES = [torch.float32, torch.float64]


def _input(shape, dtype, fmt, seed=0):
    g = torch.Generator().manual_seed(seed)
    # per-channel offsets of 10 std: statistics that cancel if summed carelessly
    x = (
        torch.randn(shape, generator=g, dtype=dtype) * 3
        + torch.randn(shape[1], generator=g, dtype=dtype).view(1, -1, 1, 1) * 10
    )
    return x.contiguous(memory_format=fmt)


def _bn_args(C, dtype, affine, seed=1):
    g = torch.Generator().manual_seed(seed)
    w, b = (torch.randn(C, generator=g, dtype=dtype) for _ in range(2)) if affine else (None, None)
    return w, b, torch.randn(C, generator=g, dtype=dtype), torch.rand(C, generator=g, dtype=dtype) + 0.5


def assert_bitwise(got, want, what):
    assert got.dtype == want.dtype and got.shape == want.shape, what
    same = (got == want) | (got.isnan() & want.isnan())
    assert bool(same.all()), f"{what}: {int((~same).sum())} of {same.numel()} elements differ, max |d| " + str(
        (got - want).abs().max().item()
    )


@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
@pytest.mark.parametrize("fmt", LAYOUTS, ids=["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_batch_norm_act_training_forward(shape, dtype, fmt, affine):
    x = _input(shape, dtype, fmt)
    w, b, rm, rv = _bn_args(shape[1], dtype, affine)
    rm_e, rv_e, rm_f, rv_f = rm.clone(), rv.clone(), rm.clone(), rv.clone()
    want, save_mean, _ = torch.ops.aten.native_batch_norm(x, w, b, rm_e, rv_e, True, 0.1, 1e-5)
    got = batch_norm_act(x, rm_f, rv_f, w, b, True, 0.1, 1e-5, "none")
    assert_bitwise(got, want, "output")
    assert_bitwise(rm_f, rm_e, "running_mean")
    assert_bitwise(rv_f, rv_e, "running_var")
    mean, var, unbiased = torch.ops.fxfuse.bn_stats(x)
    assert_bitwise(mean, save_mean, "mean")
    want_var = torch.batch_norm_update_stats(x, None, None, 0.1)[1]
    assert_bitwise(var, want_var, "var")


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("act,act_param", [a for a in ACTS if a[0] != "none"])
@pytest.mark.parametrize("fmt", LAYOUTS, ids=["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_batch_norm_act_activation_forward(act, act_param, dtype, fmt):
    """The activation is eager's bit for bit too: same formula, ATen's own exp/erf/tanh (not
    the faster inline polynomials the backward uses) and its FMA rounding. Without it a
    SiLU output one ulp off decorrelates fxfuse's rounding from eager's in every later
    layer: efficientnet_b0's gradients came out up to 2.4x eager's error against float64
    instead of <= 1.5x (tests/test_accuracy.py). Eager's float32 GELU on a contiguous NCHW
    tensor runs oneDNN's kernel, not ATen's; the reference there is ATen's (what eager runs
    on channels_last, or with oneDNN off). ATen computes the last few elements of each
    thread's chunk (less than two vectors) with its scalar formula (std::exp, std::tanh),
    which can round differently; fxfuse runs the vector formula on every element, so the
    check runs one thread on a shape without such a tail (21280 elements, a multiple of 32)."""
    x = _input((32, 19, 5, 7), dtype, fmt)
    w, b, rm, rv = _bn_args(19, dtype, True)
    with torch.backends.mkldnn.flags(enabled=False):
        want = reference.batch_norm_act(x, rm.clone(), rv.clone(), w, b, True, 0.1, 1e-5, act, act_param)
    got = batch_norm_act(x, rm.clone(), rv.clone(), w, b, True, 0.1, 1e-5, act, act_param)
    assert_bitwise(got, want, f"{act} output")


@pytest.mark.parametrize("fmt", LAYOUTS, ids=["nchw", "nhwc"])
@pytest.mark.parametrize("shape", [(2, 5, 6, 6), (8, 16, 1, 1), (2, 24, 7, 7)], ids=lambda s: "x".join(map(str, s)))
def test_conv_bn_relu_training_forward(shape, fmt):
    N, C, H, W = shape
    x = _input((N, 3, H, W), torch.float32, fmt)
    conv_w = torch.randn(C, 3, 3, 3).contiguous(memory_format=fmt)
    w, b, rm, rv = _bn_args(C, torch.float32, True)
    rm_e, rv_e, rm_f, rv_f = rm.clone(), rv.clone(), rm.clone(), rv.clone()
    want = F.relu(F.batch_norm(F.conv2d(x, conv_w, None, 1, 1), rm_e, rv_e, w, b, True, 0.1, 1e-5))
    got = conv_bn_act(x, conv_w, None, 1, 1, 1, 1, rm_f, rv_f, w, b, True, 0.1, 1e-5, "relu")
    assert_bitwise(got, want, "output")
    assert_bitwise(rm_f, rm_e, "running_mean")
    assert_bitwise(rv_f, rv_e, "running_var")


@pytest.mark.parametrize("mode", ["memory", "fast"])
@pytest.mark.parametrize("fmt", LAYOUTS, ids=["nchw", "nhwc"])
def test_optimized_model_training_steps(fmt, mode):
    """Three training forwards of Conv->BN->ReLU blocks at 2x2 spatial: outputs, every
    running statistic and num_batches_tracked stay eager's exactly (momentum=None too)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16, momentum=None), nn.ReLU(),
        nn.BatchNorm2d(16), nn.ReLU(),
    ).to(memory_format=fmt)  # fmt: skip
    eager, fused = copy.deepcopy(model), fxfuse.optimize(copy.deepcopy(model), mode=mode)
    assert fused.fxfuse_report.fused
    for step in range(3):
        x = torch.randn(2, 3, 2, 2).contiguous(memory_format=fmt) * 4 + step
        assert_bitwise(fused(x), eager(x), f"step {step} output")
        buffers = dict(fused.named_buffers())
        for name, want in eager.named_buffers():
            assert_bitwise(buffers[name], want, f"step {step} {name}")
