"""fxfuse::conv2d / conv2d_backward (fxfuse/ops/conv2d.py): the depthwise weight-gradient
kernel (csrc/cpu/depthwise_kernel*.cpp) against a float64 reference and against eager's own
float32 error, the routing to ATen, and the op: eager's forward, gradcheck, opcheck, saved
tensors, autocast, bad input.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from fxfuse import _extension

pytestmark = pytest.mark.skipif(not _extension.loaded(), reason="fxfuse._C is not built")

if _extension.loaded():
    from fxfuse.ops import conv2d

    ops = torch.ops.fxfuse

ALL = [True, True, True]


def _case(n, c, hw, k, stride, padding, dilation, dtype, channels_last, bias=True):
    h, w = hw
    kh, kw = k
    x = torch.randn(n, c, h, w, dtype=torch.float64)
    weight = torch.randn(c, 1, kh, kw, dtype=torch.float64)
    b = torch.randn(c, dtype=torch.float64) if bias else None
    out = F.conv2d(x, weight, b, stride, padding, dilation, c)
    gy = torch.randn_like(out)
    cast = [t if t is None else t.to(dtype) for t in (x, weight, b, gy)]
    if channels_last:
        cast[0] = cast[0].contiguous(memory_format=torch.channels_last)
        cast[3] = cast[3].contiguous(memory_format=torch.channels_last)
    args = ([stride, stride], [padding, padding], [dilation, dilation], c)
    return (x, weight, b, gy), cast, args


def _aten(gy, x, weight, b, stride, padding, dilation, groups, mask=ALL):
    bias_sizes = list(b.shape) if b is not None else None
    return torch.ops.aten.convolution_backward(
        gy, x, weight, bias_sizes, stride, padding, dilation, False, [0, 0], groups, mask
    )


def _rel_error(got, ref):
    return ((got.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-300)).item()


# (n, c, (h, w), (kh, kw), stride, padding, dilation): channel counts with and without
# vector tails (8 float32 / 4 float64 lanes), kernel widths with a register path (3, 5, 7)
# and without (4, 1x9), strides, dilations, and paddings larger and smaller than the kernel.
GEOMETRIES = [
    (2, 16, (9, 11), (7, 7), 1, 3, 1),
    (3, 13, (10, 7), (5, 5), 1, 2, 1),
    (2, 40, (12, 12), (5, 5), 2, 2, 1),
    (1, 24, (8, 9), (3, 3), 2, 1, 2),
    (2, 9, (6, 6), (4, 4), 1, 1, 1),
    (2, 5, (7, 12), (1, 9), 1, 4, 1),
    (2, 33, (5, 5), (7, 7), 1, 3, 1),  # every tap but the centre falls outside some rows
    (2, 8, (11, 11), (5, 5), 3, 0, 2),  # no padding, stride 3
    (1, 4, (3, 3), (7, 7), 1, 6, 1),  # padding wider than the input
]


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("channels_last", [True, False])
def test_float64_matches_reference(geometry, channels_last):
    ref_in, (x, w, b, gy), args = _case(*geometry, torch.float64, channels_last)
    got = ops.conv2d_backward(gy, x, w, b, *args, ALL)
    want = _aten(ref_in[3], ref_in[0], ref_in[1], ref_in[2], *args)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("geometry", [g for g in GEOMETRIES if g[3][0] * g[3][1] >= 25])
@pytest.mark.parametrize("channels_last", [True, False])
def test_float32_no_worse_than_eager(geometry, channels_last):
    ref_in, (x, w, b, gy), args = _case(*geometry, torch.float32, channels_last)
    got = ops.conv2d_backward(gy, x, w, b, *args, ALL)
    eager = _aten(gy, x, w, b, *args)
    ref = _aten(ref_in[3], ref_in[0], ref_in[1], ref_in[2], *args)
    assert torch.equal(got[0], eager[0])  # the input gradient is ATen's
    for i in (1, 2):
        assert _rel_error(got[i], ref[i]) <= max(1.5 * _rel_error(eager[i], ref[i]), 5e-7)


def test_float32_no_worse_than_eager_at_convnext_size():
    # ConvNeXt-T's first stage, batch 2: 6272 terms per weight element.
    ref_in, (x, w, b, gy), args = _case(2, 96, (56, 56), (7, 7), 1, 3, 1, torch.float32, True)
    got = ops.conv2d_backward(gy, x, w, b, *args, ALL)
    eager = _aten(gy, x, w, b, *args)
    ref = _aten(ref_in[3], ref_in[0], ref_in[1], ref_in[2], *args)
    for i in (1, 2):
        assert _rel_error(got[i], ref[i]) <= _rel_error(eager[i], ref[i])


@pytest.mark.parametrize("channels_last", [True, False])
def test_weight_gradient_layout_is_eagers(channels_last):
    for dtype in (torch.float32, torch.float64):
        _, (x, w, b, gy), args = _case(2, 16, (9, 9), (7, 7), 1, 3, 1, dtype, channels_last)
        got = ops.conv2d_backward(gy, x, w, b, *args, ALL)
        eager = _aten(gy, x, w, b, *args)
        assert [t.stride() for t in got] == [t.stride() for t in eager]


@pytest.mark.parametrize("mask", list(itertools.product([False, True], repeat=3)))
def test_output_mask(mask):
    _, (x, w, b, gy), args = _case(2, 16, (9, 9), (7, 7), 1, 3, 1, torch.float64, True)
    got = ops.conv2d_backward(gy, x, w, b, *args, list(mask))
    full = ops.conv2d_backward(gy, x, w, b, *args, ALL)
    for wanted, g, f in zip(mask, got, full):
        if wanted:
            assert torch.equal(g, f)
        else:
            assert g is None


def test_no_bias():
    _, (x, w, _b, gy), args = _case(2, 16, (9, 9), (7, 7), 1, 3, 1, torch.float64, True, bias=False)
    got = ops.conv2d_backward(gy, x, w, None, *args, ALL)
    want = _aten(gy, x, w, None, *args)
    assert got[2] is None
    torch.testing.assert_close(got[1], want[1], rtol=1e-12, atol=1e-12)


def test_result_does_not_depend_on_thread_count():
    _, (x, w, b, gy), args = _case(4, 48, (20, 20), (7, 7), 1, 3, 1, torch.float32, True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.conv2d_backward(gy, x, w, b, *args, ALL)
        torch.set_num_threads(max(2, threads))
        many = ops.conv2d_backward(gy, x, w, b, *args, ALL)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[1], many[1]) and torch.equal(one[2], many[2])


@pytest.mark.parametrize(
    "case",
    [
        "3x3 float32",  # oneDNN is as fast there: ATen's
        "grouped",  # two channels per group
        "bfloat16",
        "input only",
    ],
)
def test_other_convolutions_are_atens_bit_for_bit(case):
    k, dtype, mask = (7, 7), torch.float32, ALL
    if case == "3x3 float32":
        k = (3, 3)
    if case == "bfloat16":
        dtype = torch.bfloat16
    if case == "input only":
        mask = [True, False, False]
    _, (x, w, b, gy), args = _case(2, 16, (9, 9), k, 1, 1, 1, dtype, True)
    if case == "grouped":
        w = torch.randn(16, 2, 7, 7)
        args = (args[0], [3, 3], args[2], 8)
        gy = torch.randn(2, 16, 9, 9).contiguous(memory_format=torch.channels_last)
    got = ops.conv2d_backward(gy, x, w, b, *args, mask)
    want = _aten(gy, x, w, b, *args, mask)
    for g, r in zip(got, want):
        assert (g is None and r is None) or torch.equal(g, r)


@pytest.mark.parametrize("case", ["grad_shape", "weight_channels", "stride"])
def test_bad_input_raises_what_aten_raises(case):
    _, (x, w, b, gy), args = _case(2, 16, (9, 9), (7, 7), 1, 3, 1, torch.float32, True)
    if case == "grad_shape":
        gy = gy[:, :, :-1]
    elif case == "weight_channels":
        w = w[:8]
    else:
        args = ([0, 0], *args[1:])
    with pytest.raises(Exception) as aten_exc:
        _aten(gy, x, w, b, *args)
    with pytest.raises(type(aten_exc.value)):
        ops.conv2d_backward(gy, x, w, b, *args, ALL)


# ---------------------------------------------------------------------------- the op


def _module_args(dtype=torch.float64, channels_last=True, c=12):
    x = torch.randn(2, c, 10, 9, dtype=dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    w = torch.randn(c, 1, 7, 7, dtype=dtype)
    b = torch.randn(c, dtype=dtype)
    return [t.requires_grad_() for t in (x, w, b)]


@pytest.mark.parametrize("padding", [3, "same", (2, 1)])
def test_forward_is_eagers_and_gradients_match(padding):
    x, w, b = _module_args()
    out = conv2d(x, w, b, 1, padding, 1, 12)
    ref = F.conv2d(x, w, b, 1, padding, 1, 12)
    assert torch.equal(out, ref) and out.stride() == ref.stride()
    grad = torch.randn_like(ref)
    for got, want in zip(torch.autograd.grad(out, (x, w, b), grad), torch.autograd.grad(ref, (x, w, b), grad)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_gradcheck():
    x, w, b = _module_args(c=5)
    assert torch.autograd.gradcheck(lambda *t: conv2d(*t, 1, 3, 1, 5), (x, w, b))


def test_opcheck():
    x, w, b = (t.detach().float().requires_grad_() for t in _module_args(dtype=torch.float32))
    torch.library.opcheck(ops.conv2d.default, (x, w, b, [1, 1], [3, 3], [1, 1], 12))
    torch.library.opcheck(ops.conv2d.default, (x.detach(), w, None, [2, 2], [1, 1], [1, 1], 12))
    gy = torch.randn(2, 12, 10, 9)
    torch.library.opcheck(
        ops.conv2d_backward.default,
        (gy, x.detach(), w.detach(), b.detach(), [1, 1], [3, 3], [1, 1], 12, [True, True, True]),
    )


def test_keeps_what_eager_keeps():
    x, w, b = _module_args(dtype=torch.float32)
    saved, eager = [], []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        conv2d(x, w, b, 1, 3, 1, 12)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: eager.append(t) or t, lambda t: t):
        F.conv2d(x, w, b, 1, 3, 1, 12)
    activations = {t.untyped_storage().data_ptr() for t in saved if t.dim() == 4 and t.shape[0] == 2}
    assert activations == {x.untyped_storage().data_ptr()}
    assert activations == {t.untyped_storage().data_ptr() for t in eager if t.dim() == 4 and t.shape[0] == 2}


def test_autocast_matches_eager_autocast():
    x, w, b = (t.detach().float().requires_grad_() for t in _module_args(dtype=torch.float32))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = conv2d(x, w, b, 1, 3, 1, 12)
        ref = F.conv2d(x, w, b, 1, 3, 1, 12)
    assert out.dtype == ref.dtype == torch.bfloat16 and torch.equal(out, ref)
    grad = torch.randn_like(ref)
    for got, want in zip(torch.autograd.grad(out, (x, w, b), grad), torch.autograd.grad(ref, (x, w, b), grad)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("case", ["channels", "groups", "weight_rank", "bias_shape", "int_input", "stride"])
def test_bad_input_raises_what_eager_raises(case):
    x, w, b = (t.detach() for t in _module_args(dtype=torch.float32))
    stride, groups = 1, 12
    if case == "channels":
        x = x[:, :6]
    elif case == "groups":
        groups = 5
    elif case == "weight_rank":
        w = w[:, 0]
    elif case == "bias_shape":
        b = b[:5]
    elif case == "int_input":
        x = x.long()
    else:
        stride = 0
    with pytest.raises(Exception) as eager_exc:
        F.conv2d(x, w, b, stride, 3, 1, groups)
    with pytest.raises(type(eager_exc.value)):
        conv2d(x, w, b, stride, 3, 1, groups)
