"""The CUDA bn_act kernels' host logic, per-channel and per-element math and vector walks
(csrc/bn_act_host_setup.h, bn_act_device.h, bn_act_elementwise.h), built for the host
(csrc/cpu/bn_act_elementwise.cpp), against the generic path and eager PyTorch.

This is how the device formulas are checked on machines without a GPU; the CUDA kernels
add only the launches, the thread indexing and the order of the sums within a split
(tests/test_cuda.py, on a GPU).
"""

import pytest
import torch
import torch.nn.functional as F
from support.reference import ACTS

from fxfuse import _extension
from fxfuse.ops.checks import apply_activation

pytestmark = pytest.mark.skipif(not _extension.loaded(), reason="fxfuse._C is not built")

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
# float64 / float32: same formulas, only libm vs ATen's erf/exp/tanh and summation order differ.
# half / bfloat16: z is rounded to the dtype before the activation on both sides; a value near
# a rounding boundary can land one ulp apart.
TOL = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (1.6e-2, 2e-2),
    torch.float16: (2e-3, 2e-3),
}


def _C():
    return _extension.generic_kernels()


def _E():
    return _extension.elementwise_kernels()


def _data(dtype, channels_last, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 5, 4, 6, generator=g, dtype=torch.float64) * 2.5 + 0.3
    # exact edge points of the piecewise activations (after normalisation with mean 0, var 1)
    x[0, 0, 0, :6] = torch.tensor([-3.0, 3.0, 0.0, 6.0, -6.0, 0.5])
    dy = torch.randn(x.shape, generator=g, dtype=torch.float64)
    if channels_last:
        x, dy = x.contiguous(memory_format=torch.channels_last), dy.contiguous(memory_format=torch.channels_last)
    w = torch.rand(5, generator=g, dtype=torch.float64) + 0.5
    b = torch.randn(5, generator=g, dtype=torch.float64) * 0.3
    mean = torch.randn(5, generator=g, dtype=torch.float64) * 0.2
    var = torch.rand(5, generator=g, dtype=torch.float64) + 0.5
    mean[0], var[0], w[0], b[0] = 0.0, 1.0 - 1e-5, 1.0, 0.0  # channel 0: z == x exactly
    sd = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
    return x.to(dtype), dy.to(dtype), w.to(sd), b.to(sd), mean.to(sd), var.to(sd)


