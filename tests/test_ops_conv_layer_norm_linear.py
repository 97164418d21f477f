"""fxfuse::conv_layer_norm_linear (fxfuse/ops/conv_layer_norm_linear.py): eager's forward bit for bit,
gradients against eager, gradcheck, opcheck, what it keeps, autocast, bad input."""

from __future__ import annotations

import pytest
import torch

from fxfuse import _extension

pytestmark = pytest.mark.skipif(not _extension.loaded(), reason="fxfuse._C is not built")

if _extension.loaded():
    from fxfuse.ops import conv_layer_norm_linear
    from fxfuse.ops.conv_layer_norm_linear import _eager

    ops = torch.ops.fxfuse


def _inputs(dtype=torch.float64, c=8, out=12, kernel=7, groups=None, bias=True):
    groups = c if groups is None else groups
    x = torch.randn(2, c, 6, 5, dtype=dtype).contiguous(memory_format=torch.channels_last)
    conv_w = torch.randn(c, c // groups, kernel, kernel, dtype=dtype) / kernel
    conv_b = torch.randn(c, dtype=dtype) if bias else None
    ln_w, ln_b = torch.randn(c, dtype=dtype), torch.randn(c, dtype=dtype)
    w, b = torch.randn(out, c, dtype=dtype) / 3, torch.randn(out, dtype=dtype)
    tensors = [x, conv_w, conv_b, ln_w, ln_b, w, b]
    return [t if t is None else t.requires_grad_() for t in tensors], groups, kernel // 2


def _call(fn, tensors, groups, padding, eps=1e-6):
    x, cw, cb, lw, lb, w, b = tensors
    return fn(x, cw, cb, 1, padding, 1, groups, [x.shape[1]], lw, lb, eps, w, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", ["depthwise 7x7", "dense 3x3", "no conv bias"])
def test_matches_eager(dtype, case):
    kw = {"depthwise 7x7": {}, "dense 3x3": dict(kernel=3, groups=1), "no conv bias": dict(bias=False)}[case]
    tensors, groups, padding = _inputs(dtype, **kw)
    out, ref = _call(conv_layer_norm_linear, tensors, groups, padding), _call(_eager, tensors, groups, padding)
    assert torch.equal(out, ref) and out.stride() == ref.stride()
    grad = torch.randn_like(ref)
    wanted = [t for t in tensors if t is not None]
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-5)
    for got, want in zip(torch.autograd.grad(out, wanted, grad), torch.autograd.grad(ref, wanted, grad)):
        torch.testing.assert_close(got, want, **tol)


def test_only_some_gradients():
    tensors, groups, padding = _inputs()
    for wanted in ((tensors[0],), (tensors[1], tensors[2]), (tensors[5],), (tensors[3],)):
        out = _call(conv_layer_norm_linear, tensors, groups, padding)
        ref = _call(_eager, tensors, groups, padding)
        grad = torch.randn_like(ref)
        for got, want in zip(torch.autograd.grad(out, wanted, grad), torch.autograd.grad(ref, wanted, grad)):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_gradcheck(one_thread):
    tensors, groups, padding = _inputs(c=4, out=3, kernel=3)
    x, cw, cb, lw, lb, w, b = tensors
    assert torch.autograd.gradcheck(
        lambda *t: conv_layer_norm_linear(t[0], t[1], t[2], 1, 1, 1, 4, [4], t[3], t[4], 1e-5, t[5], t[6]),
        (x, cw, cb, lw, lb, w, b),
    )


def test_opcheck(one_thread):
    tensors, groups, _ = _inputs(torch.float32)
    x, cw, cb, lw, lb, w, b = tensors
    args = (x, cw, cb, [1, 1], [3, 3], [1, 1], groups, [8], lw, lb, 1e-6, w, b)
    torch.library.opcheck(ops.conv_layer_norm_linear.default, args)
    grad = torch.randn(2, 6, 5, 12)
    detached = [t.detach() if isinstance(t, torch.Tensor) else t for t in args]
    torch.library.opcheck(ops.conv_layer_norm_linear_backward.default, (grad, *detached, [True] * 7))


def test_keeps_only_the_conv_input():
    tensors, groups, padding = _inputs(torch.float32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        _call(conv_layer_norm_linear, tensors, groups, padding)
    params = {t.untyped_storage().data_ptr() for t in tensors[1:] if t is not None}
    activations = {t.untyped_storage().data_ptr() for t in saved} - params
    assert activations == {tensors[0].untyped_storage().data_ptr()}


def test_autocast_is_eager_autocast():
    # The op runs under autocast (tests/test_autocast.py checks its gradients and what it keeps).
    tensors, groups, padding = _inputs(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = _call(conv_layer_norm_linear, tensors, groups, padding)
        ref = _call(_eager, tensors, groups, padding)
    assert out.dtype == ref.dtype and torch.equal(out, ref)
    assert "fxfuse::(anonymous namespace)::ConvLayerNormLinear" in out.grad_fn.name()  # the fused op ran


def test_direct_call_under_autocast_matches_eager_autocast():
    tensors, groups, _ = _inputs(torch.float32)
    x, cw, cb, lw, lb, w, b = tensors
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ops.conv_layer_norm_linear(x, cw, cb, [1, 1], [3, 3], [1, 1], groups, [8], lw, lb, 1e-6, w, b)
        ref = _eager(x, cw, cb, 1, 3, 1, groups, [8], lw, lb, 1e-6, w, b)
    assert out.dtype == ref.dtype and torch.equal(out, ref)


@pytest.mark.parametrize("case", ["ln_size", "in_features", "conv_channels", "int_input"])
def test_bad_input_raises_what_eager_raises(case):
    tensors, groups, padding = _inputs(torch.float32)
    tensors = [t if t is None else t.detach() for t in tensors]
    shape = [8]
    if case == "ln_size":
        shape = [7]
    elif case == "in_features":
        tensors[5] = tensors[5][:, :5]
    elif case == "conv_channels":
        tensors[0] = tensors[0][:, :4]
    else:
        tensors[0] = tensors[0].long()
    x, cw, cb, lw, lb, w, b = tensors
    with pytest.raises(Exception) as eager_exc:
        _eager(x, cw, cb, 1, padding, 1, groups, shape, lw, lb, 1e-6, w, b)
    with pytest.raises(type(eager_exc.value)):
        conv_layer_norm_linear(x, cw, cb, 1, padding, 1, groups, shape, lw, lb, 1e-6, w, b)
