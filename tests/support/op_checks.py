"""What the op tests (tests/test_ops_*.py) share: tolerances, bad-input and saved-tensor checks,
inputs for the ops holding a linear layer or a BatchNorm."""

from __future__ import annotations

import pytest
import torch

ACT_PARAMS = {"leaky_relu": 0.2}
FORMATS = [torch.contiguous_format, torch.channels_last]

# float32: ATen's own spread between the CPU capabilities it can pick. Measured with
# torch 2.14.1 on an AVX-512 CPU, ATEN_CPU_CAPABILITY=default/avx2/avx512, over
# randn(3, 5, 41, 57) * 4 and 200001 points of [-12, 12] (dense non-contiguous input, so
# ATen's own kernel runs), as max |a - b| / (1 + |b|), the form rtol=atol=t checks:
# gelu 3.2e-6 and gelu_backward 5.4e-6 between DEFAULT and AVX2 (AVX2 and AVX512 are
# bitwise equal), both forms; oneDNN's erf-GELU (contiguous input) against ATen's
# kernel: 1.1e-6 with oneDNN's AVX-512 JIT, 1e-7 with its AVX2 one.
F32_SPREAD = 5.4e-6


def tol(dtype):
    """The accuracy contract: ATen's cross-capability spread in float32, 1e-12 in float64
    (relative and absolute); NaN where eager has NaN, and inf exactly."""
    t = F32_SPREAD if dtype == torch.float32 else 1e-12
    return dict(rtol=t, atol=t, equal_nan=True)


def assert_same_layout(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype
    assert a.numel() == 0 or a.stride() == b.stride(), (a.stride(), b.stride())


def same_error(fn_fused, fn_eager):
    """fn_fused raises an exception of the type fn_eager raises."""
    with pytest.raises(Exception) as eager_exc:
        fn_eager()
    with pytest.raises(type(eager_exc.value)):
        fn_fused()


def saved_tensors(fn):
    """(fn(), the tensors autograd saved while it ran)."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn()
    return out, saved


# --------------------------------------------------------------------------- linear layers


def linear_inputs(shape, in_f, out_f, dtype, bias=True):
    x = torch.randn(*shape, in_f, dtype=dtype, requires_grad=True)
    w = (torch.randn(out_f, in_f, dtype=dtype) / in_f**0.5).requires_grad_()
    b = torch.randn(out_f, dtype=dtype, requires_grad=True) if bias else None
    return x, w, b


BAD_LINEAR_CASES = ["in_features", "weight_rank", "bias_shape", "dtype", "scalar_input"]


def bad_linear_args(case):
    x, w, b = torch.randn(3, 5), torch.randn(4, 5), torch.randn(4)
    if case == "in_features":
        x = torch.randn(3, 6)
    elif case == "weight_rank":
        w = torch.randn(4, 5, 1)
    elif case == "bias_shape":
        b = torch.randn(3)
    elif case == "dtype":
        w = w.double()
    else:
        x = torch.tensor(1.0)
    return x, w, b


def check_linear_op_matches_eager(fused, eager, scale, act, shape):
    """fused(x, w, b, act, p) against eager(...): the same bits forward, gradients within tol.
    `scale` multiplies the input (for act_linear the activation's input, scaled to cover both
    sides of every activation's kinks)."""
    p = ACT_PARAMS.get(act, 0.0)
    for dtype, bias in ((torch.float64, True), (torch.float32, False)):
        x, w, b = linear_inputs(shape, 6, 7, dtype, bias)
        x = (x.detach() * scale).requires_grad_()
        params = [t for t in (x, w, b) if t is not None]
        out = fused(x, w, b, act, p)
        ref = eager(x, w, b, act, p)
        assert torch.equal(out, ref)  # the same ATen ops, in the same order
        assert_same_layout(out, ref)
        grad = torch.randn_like(ref)
        for a, e in zip(torch.autograd.grad(out, params, grad), torch.autograd.grad(ref, params, grad)):
            torch.testing.assert_close(a, e, **tol(dtype))


def check_linear_op_gradcheck(fn, act):
    x, w, b = linear_inputs((2, 3), 5, 4, torch.double)
    assert torch.autograd.gradcheck(lambda x, w, b: fn(x, w, b, act, 0.1), (x, w, b))
    x1, w1, _ = linear_inputs((), 5, 4, torch.double)
    assert torch.autograd.gradcheck(lambda x, w: fn(x, w, None, act, 0.1), (x1, w1))


# --------------------------------------------------------------------------- BatchNorm


def bn_params(c, dtype, affine=True):
    if not affine:
        return None, None
    return torch.rand(c, dtype=dtype) + 0.5, torch.randn(c, dtype=dtype)


def stats(c, dtype):
    return torch.randn(c, dtype=dtype) * 0.1, torch.rand(c, dtype=dtype) + 0.5
