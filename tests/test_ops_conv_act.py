"""fxfuse::conv_act / conv_act_backward (fxfuse/ops/conv_act.py): against eager PyTorch, opcheck,
gradcheck, the saved-tensor contract, bad input."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from support.op_checks import ACT_PARAMS, assert_same_layout, same_error, saved_tensors, tol

from fxfuse import _extension

pytestmark = pytest.mark.skipif(not _extension.loaded(), reason="fxfuse._C is not built")

if _extension.loaded():
    from fxfuse.ops import conv_act
    from fxfuse.ops.checks import apply_activation

    ops = torch.ops.fxfuse

DTYPES = [torch.float32, torch.float64]


@pytest.mark.parametrize("act", ["none", "leaky_relu", "gelu", "hardswish"])
@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last], ids=["contiguous", "channels_last"])
def test_conv_act_matches_eager(act, fmt):
    p = ACT_PARAMS.get(act, 0.0)
    cases = [
        dict(stride=1, padding=1, dilation=1, groups=1),
        dict(stride=(2, 1), padding=(1, 2), dilation=(1, 2), groups=2),
        dict(padding="same", dilation=2),
        dict(padding="valid", stride=2),
    ]
    for dtype, kw in itertools.product(DTYPES, cases):
        groups = kw.get("groups", 1)
        x = torch.randn(2, 4, 7, 6, dtype=dtype).to(memory_format=fmt).requires_grad_()
        w = torch.randn(6, 4 // groups, 3, 3, dtype=dtype).to(memory_format=fmt).requires_grad_()
        b = torch.randn(6, dtype=dtype, requires_grad=True)
        out = conv_act(x, w, b, act=act, act_param=p, **kw)
        ref = apply_activation(F.conv2d(x, w, b, **kw), act, p)
        assert torch.equal(out, ref), kw
        assert_same_layout(out, ref)
        grad = torch.randn_like(ref)
        for a, e in zip(torch.autograd.grad(out, (x, w, b), grad), torch.autograd.grad(ref, (x, w, b), grad)):
            torch.testing.assert_close(
                a, e, rtol=1e-12 if dtype == torch.float64 else 1e-5, atol=1e-12 if dtype == torch.float64 else 1e-5
            )


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths")
@pytest.mark.parametrize("k,dilation", [(2, 1), (4, 1), (2, 3), (3, 2)])
def test_conv_act_padding_same(k, dilation):
    """padding='same' with an odd total padding pads the right edge, as F.conv2d does."""
    x = torch.randn(2, 3, 8, 9, dtype=torch.double, requires_grad=True)
    w = torch.randn(5, 3, k, k, dtype=torch.double, requires_grad=True)
    out = conv_act(x, w, None, padding="same", dilation=dilation, act="gelu")
    ref = F.gelu(F.conv2d(x, w, None, padding="same", dilation=dilation))
    assert torch.equal(out, ref)
    grad = torch.randn_like(ref)
    for a, e in zip(torch.autograd.grad(out, (x, w), grad), torch.autograd.grad(ref, (x, w), grad)):
        torch.testing.assert_close(a, e, **tol(torch.double))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision(dtype):
    xc, wc = torch.randn(2, 3, 6, 6).to(dtype), torch.randn(4, 3, 3, 3).to(dtype)
    assert torch.equal(conv_act(xc, wc, None, padding=1, act="silu"), F.silu(F.conv2d(xc, wc, None, 1, 1)))


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "hardswish"])
def test_conv_act_gradcheck(act, one_thread):
    x = torch.randn(2, 4, 3, 4, dtype=torch.double, requires_grad=True)
    w = torch.randn(4, 2, 2, 2, dtype=torch.double, requires_grad=True)
    b = torch.randn(4, dtype=torch.double, requires_grad=True)

    def fn(x, w, b):
        return ops.conv_act(x, w, b, [2, 1], [1, 0], [1, 2], 2, act, 0.0)

    assert torch.autograd.gradcheck(fn, (x, w, b))


def _opcheck_samples(fmt):
    """On contiguous inputs, then again on channels_last ones (the output follows the input's layout)."""
    x4 = torch.randn(2, 4, 5, 6).to(memory_format=fmt)
    w4 = torch.randn(6, 4, 3, 3).to(memory_format=fmt)
    wg = torch.randn(6, 2, 3, 3).to(memory_format=fmt)
    samples = [
        (
            ops.conv_act.default,
            (x4.clone().requires_grad_(), wg.clone().requires_grad_(), None, [2, 2], [0, 1], [1, 1], 2, "gelu", 0.0),
            {},
        ),
        (
            ops.conv_act_backward.default,
            (
                torch.randn(2, 6, 5, 6).to(memory_format=fmt),
                x4,
                w4,
                torch.randn(6),
                [1, 1],
                [1, 1],
                [1, 1],
                1,
                "hardswish",
                0.0,
                [True, True, True],
            ),
            {},
        ),
    ]
    if fmt == torch.channels_last:
        return samples
    return samples + [
        (
            ops.conv_act_backward.default,
            (torch.randn(2, 6, 2, 3), x4, wg, None, [2, 2], [0, 1], [1, 1], 2, "relu", 0.0, [False, True, False]),
            {},
        ),
    ]


@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last], ids=["contiguous", "channels_last"])
def test_opcheck(fmt, one_thread):
    for op, args, kwargs in _opcheck_samples(fmt):
        torch.library.opcheck(op, args, kwargs)


