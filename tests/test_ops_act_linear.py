"""fxfuse::act_linear / act_linear_backward (fxfuse/ops/act_linear.py): against eager PyTorch,
opcheck, gradcheck, the saved-tensor contract, bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.op_checks import (
    BAD_LINEAR_CASES,
    bad_linear_args,
    check_linear_op_gradcheck,
    check_linear_op_matches_eager,
    linear_inputs,
    same_error,
    saved_tensors,
    tol,
)

from fxfuse import _extension
from fxfuse.ops.activations import ACTIVATIONS

pytestmark = pytest.mark.skipif(not _extension.loaded(), reason="fxfuse._C is not built")

if _extension.loaded():
    from fxfuse.ops import act_linear
    from fxfuse.ops.checks import apply_activation

    ops = torch.ops.fxfuse


@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("shape", [(), (5,), (3, 4), (2, 0)], ids=["1d", "2d", "3d", "empty"])
def test_matches_eager(act, shape):
    # The activation's input is x itself: scaled by 3 to cover both sides of every activation's kinks.
    check_linear_op_matches_eager(
        act_linear, lambda x, w, b, act, p: F.linear(apply_activation(x, act, p), w, b), 3, act, shape
    )


def test_act_linear_non_contiguous_input():
    # A transposed activation input (the matmul path of F.linear) and a permuted 4-D one.
    w, b = torch.randn(7, 6, dtype=torch.float64, requires_grad=True), torch.randn(7, dtype=torch.float64)
    for x in (
        torch.randn(6, 5, dtype=torch.float64).t(),
        torch.randn(2, 6, 3, 4, dtype=torch.float64).permute(0, 2, 3, 1),
    ):
        x.requires_grad_()
        out, ref = act_linear(x, w, b, "gelu"), F.linear(F.gelu(x), w, b)
        assert torch.equal(out, ref)
        grad = torch.randn_like(ref)
        for a, e in zip(torch.autograd.grad(out, (x, w), grad), torch.autograd.grad(ref, (x, w), grad)):
            torch.testing.assert_close(a, e, **tol(torch.float64))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision(dtype):
    x = torch.randn(2, 3, 8).to(dtype)
    w = torch.randn(5, 8).to(dtype)
    assert torch.equal(act_linear(x, w, None, "silu"), F.linear(F.silu(x), w))


@pytest.mark.parametrize("input_dtype", [torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_act_linear_autocast_matches_eager_autocast(input_dtype):
    # Eager autocast runs the activation in the input's dtype, then casts its output for linear
    # (float64 stays). The fused op does the same, keeping the uncast input alone: bit for bit
    # eager's output and gradients.
    x = torch.randn(4, 16).to(input_dtype).requires_grad_()
    w = torch.randn(8, 16, dtype=torch.float64 if input_dtype == torch.float64 else torch.float32)
    w.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = act_linear(x, w, None, "gelu")
        ref = F.linear(F.gelu(x), w)
    assert out.dtype == ref.dtype
    assert torch.equal(out, ref)
    grad = torch.randn_like(ref)
    for a, e in zip(torch.autograd.grad(out, (x, w), grad), torch.autograd.grad(ref, (x, w), grad)):
        assert a.dtype == e.dtype
        assert torch.equal(a, e)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, saved = saved_tensors(lambda: act_linear(x, w, None, "gelu"))
    wide = {t.untyped_storage().data_ptr() for t in saved if t.numel() == x.numel()}
    assert wide == {x.untyped_storage().data_ptr()}


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "silu", "leaky_relu", "none"])
def test_gradcheck(act, one_thread):
    check_linear_op_gradcheck(ops.act_linear, act)


def _opcheck_samples(fmt):
    """On contiguous inputs, then again on channels_last 4-D ones."""
    req = lambda *ts: tuple(t.clone().requires_grad_() for t in ts)  # noqa: E731
    x4 = torch.randn(2, 4, 5, 6).to(memory_format=fmt)
    samples = [
        (ops.act_linear.default, (*req(x4, torch.randn(3, 6)), torch.randn(3), "gelu", 0.0), {}),
        (
            ops.act_linear_backward.default,
            (torch.randn(2, 4, 5, 3), x4, torch.randn(3, 6), None, "silu", 0.0, [True, True, False]),
            {},
        ),
    ]
    if fmt == torch.channels_last:
        return samples
    x3, w2, b7 = torch.randn(2, 3, 5), torch.randn(7, 5), torch.randn(7)
    return samples + [
        (ops.act_linear.default, (*req(x3, w2, b7), "gelu_tanh", 0.0), {}),
        (ops.act_linear_backward.default, (torch.randn(2, 3, 7), x3, w2, b7, "hardswish", 0.0, [True, True, True]), {}),
    ]


@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last], ids=["contiguous", "channels_last"])
def test_opcheck(fmt, one_thread):
    for op, args, kwargs in _opcheck_samples(fmt):
        torch.library.opcheck(op, args, kwargs)


def test_act_linear_saves_only_its_inputs():
    x, w, b = linear_inputs((8, 16), 128, 32, torch.float32)
    _, saved = saved_tensors(lambda: act_linear(x, w, b, "gelu"))
    assert sorted(t.data_ptr() for t in saved) == sorted(t.data_ptr() for t in (x, w, b))
    _, eager_saved = saved_tensors(lambda: F.linear(F.gelu(x), w, b))
    assert len({t.untyped_storage().data_ptr() for t in eager_saved if t.numel() == x.numel()}) == 2  # x, gelu(x)


@pytest.mark.parametrize("case", BAD_LINEAR_CASES)
def test_act_linear_bad_input(case):
    x, w, b = bad_linear_args(case)
    same_error(lambda: act_linear(x, w, b, "gelu"), lambda: F.linear(F.gelu(x), w, b))
    if case != "dtype":  # the op itself checks shapes (ATen checks dtypes)
        with pytest.raises(RuntimeError, match="fxfuse::act_linear"):
            ops.act_linear(x, w, b, "gelu", 0.0)


def test_act_linear_bad_activation():
    with pytest.raises(ValueError, match="swish"):
        act_linear(torch.randn(3, 5), torch.randn(4, 5), None, "swish")
