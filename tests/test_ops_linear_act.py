"""fxfuse::linear_act / linear_act_backward (fxfuse/ops/linear_act.py): against eager PyTorch,
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
)

from fxfuse import _extension
from fxfuse.ops.activations import ACTIVATIONS

pytestmark = pytest.mark.skipif(not _extension.loaded(), reason="fxfuse._C is not built")

if _extension.loaded():
    from fxfuse.ops import linear_act
    from fxfuse.ops.checks import apply_activation

    ops = torch.ops.fxfuse


@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("shape", [(), (5,), (3, 4), (2, 0)], ids=["1d", "2d", "3d", "empty"])
def test_matches_eager(act, shape):
    check_linear_op_matches_eager(
        linear_act, lambda x, w, b, act, p: apply_activation(F.linear(x, w, b), act, p), 1, act, shape
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision(dtype):
    x = torch.randn(2, 3, 8).to(dtype)
    w = torch.randn(5, 8).to(dtype)
    assert torch.equal(linear_act(x, w, None, "gelu"), F.gelu(F.linear(x, w)))


def test_autocast_matches_eager_autocast():
    # Fused under autocast (its Autocast kernel casts like F.linear's): same ops, same bits.
    x, w = torch.randn(4, 16), torch.randn(8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear_act(x, w, None, "gelu")
        ref = F.gelu(F.linear(x, w))
    assert out.dtype == ref.dtype == torch.bfloat16
    assert torch.equal(out, ref)


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "silu", "leaky_relu", "none"])
def test_gradcheck(act, one_thread):
    check_linear_op_gradcheck(ops.linear_act, act)


def _opcheck_samples(fmt):
    """On contiguous inputs, then again on channels_last 4-D ones."""
    req = lambda *ts: tuple(t.clone().requires_grad_() for t in ts)  # noqa: E731
    x4 = torch.randn(2, 4, 5, 6).to(memory_format=fmt)
    samples = [
        (ops.linear_act.default, (*req(x4, torch.randn(3, 6)), None, "leaky_relu", 0.1), {}),
        (
            ops.linear_act_backward.default,
            (torch.randn(2, 4, 5, 3), x4, torch.randn(3, 6), torch.randn(3), "gelu", 0.0, [True, True, True]),
            {},
        ),
    ]
    if fmt == torch.channels_last:
        return samples
    x3, w2, b7 = torch.randn(2, 3, 5), torch.randn(7, 5), torch.randn(7)
    return samples + [
        (ops.linear_act.default, (*req(x3, w2, b7), "gelu", 0.0), {}),
        (ops.linear_act_backward.default, (torch.randn(2, 3, 7), x3, w2, b7, "gelu_tanh", 0.0, [True, True, True]), {}),
        (
            ops.linear_act_backward.default,
            (torch.randn(7).expand(2, 3, 7), x3, w2, None, "silu", 0.0, [True, False, True]),
            {},
        ),
    ]


@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last], ids=["contiguous", "channels_last"])
def test_opcheck(fmt, one_thread):
    for op, args, kwargs in _opcheck_samples(fmt):
        torch.library.opcheck(op, args, kwargs)


def test_fake_strides_match_real():
    """The fake kernel promises the real kernel's layout."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.randn(2, 4, 5, 6).to(memory_format=torch.channels_last)
    w = torch.randn(6, 4, 3, 3)[:, :, 0, 0].t().contiguous()
    real = ops.linear_act(x, w, None, "silu", 0.0)
    with FakeTensorMode() as mode:
        fake = ops.linear_act(mode.from_tensor(x), mode.from_tensor(w), None, "silu", 0.0)
    assert fake.shape == real.shape and fake.stride() == real.stride()


def test_linear_act_saves_only_its_inputs():
    x, w, b = linear_inputs((8, 16), 32, 128, torch.float32)
    out, saved = saved_tensors(lambda: linear_act(x, w, b, "gelu"))
    assert sorted(t.data_ptr() for t in saved) == sorted(t.data_ptr() for t in (x, w, b))
    assert not any(t.shape == out.shape for t in saved)  # the wide pre-activation is recomputed
    _, eager_saved = saved_tensors(lambda: F.gelu(F.linear(x, w, b)))
    assert any(t.shape == out.shape for t in eager_saved)  # ... where eager keeps it


@pytest.mark.parametrize("case", BAD_LINEAR_CASES)
def test_linear_act_bad_input(case):
    x, w, b = bad_linear_args(case)
    same_error(lambda: linear_act(x, w, b, "gelu"), lambda: F.gelu(F.linear(x, w, b)))
    if case != "dtype":  # the op itself checks shapes (ATen checks dtypes)
        with pytest.raises(RuntimeError, match="fxfuse::linear_act"):
            ops.linear_act(x, w, b, "gelu", 0.0)


def test_unknown_activation():
    x, w = torch.randn(3, 5), torch.randn(4, 5)
    with pytest.raises(ValueError, match="unknown activation"):
        linear_act(x, w, None, "swish")
    with pytest.raises(ValueError, match="unknown activation"):
        ops.linear_act(x, w, None, "swish", 0.0)
