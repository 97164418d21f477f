"""The CUDA bn_act kernels' per-element math (csrc/bn_act_elementwise.h), built for the
host (csrc/cpu/bn_act_elementwise.cpp), against the generic path and eager PyTorch.

This is how the device formulas are checked on machines without a GPU; the CUDA kernels
add only indexing and the per-channel reduction (tests/test_cuda.py, on a GPU).
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
def test_bn_stats_two_passes_match_generic(dtype, channels_last):
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
