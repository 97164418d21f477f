"""fxfuse::batch_norm_act and the BN(+activation) ops it and conv_bn_act build on (bn_stats, bn_act,
bn_act_backward and their in-place forms; fxfuse/ops/batch_norm_act.py): against the plain-PyTorch
reference (tests/support/reference.py), opcheck, gradcheck, the device-generic kernels."""

import pytest
import torch
import torch.nn.functional as F
from support import reference
from support.op_checks import ACT_PARAMS, FORMATS, bn_params, stats

from fxfuse import _extension
from fxfuse.ops import ACTIVATIONS

pytestmark = pytest.mark.skipif(not _extension.loaded(), reason="fxfuse._C is not built")

if _extension.loaded():
    from fxfuse.ops import batch_norm_act
    from fxfuse.ops.checks import apply_activation


@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_batch_norm_act_matches_reference_float32(act, fmt):
    x = (torch.randn(4, 5, 6, 7) * 3 + 2).to(memory_format=fmt).requires_grad_()
    g, beta = (t.requires_grad_() for t in bn_params(5, torch.float32))
    rm, rv = stats(5, torch.float32)
    rm2, rv2 = rm.clone(), rv.clone()
    p = ACT_PARAMS.get(act, 0.0)
    out = batch_norm_act(x, rm, rv, g, beta, True, 0.1, 1e-5, act, p)
    ref = reference.batch_norm_act(x, rm2, rv2, g, beta, True, 0.1, 1e-5, act, p)
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)
    grad = torch.randn_like(out)
    for a, e in zip(torch.autograd.grad(out, (x, g, beta), grad), torch.autograd.grad(ref, (x, g, beta), grad)):
        torch.testing.assert_close(a, e, rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(rm, rm2)
    torch.testing.assert_close(rv, rv2)


@pytest.mark.parametrize("act", ["none", "leaky_relu", "gelu", "hardswish"])
def test_batch_norm_act_gradcheck(act):
    x = torch.randn(3, 4, 3, 2, dtype=torch.double, requires_grad=True)
    g, beta = (t.requires_grad_() for t in bn_params(4, torch.double))

    def fn(x, g, beta):
        return torch.ops.fxfuse.batch_norm_act(x, g, beta, None, None, True, 1e-5, act, 0.1)[0]

    assert torch.autograd.gradcheck(fn, (x, g, beta))


def _opcheck_samples(fmt):
    g, beta = bn_params(6, torch.float32)
    rm, rv = stats(6, torch.float32)
    y = torch.randn(2, 6, 5, 6).to(memory_format=fmt)
    mean, var = y.mean((0, 2, 3)), y.var((0, 2, 3), unbiased=False)
    req = lambda *ts: tuple(t.clone().requires_grad_() for t in ts)  # noqa: E731
    return [
        (torch.ops.fxfuse.bn_stats.default, (y,)),
        (torch.ops.fxfuse.bn_act.default, (*req(y), mean, var, *req(g, beta), 1e-5, "gelu", 0.0)),
        (
            torch.ops.fxfuse.bn_act_backward.default,
            (torch.randn_like(y), y, mean, var, g, beta, 1e-5, "silu", 0.0, True, [True, True, True]),
        ),
        (torch.ops.fxfuse.bn_act_.default, (y.clone(), mean, var, g, beta, 1e-5, "relu", 0.0)),
        (
            torch.ops.fxfuse.bn_act_backward_.default,
            (torch.randn_like(y), y.clone(), mean, var, g, beta, 1e-5, "gelu", 0.0, True, [True, True]),
        ),
        (
            torch.ops.fxfuse.bn_act_backward_.default,
            (torch.randn_like(y), y.clone(), mean, var, None, beta, 1e-5, "none", 0.0, False, [False, True]),
        ),
        (
            torch.ops.fxfuse.bn_act_backward_into_grad_.default,
            (torch.randn_like(y), y, mean, var, g, beta, 1e-5, "silu", 0.0, True, [True, True]),
        ),
        (torch.ops.fxfuse.batch_norm_act.default, (*req(y, g, beta), rm, rv, True, 1e-5, "relu", 0.0)),
        (torch.ops.fxfuse.batch_norm_act.default, (*req(y), None, None, rm, rv, False, 1e-5, "relu6", 0.0)),
    ]


@pytest.mark.parametrize("fmt", FORMATS, ids=["contiguous", "channels_last"])
def test_opcheck(fmt):
    for op, args in _opcheck_samples(fmt):
        torch.library.opcheck(op, args)


@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_generic_kernels_match_reference(act, fmt):
    """The device-generic ATen path (what CUDA and other devices run), exercised on CPU."""
    C = _extension.generic_kernels()
    x = torch.randn(3, 5, 4, 6, dtype=torch.double).to(memory_format=fmt)
    g, beta = bn_params(5, torch.double)
    mean, var, _ = C.bn_stats(x)
    torch.testing.assert_close(mean, x.mean((0, 2, 3)))
    torch.testing.assert_close(var, x.var((0, 2, 3), unbiased=False))
    p = ACT_PARAMS.get(act, 0.0)
    out = C.bn_act(x, mean, var, g, beta, 1e-5, act, p)
    torch.testing.assert_close(out, reference.bn_act(x, mean, var, g, beta, 1e-5, act, p))
    assert out.stride() == x.stride()
    xr, gr, br = (t.clone().requires_grad_() for t in (x, g, beta))
    ref = apply_activation(F.batch_norm(xr, None, None, gr, br, True, 0.0, 1e-5), act, p)
    grad = torch.randn_like(ref)
    want = torch.autograd.grad(ref, (xr, gr, br), grad)
    got = C.bn_act_backward(grad, x, mean, var, g, beta, 1e-5, act, p, True, [True, True, True])
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e)
    # the in-place forms: the same values, written over their input
    y = x.clone()
    C.bn_act_(y, mean, var, g, beta, 1e-5, act, p)
    torch.testing.assert_close(y, out, rtol=0, atol=0)
    y = x.clone()
    gw, gb = C.bn_act_backward_(grad, y, mean, var, g, beta, 1e-5, act, p, True, [True, False])
    torch.testing.assert_close(y, got[0], rtol=0, atol=0)
    torch.testing.assert_close(gw, got[1], rtol=0, atol=0)
    assert gb is None