@pytest.mark.parametrize("act,p", ACTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_forward_matches_generic(act, p, dtype, channels_last):
    x, _, w, b, mean, var = _data(dtype, channels_last)
    got = _E().bn_act(x, mean, var, w, b, 1e-5, act, p)
    want = _C().bn_act(x, mean, var, w, b, 1e-5, act, p)
    assert got.dtype == want.dtype and got.stride() == want.stride()
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("act,p", ACTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("batch_stats", [True, False])
def test_backward_matches_generic(act, p, dtype, channels_last, batch_stats):
    x, dy, w, b, mean, var = _data(dtype, channels_last)
    for mask in ([True, True, True], [True, False, False], [False, True, True]):
        got = _E().bn_act_backward(dy, x, mean, var, w, b, 1e-5, act, p, batch_stats, mask)
        want = _C().bn_act_backward(dy, x, mean, var, w, b, 1e-5, act, p, batch_stats, mask)
        rtol, atol = TOL[dtype]
        for g, e in zip(got, want):
            assert (g is None) == (e is None)
            if g is not None:
                assert g.dtype == e.dtype and g.stride() == e.stride()
                # per-channel sums over 72 elements: scale the tolerance with the sum's size
                torch.testing.assert_close(g, e, rtol=rtol, atol=atol * (1 if g.dim() == 4 else 10))


@pytest.mark.parametrize("act,p", ACTS)
def test_float64_matches_eager_autograd(act, p):
    x, dy, w, b, _, _ = _data(torch.float64, False)
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    ref = apply_activation(F.batch_norm(xr, None, None, wr, br, True, 0.0, 1e-5), act, p)
    want = torch.autograd.grad(ref, (xr, wr, br), dy)
    var, mean = torch.var_mean(x, dim=(0, 2, 3), unbiased=False)
    out = _E().bn_act(x, mean, var, w, b, 1e-5, act, p)
    torch.testing.assert_close(out, ref.detach(), rtol=1e-9, atol=1e-9)
    got = _E().bn_act_backward(dy, x, mean, var, w, b, 1e-5, act, p, True, [True, True, True])
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("act,p", [a for a in ACTS if a[0] != "none"])
def test_activation_formulas_match_aten_at_edges(act, p):
    # channel 0 of _data has z == x, with x = -3, 3, 0, 6, -6, 0.5 at its first positions
    z = torch.tensor([-3.0, 3.0, 0.0, 6.0, -6.0, 0.5, float("nan"), float("inf"), -float("inf")], dtype=torch.float64)
    x = z.view(1, 1, 1, -1)
    one, zero = torch.ones(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
    var = one - 1e-5
    out = _E().bn_act(x, zero, var, None, None, 1e-5, act, p).flatten()
    zr = z.clone().requires_grad_()
    ref = apply_activation(zr, act, p)
    torch.testing.assert_close(out, ref.detach(), equal_nan=True)
    dy = torch.ones_like(x)
    gi = _E().bn_act_backward(dy, x, zero, var, None, None, 1e-5, act, p, False, [True, False, False])[0].flatten()
    (want,) = torch.autograd.grad(ref, zr, torch.ones_like(z))
    finite = torch.isfinite(z)
    torch.testing.assert_close(gi[finite], want[finite])
    if act == "hardswish":
        # NaN z: ATen's scalar and CUDA hardswish_backward return dy (as here), its vectorized
        # CPU path returns NaN; compare the infinities only.
        finite = finite | z.isnan()
    assert torch.equal(gi[~finite].isnan(), want[~finite].isnan())


def test_rejects_what_it_cannot_index():
    x = torch.randn(2, 3, 4, 5).transpose(2, 3)  # neither NCHW- nor NHWC-contiguous
    m, v = torch.zeros(3), torch.ones(3)
    with pytest.raises(RuntimeError, match="contiguous or channels_last"):
        _E().bn_act(x, m, v, None, None, 1e-5, "relu", 0.0)
    with pytest.raises(ValueError, match="unknown activation"):
        _E().bn_act(x.contiguous(), m, v, None, None, 1e-5, "swish", 0.0)


@pytest.mark.parametrize("act,p", ACTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_inplace_forms_write_the_out_of_place_results(act, p, dtype, channels_last):
    """The CUDA kernels' in-place forms: the elementwise pass writes over x (bn_act_,
    bn_act_backward_) or dy (bn_act_backward_into_grad_), each element read before it is
    written, after the per-channel sums are complete: the same bits as out of place."""
    x, dy, w, b, mean, var = _data(dtype, channels_last)
    y = x.clone()
    assert _E().bn_act_(y, mean, var, w, b, 1e-5, act, p) is None
    assert torch.equal(y, _E().bn_act(x, mean, var, w, b, 1e-5, act, p))
    for batch_stats in (True, False):
        for wmask in ([True, True], [False, False], [True, False]):
            want = _E().bn_act_backward(dy, x, mean, var, w, b, 1e-5, act, p, batch_stats, [True, *wmask])
            y = x.clone()
            got = _E().bn_act_backward_(dy, y, mean, var, w, b, 1e-5, act, p, batch_stats, wmask)
            g = dy.clone()
            got_into = _E().bn_act_backward_into_grad_(g, x, mean, var, w, b, 1e-5, act, p, batch_stats, wmask)
            assert torch.equal(y, want[0]) and torch.equal(g, want[0])
            for a, c, e in zip(got, got_into, want[1:]):
                assert (a is None) == (c is None) == (e is None)
                if e is not None:
                    assert torch.equal(a, e) and torch.equal(c, e)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_bn_stats_matches_generic(dtype, channels_last):
    x = _data(dtype, channels_last)[0] + 100.0  # a large mean: sum(x^2) - M mean^2 would cancel
    got = _E().bn_stats(x)
    want = _C().bn_stats(x)
    rtol = {torch.float64: 1e-12, torch.float32: 1e-5}.get(dtype, 1e-5)  # half/bf16: float sums
    for g, e in zip(got, want):
        assert g.dtype == e.dtype
        torch.testing.assert_close(g, e, rtol=rtol, atol=rtol)


def test_bn_stats_float64_matches_eager():
    x = _data(torch.float64, True)[0]
    mean, var, unbiased = _E().bn_stats(x)
    torch.testing.assert_close(mean, x.mean((0, 2, 3)), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(var, x.var((0, 2, 3), unbiased=False), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(unbiased, x.var((0, 2, 3)), rtol=1e-12, atol=1e-12)


# ---- the per-channel work inside the kernels (issue 54) ----

ALLOCATIONS = {"aten::empty", "aten::empty_like", "aten::empty_strided"}


def _aten_ops(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sorted({e.name for e in prof.events() if e.name.startswith("aten::")})


def _host_calls(dtype, channels_last):
    x, dy, w, b, mean, var = _data(dtype, channels_last)
    sd = mean.dtype
    rm, rv = torch.zeros(5, dtype=sd), torch.ones(5, dtype=sd)
    invstd = (var + 1e-5).rsqrt()
    E = _E()
    mask = [True, True, True]
    x1, x2, dy1 = x.clone(), x.clone(), dy.clone()  # written over by the in-place forms
    return {
        "bn_stats": lambda: E.bn_stats(x),
        "bn_stats_update": lambda: E.bn_stats_update(x, rm, rv, 0.1, 1e-5),
        "update_running_stats_": lambda: E.update_running_stats_(rm, rv, mean, var, 0.1),
        "bn_act": lambda: E.bn_act(x, mean, var, w, b, 1e-5, "silu", 0.0),
        "bn_act_": lambda: E.bn_act_(x1, mean, var, w, b, 1e-5, "relu", 0.0),
        "bn_act_invstd": lambda: E.bn_act_invstd(x, mean, invstd, w, b, "gelu", 0.0),
        "bn_act_backward": lambda: E.bn_act_backward(dy, x, mean, var, w, b, 1e-5, "silu", 0.0, True, mask),
        "bn_act_backward running": lambda: E.bn_act_backward(dy, x, mean, var, w, b, 1e-5, "relu", 0.0, False, mask),
        "bn_act_backward_": lambda: E.bn_act_backward_(dy, x2, mean, var, w, b, 1e-5, "relu", 0.0, True, [True, True]),
        "bn_act_backward_into_grad_": lambda: E.bn_act_backward_into_grad_(
            dy1, x, mean, var, w, b, 1e-5, "relu", 0.0, True, [True, True]
        ),
        "bn_act_backward_invstd": lambda: E.bn_act_backward_invstd(dy, x, mean, invstd, w, b, "silu", 0.0, True, mask),
    }


CALLS = list(_host_calls(torch.float32, False))


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_cuda_host_code_issues_allocations_only(call, dtype, channels_last):
    """The CUDA kernels' host logic, through its host build: per fused call, the only ATen
    ops are allocations. Every per-channel computation (eps add, rsqrt, weight multiply, the
    split reduction's second stage, divisions, the running-statistics update) runs in the
    kernels, so each of them costs a launch in the kernel budget of bn_act_kernels.h, not
    one per ATen op."""
    ops = _aten_ops(_host_calls(dtype, channels_last)[call])
    assert set(ops) <= ALLOCATIONS, f"{call}: {ops}"


def _running_formula(rm, rv, x, momentum):
    """Eager CUDA's update (ATen's batch_norm_update_stats) in float64: mean * m + (1 - m) * rm,
    var * M / (M - 1) * m + (1 - m) * rv."""
    x64 = x.double()
    M = x.numel() // x.size(1)
    var, mean = torch.var_mean(x64, dim=(0, 2, 3), correction=0)
    m = momentum
    return mean * m + (1 - m) * rm.double(), var * (M / (M - 1)) * m + (1 - m) * rv.double()


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_bn_stats_update_follows_eager_cuda_running_formula(dtype, channels_last):
    """float32 running statistics: within the float32 rounding of eager CUDA's formula (a
    float64 reference of it), bit for bit what that formula gives in float32 from the
    kernel's own batch statistics with every operation rounded (the host build; nvcc may
    contract a multiply-add as it does in ATen's kernel: one ulp), and close to the generic
    path's (CPU's rounding)."""
    x = _data(dtype, channels_last)[0] + 3.0
    rm = torch.randn(5, generator=torch.Generator().manual_seed(1))
    rv = torch.rand(5, generator=torch.Generator().manual_seed(2)) + 0.5
    got_m, got_v = rm.clone(), rv.clone()
    mean, invstd, var, unbiased = _E().bn_stats_update(x, got_m, got_v, 0.1, 1e-5)
    want_m, want_v = _running_formula(rm, rv, x, 0.1)
    torch.testing.assert_close(got_m.double(), want_m, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_v.double(), want_v, rtol=1e-6, atol=1e-6)
    # the formula in float32 from the kernel's statistics, one rounding per operation
    M = x.numel() // 5
    m32 = torch.tensor(0.1, dtype=torch.float32)
    bessel = torch.tensor(M / (M - 1), dtype=torch.float32)
    assert torch.equal(got_m, mean * m32 + (1 - m32) * rm)
    assert torch.equal(unbiased, var * bessel)
    assert torch.equal(got_v, unbiased * m32 + (1 - m32) * rv)
    # sqrt and division each correctly rounded to float32: through float64, since ATen's vectorized sqrt
    # can be an ulp off on some CPUs (AVX-512), and a float32 rounding of a float64 result is exact for both
    root = torch.sqrt((var + torch.tensor(1e-5, dtype=torch.float32)).double()).float()
    assert torch.equal(invstd, (1 / root.double()).float())
    # the generic path (eager CPU's rounding): the same numbers to float32's precision
    gen_m, gen_v = rm.clone(), rv.clone()
    g_mean, g_var, g_unbiased = _C().bn_stats(x)
    torch.ops.fxfuse.update_running_stats_(gen_m, gen_v, g_mean, g_unbiased, 0.1)
    torch.testing.assert_close(got_m, gen_m, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_v, gen_v, rtol=1e-6, atol=1e-6)


def test_bn_stats_update_float64_matches_eager():
    x = _data(torch.float64, True)[0]
    rm, rv = torch.randn(5, dtype=torch.float64), torch.rand(5, dtype=torch.float64) + 0.5
    got_m, got_v = rm.clone(), rv.clone()
    mean, invstd, var, unbiased = _E().bn_stats_update(x, got_m, got_v, 0.1, 1e-5)
    want_m, want_v = rm.clone(), rv.clone()
    F.batch_norm(x, want_m, want_v, None, None, True, 0.1, 1e-5)
    for g, e in ((got_m, want_m), (got_v, want_v), (mean, x.mean((0, 2, 3))), (var, x.var((0, 2, 3), unbiased=False))):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(unbiased, x.var((0, 2, 3)), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(invstd, (var + 1e-5).rsqrt(), rtol=1e-14, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_update_running_stats_half_buffers_round_once(dtype):
    """Running statistics in the input's half dtype: eager CUDA's formula in float, one
    rounding to the buffer's dtype (the update op's host build and bn_stats_update's)."""
    x = _data(dtype, False)[0]
    rm = torch.randn(5, generator=torch.Generator().manual_seed(3)).to(dtype)
    rv = (torch.rand(5, generator=torch.Generator().manual_seed(4)) + 0.5).to(dtype)
    got_m, got_v = rm.clone(), rv.clone()
    mean, _, _, unbiased = _E().bn_stats_update(x, got_m, got_v, 0.1, 1e-5)
    m32 = torch.tensor(0.1, dtype=torch.float32)
    assert torch.equal(got_m, (mean * m32 + (1 - m32) * rm.float()).to(dtype))
    assert torch.equal(got_v, (unbiased * m32 + (1 - m32) * rv.float()).to(dtype))
    op_m, op_v = rm.clone(), rv.clone()
    _E().update_running_stats_(op_m, op_v, mean, unbiased, 0.1)
    assert torch.equal(op_m, got_m) and torch.equal(op_v, got_v)


def test_bn_stats_update_rejects_mismatched_running_statistics():
    x = _data(torch.float32, False)[0]
    with pytest.raises(RuntimeError, match="both be given or neither"):
        _E().bn_stats_update(x, torch.zeros(5), None, 0.1, 1e-5)
    with pytest.raises(RuntimeError, match="running statistics of 5 channels"):
        _E().bn_stats_update(x, torch.zeros(4), torch.ones(4), 0.1, 1e-5)


@pytest.mark.parametrize("act,p", [("relu", 0.0), ("gelu", 0.0), ("leaky_relu", 0.1)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_invstd_entry_points_match_the_var_ops(act, p, dtype):
    """bn_act / bn_act_backward given bn_stats_update's invstd: the same bits as given var
    (the kernels compute invstd from var with the same function)."""
    x, dy, w, b, _, _ = _data(dtype, True)
    mean, invstd, var, _ = _E().bn_stats_update(x, None, None, 0.1, 1e-5)
    assert torch.equal(_E().bn_act_invstd(x, mean, invstd, w, b, act, p), _E().bn_act(x, mean, var, w, b, 1e-5, act, p))
    for batch_stats in (True, False):
        got = _E().bn_act_backward_invstd(dy, x, mean, invstd, w, b, act, p, batch_stats, [True, True, True])
        want = _E().bn_act_backward(dy, x, mean, var, w, b, 1e-5, act, p, batch_stats, [True, True, True])
        for g, e in zip(got, want):
            assert torch.equal(g, e)


def _misaligned(t):
    """t's values in a tensor of its layout whose data pointer is not 16-byte aligned: the
    kernels' scalar walk."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype)[1:]
    if t.is_contiguous():
        out = flat.view(t.shape)
    else:
        n, c, h, w = t.shape
        out = flat.view(n, h, w, c).permute(0, 3, 1, 2)
    out.copy_(t)
    assert out.data_ptr() % 16 != 0 and out.stride() == t.stride()
    return out


# (shape, channels_last): the vector walks (H * W or C a multiple of every dtype's vector
# width) and the shapes that fall back to the scalar walk.
WALK_SHAPES = [((2, 3, 4, 8), False), ((2, 16, 3, 5), True), ((2, 3, 3, 5), False), ((2, 6, 2, 3), True)]


@pytest.mark.parametrize("shape,channels_last", WALK_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_vector_walks_match_the_scalar_walk(shape, channels_last, dtype):
    """The 16-byte vector walks (a unit in one channel, NCHW, or V consecutive channels,
    channels_last) give the scalar walk's bits, forward, grad_input and the in-place forms."""
    g = torch.Generator().manual_seed(7)
    C = shape[1]
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = (torch.randn(shape, generator=g) * 2).to(dtype).contiguous(memory_format=fmt)
    dy = torch.randn(shape, generator=g).to(dtype).contiguous(memory_format=fmt)
    sd = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
    w, b = (torch.rand(C, generator=g) + 0.5).to(sd), torch.randn(C, generator=g).to(sd)
    mean, var = torch.randn(C, generator=g).to(sd) * 0.1, (torch.rand(C, generator=g) + 0.5).to(sd)
    xs, dys = _misaligned(x), _misaligned(dy)
    E = _E()
    for act, p in (("silu", 0.0), ("leaky_relu", 0.1)):
        assert torch.equal(E.bn_act(x, mean, var, w, b, 1e-5, act, p), E.bn_act(xs, mean, var, w, b, 1e-5, act, p))
        for batch_stats in (True, False):
            want = E.bn_act_backward(dys, xs, mean, var, w, b, 1e-5, act, p, batch_stats, [True, True, True])
            got = E.bn_act_backward(dy, x, mean, var, w, b, 1e-5, act, p, batch_stats, [True, True, True])
            for a, e in zip(got, want):
                assert torch.equal(a, e)
            y = x.clone(memory_format=fmt)
            E.bn_act_backward_(dy, y, mean, var, w, b, 1e-5, act, p, batch_stats, [False, False])
            assert torch.equal(y, want[0])