def test_fake_strides_match_real():
    """The fake kernel promises the real kernel's layout, channels_last included."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.randn(2, 4, 5, 6).to(memory_format=torch.channels_last)
    w = torch.randn(6, 4, 3, 3)
    real = ops.conv_act(x, w, None, [1, 1], [1, 1], [1, 1], 1, "gelu", 0.0)
    with FakeTensorMode() as mode:
        fake = ops.conv_act(mode.from_tensor(x), mode.from_tensor(w), None, [1, 1], [1, 1], [1, 1], 1, "gelu", 0.0)
    assert fake.shape == real.shape and fake.stride() == real.stride()


def test_conv_act_saves_only_its_inputs():
    x = torch.randn(2, 8, 16, 16, requires_grad=True)
    w = torch.randn(32, 8, 3, 3, requires_grad=True)
    out, saved = saved_tensors(lambda: conv_act(x, w, None, padding=1, act="silu"))
    assert sorted(t.data_ptr() for t in saved) == sorted(t.data_ptr() for t in (x, w))
    assert not any(t.shape == out.shape for t in saved)


@pytest.mark.parametrize("case", ["channels", "rank", "dtype", "padding_same_strided", "too_small", "groups"])
def test_conv_act_bad_input(case):
    x, w, kw = torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3), {}
    if case == "channels":
        x = torch.randn(2, 5, 8, 8)
    elif case == "rank":
        x = torch.randn(2, 3, 8, 8, 1)
    elif case == "dtype":
        x = x.double()
    elif case == "padding_same_strided":
        kw = dict(padding="same", stride=2)
    elif case == "too_small":
        x = torch.randn(2, 3, 2, 2)
    else:
        kw = dict(groups=2)
    same_error(lambda: conv_act(x, w, None, act="relu", **kw), lambda: F.relu(F.conv2d(x, w, None, **kw)))


def test_unknown_activation():
    w = torch.randn(4, 5)
    with pytest.raises(ValueError, match="unknown activation"):
        conv_act(torch.randn(1, 5, 4, 4), w[:, :, None, None], None, act="swish")
    with pytest.raises(ValueError, match="unknown activation"):
        ops.conv_act(torch.randn(1, 5, 4, 4), w[:, :, None, None], None, [1, 1], [0, 0], [1, 1], 1, "swish", 0.0)
