"""Hand-written CPU kernels (fxfuse/csrc/cpu/) against the device-generic kernels
and against plain eager PyTorch.

On CPU tensors, torch.ops.fxfuse.{bn_stats,bn_act,bn_act_backward} dispatch to the
hand-written kernels; the generic ATen implementations are reachable directly as
torch.ops.fxfuse_generic.*.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from support import cpu_probe

from fxfuse import _extension
from fxfuse.ops.activations import REGISTRY

pytestmark = pytest.mark.skipif(not _extension.loaded(), reason="fxfuse._C is not built")

if _extension.loaded():
    _C = _extension.generic_kernels()
    ops = torch.ops.fxfuse

# Every activation, with two act_params where it takes one (leaky_relu's slope).
ACTS = [(name, p) for name, spec in REGISTRY.items() for p in ((0.01, 0.2) if spec.takes_param else (0.0,))]
ACT_IDS = [f"{a}{p:g}" if p else a for a, p in ACTS]

# Odd sizes on purpose: C=1/3/17, H*W=1/7/35 (vector remainders), N=1.
SHAPES = [
    (2, 3, 5, 7),
    (1, 17, 1, 7),
    (3, 1, 3, 3),
    (5, 17, 1, 1),
    (2, 16, 4, 6),
    (1, 3, 1, 1),
]
LAYOUTS = ["contiguous", "channels_last"]
DTYPES = [torch.float32, torch.float64]
AFFINE = [(True, True), (False, False), (True, False), (False, True)]
MASKS = [list(m) for m in itertools.product([False, True], repeat=3)]
EPS = 1e-5


def tol(dtype):
    return 1e-10 if dtype == torch.float64 else 1e-5


def layout(t, name):
    return t.contiguous(memory_format=torch.channels_last) if name == "channels_last" else t


def make_input(shape, dtype, lay, seed=0, offset=0.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 2.0 + 0.5 + offset
    return layout(x.to(dtype), lay)


def make_params(C, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    w = (torch.rand(C, generator=g, dtype=torch.float64) + 0.5).to(dtype)
    b = (torch.randn(C, generator=g, dtype=torch.float64) * 0.5).to(dtype)
    mean = (torch.randn(C, generator=g, dtype=torch.float64) * 0.3 + 0.5).to(dtype)
    var = (torch.rand(C, generator=g, dtype=torch.float64) * 3 + 0.5).to(dtype)
    return w, b, mean, var


def eager_act(z, act, p):
    if act == "none":
        return z
    if act == "relu":
        return F.relu(z)
    if act == "relu6":
        return F.hardtanh(z, 0.0, 6.0)
    if act == "leaky_relu":
        return F.leaky_relu(z, p)
    if act == "gelu":
        return F.gelu(z)
    if act == "gelu_tanh":
        return F.gelu(z, approximate="tanh")
    if act == "silu":
        return F.silu(z)
    if act == "hardswish":
        return F.hardswish(z)
    raise AssertionError(act)


def close(actual, expected, t, scale=1.0, equal_nan=False):
    """assert_close with an absolute tolerance scaled to the reference's size."""
    if expected is None:
        assert actual is None
        return
    assert actual is not None
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    finite = expected[torch.isfinite(expected)]
    mag = float(finite.abs().max()) if finite.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=t, atol=t * scale * (1.0 + mag), equal_nan=equal_nan)


def same_layout(out, ref_input):
    if ref_input.is_contiguous():
        assert out.is_contiguous()
    else:
        assert out.is_contiguous(memory_format=torch.channels_last)
    assert out.stride() == ref_input.stride()


# ----------------------------------------------------------------------------- stats


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("lay", LAYOUTS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_bn_stats(shape, lay, dtype):
    x = make_input(shape, dtype, lay)
    mean, var, _ = ops.bn_stats(x)
    gmean, gvar, _ = _C.bn_stats(x)
    close(mean, gmean, tol(dtype))
    close(var, gvar, tol(dtype))
    evar, emean = torch.var_mean(x, dim=(0, 2, 3), unbiased=False)
    close(mean, emean, tol(dtype))
    close(var, evar, tol(dtype))


@pytest.mark.parametrize("lay", LAYOUTS)
def test_bn_stats_ill_conditioned_float64(lay):
    # |mean| >> std: a naive sum-of-squares formula loses ~6 digits here.
    g = torch.Generator().manual_seed(3)
    x = layout(1000.0 + torch.randn(6, 5, 20, 21, generator=g, dtype=torch.float64), lay)
    mean, var, _ = ops.bn_stats(x)
    gmean, gvar, _ = _C.bn_stats(x)
    torch.testing.assert_close(mean, gmean, rtol=1e-12, atol=0)
    torch.testing.assert_close(var, gvar, rtol=1e-12, atol=0)
    # float32 input: accumulated in double, so still accurate.
    mean32, var32, _ = ops.bn_stats(x.float())
    torch.testing.assert_close(var32, gvar.float(), rtol=2e-5, atol=0)
    torch.testing.assert_close(mean32, gmean.float(), rtol=1e-6, atol=0)


# ---------------------------------------------------------------------------- forward


@pytest.mark.parametrize("act,p", ACTS, ids=ACT_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("lay", LAYOUTS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_bn_act_forward(shape, lay, dtype, act, p):
    x = make_input(shape, dtype, lay)
    w, b, mean, var = make_params(shape[1], dtype)
    t = tol(dtype)
    for has_w, has_b in AFFINE:
        ww, bb = (w if has_w else None), (b if has_b else None)
        out = ops.bn_act(x, mean, var, ww, bb, EPS, act, p)
        same_layout(out, x)
        ref = _C.bn_act(x, mean, var, ww, bb, EPS, act, p)
        close(out, ref, t)
        if has_w and has_b:
            eager = eager_act(F.batch_norm(x, mean, var, ww, bb, False, 0.0, EPS), act, p)
            close(out, eager, t * 10)


# --------------------------------------------------------------------------- backward


def grads_generic(dy, x, mean, var, w, b, act, p, bs, mask):
    return _C.bn_act_backward(dy, x, mean, var, w, b, EPS, act, p, bs, mask)


@pytest.mark.parametrize("act,p", ACTS, ids=ACT_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("lay", LAYOUTS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_bn_act_backward_vs_generic(shape, lay, dtype, act, p):
    x = make_input(shape, dtype, lay)
    dy = make_input(shape, dtype, lay, seed=7)
    w, b, rmean, rvar = make_params(shape[1], dtype)
    bmean, bvar, _ = _C.bn_stats(x)
    t = tol(dtype)
    scale = max(1.0, (x.numel() / shape[1]) ** 0.5)
    # every output_mask with weight and bias; every weight/bias presence with all outputs
    combos = [(bs, (True, True), m) for bs in (True, False) for m in MASKS]
    combos += [(bs, aff, [True] * 3) for bs in (True, False) for aff in AFFINE[1:]]
    # One value per channel with batch statistics: x - mean is exactly 0, so the generic
    # path's z is exactly the bias, while the kernels' z = x * alpha + beta (eager's) keeps
    # the rounding of x * alpha, alpha ~ weight / sqrt(eps): a few ulps of ~300 |x|, which
    # the activation's derivative passes on.
    z_rounding = float(x.abs().max() * w.abs().max()) / EPS**0.5 * torch.finfo(dtype).eps * 8 / t
    for bs, (has_w, has_b), mask in combos:
        mean, var = (bmean, bvar) if bs else (rmean, rvar)
        ww, bb = (w if has_w else None), (b if has_b else None)
        got = ops.bn_act_backward(dy, x, mean, var, ww, bb, EPS, act, p, bs, mask)
        ref = grads_generic(dy, x, mean, var, ww, bb, act, p, bs, mask)
        assert (got[0] is not None) == mask[0]
        assert (got[1] is not None) == (mask[1] and has_w)
        assert (got[2] is not None) == (mask[2] and has_b)
        s = scale * (1 + z_rounding) if bs and x.numel() == shape[1] else scale
        close(got[0], ref[0], t, s)
        close(got[1], ref[1], t, s)
        close(got[2], ref[2], t, s)
        if got[0] is not None:
            same_layout(got[0], x)


@pytest.mark.parametrize("act,p", ACTS, ids=ACT_IDS)
@pytest.mark.parametrize("lay", LAYOUTS)
@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (3, 17, 1, 1)], ids=str)
def test_bn_act_backward_vs_autograd(shape, lay, act, p):
    """Training (batch statistics) and eval (running statistics) batch norm + act,
    differentiated by autograd, in float64."""
    dtype = torch.float64
    x0 = make_input(shape, dtype, lay)
    dy = make_input(shape, dtype, lay, seed=5)
    w0, b0, rmean, rvar = make_params(shape[1], dtype)
    t = 1e-9
    for bs in (True, False):
        x = x0.clone().requires_grad_()
        w = w0.clone().requires_grad_()
        b = b0.clone().requires_grad_()
        if bs:
            y = eager_act(F.batch_norm(x, None, None, w, b, True, 0.0, EPS), act, p)
            var, mean = torch.var_mean(x0, dim=(0, 2, 3), unbiased=False)
        else:
            y = eager_act(F.batch_norm(x, rmean, rvar, w, b, False, 0.0, EPS), act, p)
            mean, var = rmean, rvar
        gx, gw, gb = torch.autograd.grad(y, (x, w, b), dy)
        got = ops.bn_act_backward(dy, x0, mean, var, w0, b0, EPS, act, p, bs, [True] * 3)
        close(got[0], gx, t)
        close(got[1], gw, t)
        close(got[2], gb, t)


@pytest.mark.parametrize("act,p", [("relu", 0.0), ("gelu", 0.0), ("silu", 0.0)])
@pytest.mark.parametrize("lay", LAYOUTS)
def test_float32_matches_eager_training(lay, act, p):
    shape = (4, 8, 6, 5)
    x0 = make_input(shape, torch.float32, lay)
    dy = make_input(shape, torch.float32, lay, seed=9)
    w0, b0, _, _ = make_params(8, torch.float32)
    x, w, b = (t.clone().requires_grad_() for t in (x0, w0, b0))
    y = eager_act(F.batch_norm(x, None, None, w, b, True, 0.0, EPS), act, p)
    gx, gw, gb = torch.autograd.grad(y, (x, w, b), dy)
    mean, var, _ = ops.bn_stats(x0)
    out = ops.bn_act(x0, mean, var, w0, b0, EPS, act, p)
    close(out, y.detach(), 1e-4)
    got = ops.bn_act_backward(dy, x0, mean, var, w0, b0, EPS, act, p, True, [True] * 3)
    close(got[0], gx, 1e-4)
    close(got[1], gw, 1e-4, scale=10)
    close(got[2], gb, 1e-4, scale=10)


@pytest.mark.parametrize("act,p", [("leaky_relu", 0.2), ("gelu", 0.0)])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("lay", LAYOUTS)
def test_multithreaded_sizes(lay, dtype, act, p):
    """Big enough for the kernels to split work across threads (and, for NHWC
    reductions, across per-thread accumulators)."""
    shape = (4, 16, 33, 35)
    x = make_input(shape, dtype, lay, offset=3.0)
    dy = make_input(shape, dtype, lay, seed=2)
    w, b, _, _ = make_params(16, dtype)
    t = tol(dtype)
    mean, var, _ = ops.bn_stats(x)
    gmean, gvar, _ = _C.bn_stats(x)
    close(mean, gmean, t)
    close(var, gvar, t)
    close(ops.bn_act(x, mean, var, w, b, EPS, act, p), _C.bn_act(x, mean, var, w, b, EPS, act, p), t)
    got = ops.bn_act_backward(dy, x, mean, var, w, b, EPS, act, p, True, [True] * 3)
    ref = grads_generic(dy, x, mean, var, w, b, act, p, True, [True] * 3)
    scale = (x.numel() / 16) ** 0.5
    for a, r in zip(got, ref):
        close(a, r, t, scale)


# ------------------------------------------------------------------ layouts and dtypes


def test_grad_out_in_other_layout():
    x = make_input((2, 5, 4, 3), torch.float32, "channels_last")
    dy = make_input((2, 5, 4, 3), torch.float32, "contiguous", seed=4)
    w, b, mean, var = make_params(5, torch.float32)
    for inp, g in ((x, dy), (x.contiguous(), layout(dy, "channels_last"))):
        got = ops.bn_act_backward(g, inp, mean, var, w, b, EPS, "silu", 0.0, True, [True] * 3)
        ref = grads_generic(g, inp, mean, var, w, b, "silu", 0.0, True, [True] * 3)
        same_layout(got[0], inp)
        for a, r in zip(got, ref):
            close(a, r, 1e-5, 3)


def test_non_dense_input_falls_back():
    base = make_input((2, 4, 6, 10), torch.float64, "contiguous")
    x = base[:, :, ::2, 1:8]  # not dense: generic path
    dy = make_input(tuple(x.shape), torch.float64, "contiguous", seed=3)
    w, b, mean, var = make_params(4, torch.float64)
    close(ops.bn_stats(x)[1], _C.bn_stats(x)[1], 1e-12)
    close(ops.bn_act(x, mean, var, w, b, EPS, "gelu", 0.0), _C.bn_act(x, mean, var, w, b, EPS, "gelu", 0.0), 1e-12)
    got = ops.bn_act_backward(dy, x, mean, var, w, b, EPS, "gelu", 0.0, True, [True] * 3)
    ref = grads_generic(dy, x, mean, var, w, b, "gelu", 0.0, True, [True] * 3)
    for a, r in zip(got, ref):
        close(a, r, 1e-12)


def test_mixed_parameter_dtypes():
    # float32 input with float64 statistics / affine parameters: cast to float32.
    x = make_input((2, 3, 4, 5), torch.float32, "contiguous")
    dy = make_input((2, 3, 4, 5), torch.float32, "contiguous", seed=6)
    w, b, mean, var = make_params(3, torch.float64)
    close(
        ops.bn_act(x, mean, var, w, b, EPS, "relu6", 0.0),
        _C.bn_act(x, mean, var, w, b, EPS, "relu6", 0.0),
        1e-5,
    )
    got = ops.bn_act_backward(dy, x, mean, var, w, b, EPS, "relu6", 0.0, False, [True] * 3)
    ref = grads_generic(dy, x, mean, var, w, b, "relu6", 0.0, False, [True] * 3)
    assert got[1].dtype == torch.float64 and got[2].dtype == torch.float64
    for a, r in zip(got, ref):
        close(a, r, 1e-5, 3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("lay", LAYOUTS)
@pytest.mark.parametrize("act,p", [("relu", 0.0), ("gelu_tanh", 0.0), ("hardswish", 0.0)])
def test_reduced_precision_uses_a_correct_path(dtype, lay, act, p):
    shape = (2, 5, 3, 4)
    x = make_input(shape, dtype, lay)
    dy = make_input(shape, dtype, lay, seed=8)
    w, b, _, _ = make_params(5, torch.float32)
    mean, var, _ = ops.bn_stats(x)
    assert mean.dtype == torch.float32 and var.dtype == torch.float32
    rvar, rmean = torch.var_mean(x.double(), dim=(0, 2, 3), unbiased=False)
    close(mean.double(), rmean, 1e-2)
    close(var.double(), rvar, 1e-2)
    out = ops.bn_act(x, mean, var, w, b, EPS, act, p)
    assert out.dtype == dtype
    same_layout(out, x)
    ref = eager_act(
        F.batch_norm(x.double(), mean.double(), var.double(), w.double(), b.double(), False, 0.0, EPS), act, p
    )
    close(out.double(), ref, 2e-2)
    got = ops.bn_act_backward(dy, x, mean, var, w, b, EPS, act, p, True, [True] * 3)
    gen = grads_generic(dy, x, mean, var, w, b, act, p, True, [True] * 3)
    assert got[0].dtype == dtype and got[1].dtype == torch.float32
    for a, r in zip(got, gen):
        torch.testing.assert_close(a, r, rtol=0, atol=0)  # same (generic) path


# ------------------------------------------------------------------- special values


@pytest.mark.parametrize("act,p", ACTS, ids=ACT_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("lay", LAYOUTS)
def test_nan_inf_forward(lay, dtype, act, p):
    x = make_input((2, 3, 3, 5), dtype, lay).clone()
    x[0, 0, 0, 0] = float("nan")
    x[1, 1, 2, 4] = float("inf")
    x[0, 2, 1, 3] = float("-inf")
    x[1, 0, 0, 1] = float("inf")
    w, b, mean, var = make_params(3, dtype)
    out = ops.bn_act(x, mean, var, w, b, EPS, act, p)
    ref = _C.bn_act(x, mean, var, w, b, EPS, act, p)
    close(out, ref, tol(dtype), equal_nan=True)
    eager = eager_act(F.batch_norm(x, mean, var, w, b, False, 0.0, EPS), act, p)
    close(out, eager, tol(dtype) * 10, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("lay", LAYOUTS)
def test_gelu_overflow_as_eager(lay, dtype):
    """Eager's GELU of a contiguous float32 tensor is oneDNN's, which on AVX-512 CPUs returns
    NaN for +inf and inf for z >= FLT_MAX / 2, where ATen's own kernel (channels_last,
    float64) returns inf and z: the fused GELU returns what eager returns, out of place
    and in place."""
    x = make_input((2, 3, 3, 5), dtype, "contiguous").clone()
    for i, v in enumerate([float("inf"), -float("inf"), float("nan"), 3e38, -3e38, 2e38, 1.7e38, 1e38]):
        x.view(-1)[7 * i] = v
    x = layout(x, lay)
    C = x.shape[1]
    mean, var = torch.zeros(C, dtype=dtype), torch.full((C,), 1.0 - EPS, dtype=dtype)
    w, b = torch.ones(C, dtype=dtype), torch.zeros(C, dtype=dtype)
    eager = F.gelu(F.batch_norm(x, mean, var, w, b, False, 0.0, EPS))
    y = x.clone()
    ops.bn_act_(y, mean, var, w, b, EPS, "gelu", 0.0)
    for out in (ops.bn_act(x, mean, var, w, b, EPS, "gelu", 0.0), y):
        assert torch.equal(out.isnan(), eager.isnan())
        assert torch.equal(out.isinf(), eager.isinf()) and torch.equal(out[out.isinf()], eager[eager.isinf()])
        close(out, eager, tol(dtype) * 10, equal_nan=True)


@pytest.mark.parametrize("act,p", ACTS, ids=ACT_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("lay", LAYOUTS)
def test_nan_inf_backward_as_eager(lay, dtype, act, p):
    """NaN and +-inf in x and dy give grad_input NaN / inf exactly where eager's autograd
    (batch_norm with running statistics, then the activation) has them."""
    x = make_input((2, 3, 3, 5), dtype, "contiguous").clone()
    dy = make_input((2, 3, 3, 5), dtype, "contiguous", seed=4).clone()
    for i, v in enumerate([float("inf"), -float("inf"), float("nan"), 1e30, -1e30]):
        x.view(-1)[11 * i] = v
        dy.view(-1)[11 * i + 5] = v
    x, dy = layout(x, lay), layout(dy, lay)
    w, b, mean, var = make_params(3, dtype)
    xe = x.clone().requires_grad_()
    eager_act(F.batch_norm(xe, mean, var, w, b, False, 0.0, EPS), act, p).backward(dy)
    got = ops.bn_act_backward(dy, x, mean, var, w, b, EPS, act, p, False, [True, False, False])[0]
    want = xe.grad
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.isinf(), want.isinf()) and torch.equal(got[got.isinf()], want[want.isinf()])


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("lay", LAYOUTS)
def test_nan_inf_stats(lay, dtype):
    x = make_input((2, 4, 3, 5), dtype, lay).clone()
    x[1, 0, 2, 2] = float("nan")
    x[0, 1, 0, 0] = float("inf")
    x[1, 2, 1, 1] = float("-inf")
    mean, var, _ = ops.bn_stats(x)
    gmean, gvar, _ = _C.bn_stats(x)
    # channel 3 is clean; 0 has a NaN; 1 and 2 an infinity
    close(mean[3:], gmean[3:], tol(dtype))
    close(var[3:], gvar[3:], tol(dtype))
    assert torch.isnan(mean[0]) and torch.isnan(var[0])
    for c in (1, 2):
        assert not torch.isfinite(var[c]) and not torch.isfinite(gvar[c])
        assert not torch.isfinite(mean[c]) and not torch.isfinite(gmean[c])


@pytest.mark.parametrize("act,p", ACTS, ids=ACT_IDS)
@pytest.mark.parametrize("lay", LAYOUTS)
def test_nan_backward(lay, act, p):
    dtype = torch.float64
    shape = (2, 3, 3, 5)
    x = make_input(shape, dtype, lay).clone()
    dy = make_input(shape, dtype, lay, seed=4).clone()
    dy[0, 1, 1, 1] = float("nan")
    if act != "relu6":  # ATen's own hardtanh_backward treats a NaN input inconsistently
        x[1, 2, 0, 3] = float("nan")
    w, b, mean, var = make_params(3, dtype)
    for bs in (True, False):
        got = ops.bn_act_backward(dy, x, mean, var, w, b, EPS, act, p, bs, [True] * 3)
        ref = grads_generic(dy, x, mean, var, w, b, act, p, bs, [True] * 3)
        for a, r in zip(got, ref):
            close(a, r, 1e-10, equal_nan=True)


# ------------------------------------------------------------------ in-place forms
# bn_act_ / bn_act_backward_ write over their input and bn_act_backward_into_grad_ over
# grad_out; on CPU they run the same kernels as bn_act / bn_act_backward, so the results
# must be bitwise the same.


def bitwise(actual, expected):
    if expected is None:
        assert actual is None
        return
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


def twin(x):
    """A copy of x with x's strides (clone() makes a non-dense tensor dense)."""
    return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype).copy_(x)


def check_inplace_forms(x, dy, mean, var, w, b, act, p, bs):
    out = ops.bn_act(x, mean, var, w, b, EPS, act, p)
    y = twin(x)
    ptr, stride = y.data_ptr(), y.stride()
    assert ops.bn_act_(y, mean, var, w, b, EPS, act, p) is None
    assert y.data_ptr() == ptr and y.stride() == stride
    bitwise(y, out)
    for wmask in itertools.product([False, True], repeat=2):
        ref = ops.bn_act_backward(dy, x, mean, var, w, b, EPS, act, p, bs, [True, *wmask])
        y = twin(x)
        ptr = y.data_ptr()
        gw, gb = ops.bn_act_backward_(dy, y, mean, var, w, b, EPS, act, p, bs, list(wmask))
        assert y.data_ptr() == ptr and y.stride() == stride
        bitwise(y, ref[0])
        bitwise(gw, ref[1])
        bitwise(gb, ref[2])
        g = twin(dy)
        ptr, g_stride = g.data_ptr(), g.stride()
        gw, gb = ops.bn_act_backward_into_grad_(g, x, mean, var, w, b, EPS, act, p, bs, list(wmask))
        assert g.data_ptr() == ptr and g.stride() == g_stride
        bitwise(g, ref[0].to(g.dtype))
        bitwise(gw, ref[1])
        bitwise(gb, ref[2])


@pytest.mark.parametrize("act,p", ACTS, ids=ACT_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("lay", LAYOUTS)
@pytest.mark.parametrize("shape", SHAPES + [(4, 16, 33, 35)], ids=str)
def test_inplace_forms_match_out_of_place(shape, lay, dtype, act, p):
    x = make_input(shape, dtype, lay)
    dy = make_input(shape, dtype, lay, seed=3)
    w, b, rmean, rvar = make_params(shape[1], dtype)
    bmean, bvar, _ = ops.bn_stats(x)
    check_inplace_forms(x, dy, bmean, bvar, w, b, act, p, True)
    check_inplace_forms(x, dy, rmean, rvar, None, b, act, p, False)


def test_inplace_forms_on_fallback_paths():
    """Inputs the hand-written kernels do not take (not dense, half precision), and a
    grad_out in another dtype, still give bn_act / bn_act_backward's results."""
    base = make_input((2, 4, 6, 10), torch.float64, "contiguous")
    x = base[:, :, ::2, 1:8]
    w, b, mean, var = make_params(4, torch.float64)
    dy = make_input(tuple(x.shape), torch.float64, "contiguous", seed=3)
    check_inplace_forms(x, dy, mean, var, w, b, "gelu", 0.0, True)
    xh = make_input((2, 5, 3, 4), torch.bfloat16, "channels_last")
    dyh = make_input((2, 5, 3, 4), torch.bfloat16, "channels_last", seed=2)
    w32, b32, _, _ = make_params(5, torch.float32)
    m32, v32, _ = ops.bn_stats(xh)
    check_inplace_forms(xh, dyh, m32, v32, w32, b32, "silu", 0.0, True)
    xf = make_input((2, 5, 3, 4), torch.float32, "contiguous")
    w, b, mean, var = make_params(5, torch.float32)
    check_inplace_forms(xf, dyh.double(), mean, var, w, b, "relu", 0.0, False)
    # grad_out in the other memory format: bn_act_backward_into_grad_ keeps grad_out's strides
    xc = make_input((2, 6, 5, 4), torch.float32, "channels_last")
    dyc = make_input((2, 6, 5, 4), torch.float32, "contiguous", seed=4)
    w, b, mean, var = make_params(6, torch.float32)
    check_inplace_forms(xc, dyc, mean, var, w, b, "silu", 0.0, True)


def test_backward_into_grad_rejects_a_grad_out_that_partly_overlaps_the_input():
    buf = make_input((2, 4, 6, 6), torch.float32, "contiguous").flatten()
    x = buf[: 2 * 4 * 6 * 5].view(2, 4, 6, 5)
    g = buf[4 : 4 + x.numel()].view(2, 4, 6, 5)
    w, b, mean, var = make_params(4, torch.float32)
    with pytest.raises(RuntimeError, match="single memory location"):
        ops.bn_act_backward_into_grad_(g, x, mean, var, w, b, EPS, "relu", 0.0, True, [True, True])


def test_inplace_forms_validate_like_out_of_place():
    x = torch.randn(2, 3, 4, 4)
    w, b, mean, var = make_params(3, torch.float32)
    with pytest.raises(RuntimeError, match="4-D"):
        ops.bn_act_(torch.randn(2, 3, 4), mean, var, w, b, EPS, "relu", 0.0)
    with pytest.raises(RuntimeError, match="mean to have 3 elements"):
        ops.bn_act_(x, mean[:2], var, w, b, EPS, "relu", 0.0)
    with pytest.raises(RuntimeError, match="var to have 3 elements"):
        ops.bn_act_backward_(x, x.clone(), mean, var[:1], w, b, EPS, "relu", 0.0, True, [True] * 2)
    with pytest.raises(ValueError, match="unknown activation"):
        ops.bn_act_(x, mean, var, w, b, EPS, "tanh", 0.0)


# ---------------------------------------------------------------------- empty inputs


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("lay", LAYOUTS)
@pytest.mark.parametrize("shape", [(0, 3, 4, 4), (2, 3, 0, 4), (0, 1, 1, 1)], ids=str)
def test_empty(shape, lay, dtype):
    x = layout(torch.empty(shape, dtype=dtype), lay)
    C = shape[1]
    w, b, mean, var = make_params(C, dtype)
    m, v, _ = ops.bn_stats(x)
    gm, gv, _ = _C.bn_stats(x)
    assert m.shape == (C,) and v.shape == (C,)
    torch.testing.assert_close(m, gm, equal_nan=True)
    torch.testing.assert_close(v, gv, equal_nan=True)
    out = ops.bn_act(x, mean, var, w, b, EPS, "gelu", 0.0)
    assert out.shape == x.shape and out.dtype == dtype
    gi, gw, gb = ops.bn_act_backward(x, x, mean, var, w, b, EPS, "gelu", 0.0, True, [True] * 3)
    assert gi.shape == x.shape
    torch.testing.assert_close(gw, torch.zeros(C, dtype=dtype))
    torch.testing.assert_close(gb, torch.zeros(C, dtype=dtype))


# ------------------------------------------------------------------------ validation


def test_input_validation():
    x = torch.randn(2, 3, 4, 4)
    w, b, mean, var = make_params(3, torch.float32)
    with pytest.raises(RuntimeError, match="4-D"):
        ops.bn_stats(torch.randn(2, 3, 4))
    with pytest.raises(RuntimeError, match="4-D"):
        ops.bn_act(torch.randn(2, 3, 4), mean, var, w, b, EPS, "relu", 0.0)
    with pytest.raises(RuntimeError, match="floating-point"):
        ops.bn_stats(torch.ones(2, 3, 4, 4, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="mean to have 3 elements"):
        ops.bn_act(x, mean[:2], var, w, b, EPS, "relu", 0.0)
    with pytest.raises(RuntimeError, match="var to have 3 elements"):
        ops.bn_act_backward(x, x, mean, var[:1], w, b, EPS, "relu", 0.0, True, [True] * 3)
    with pytest.raises(RuntimeError, match="weight to have 3 elements"):
        ops.bn_act(x, mean, var, torch.ones(4), b, EPS, "relu", 0.0)
    with pytest.raises(RuntimeError, match="bias to have 3 elements"):
        ops.bn_act(x, mean, var, w, torch.ones(2), EPS, "relu", 0.0)
    with pytest.raises(ValueError, match="unknown activation"):
        ops.bn_act(x, mean, var, w, b, EPS, "tanh", 0.0)


# ----------------------------------------------------------- baseline (non-AVX2) build


_DEFAULT_CAPABILITY_SCRIPT = textwrap.dedent(
    """
    import torch
    from fxfuse import _extension
    C_ = _extension.generic_kernels()
    ops = torch.ops.fxfuse
    torch.manual_seed(0)
    ACTS = (("relu", 0.0), ("relu6", 0.0), ("leaky_relu", 0.1), ("gelu", 0.0),
            ("gelu_tanh", 0.0), ("silu", 0.0), ("hardswish", 0.0))
    for dtype, t in ((torch.float32, 1e-5), (torch.float64, 1e-10)):
        for cl in (False, True):
            for shape in ((2, 5, 3, 7), (3, 19, 1, 1), (2, 8, 9, 9)):
                x = torch.randn(shape, dtype=dtype) * 2 + 1
                dy = torch.randn(shape, dtype=dtype)
                if cl:
                    x = x.contiguous(memory_format=torch.channels_last)
                w = torch.rand(shape[1], dtype=dtype) + 0.5
                b = torch.randn(shape[1], dtype=dtype)
                mean, var, _ = ops.bn_stats(x)
                gm, gv, _ = C_.bn_stats(x)
                torch.testing.assert_close(mean, gm, rtol=t, atol=t)
                torch.testing.assert_close(var, gv, rtol=t, atol=t)
                for act, p in ACTS:
                    out = ops.bn_act(x, mean, var, w, b, 1e-5, act, p)
                    ref = C_.bn_act(x, mean, var, w, b, 1e-5, act, p)
                    torch.testing.assert_close(out, ref, rtol=t, atol=t * 10)
                    for bs in (True, False):
                        got = ops.bn_act_backward(dy, x, mean, var, w, b, 1e-5, act, p, bs, [True] * 3)
                        exp = C_.bn_act_backward(dy, x, mean, var, w, b, 1e-5, act, p, bs, [True] * 3)
                        for a, r in zip(got, exp):
                            torch.testing.assert_close(a, r, rtol=t, atol=t * 300)
    print("OK")
    """
)


def test_default_capability_build():
    """ATEN_CPU_CAPABILITY=default makes fxfuse use the baseline (non-AVX2) build of
    the kernels; it must agree with the generic kernels too."""
    cpu_probe.skip_unless_runs("default")
    env = cpu_probe.env_for("default")
    res = subprocess.run(
        [sys.executable, "-c", _DEFAULT_CAPABILITY_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    assert "OK" in res.stdout


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("lay", LAYOUTS)
def test_piecewise_activation_edges_match_eager(dtype, lay):
    # z exactly at the breakpoints (hardswish: -3 and 3, relu6: 0 and 6): the kernels take
    # the branch ATen's *_backward takes (hardswish_backward is 0 at z = -3, dy at z = 3).
    edges = torch.tensor([-3.0, 3.0, 0.0, 6.0, -6.0, 0.5, 2.0, -1.0], dtype=dtype)
    x = layout(edges.view(1, 1, 2, 4).repeat(2, 3, 1, 1), lay)
    mean, var = torch.zeros(3, dtype=dtype), torch.full((3,), 1.0 - 1e-5, dtype=dtype)
    assert torch.equal((var + 1e-5).rsqrt(), torch.ones(3, dtype=dtype))  # z == x exactly
    dy = torch.ones_like(x)
    for act in ("hardswish", "relu6", "relu"):
        z = x.detach().clone().requires_grad_()
        (want,) = torch.autograd.grad(eager_act(z, act, 0.0), z, dy)
        got = ops.bn_act_backward(dy, x, mean, var, None, None, 1e-5, act, 0.0, False, [True, False, False])[0]
        assert torch.equal(got, want), act
