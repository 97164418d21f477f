"""fxfuse::conv_bn_act / conv_bn_act_backward (fxfuse/ops/conv_bn_act.py): against the
plain-PyTorch reference (tests/support/reference.py), opcheck, gradcheck, bad input, what it keeps."""

import itertools

import pytest
import torch
import torch.nn.functional as F
from support import reference
from support.op_checks import ACT_PARAMS, FORMATS, bn_params, same_error, stats

from fxfuse import _extension
from fxfuse.ops import ACTIVATIONS

pytestmark = pytest.mark.skipif(not _extension.loaded(), reason="fxfuse._C is not built")

if _extension.loaded():
    from fxfuse.ops import conv_bn_act


@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("training", [True, False])
def test_conv_bn_act_matches_reference_float64(act, fmt, training):
    x = torch.randn(3, 4, 9, 7, dtype=torch.double).to(memory_format=fmt).requires_grad_()
    w = torch.randn(6, 2, 3, 3, dtype=torch.double, requires_grad=True)
    b = torch.randn(6, dtype=torch.double, requires_grad=True)
    g, beta = (t.requires_grad_() for t in bn_params(6, torch.double))
    rm, rv = stats(6, torch.double)
    rm2, rv2 = rm.clone(), rv.clone()
    p = ACT_PARAMS.get(act, 0.0)
    args = dict(stride=(2, 1), padding=(1, 2), dilation=(1, 2), groups=2)
    out = conv_bn_act(
        x,
        w,
        b,
        **args,
        running_mean=rm,
        running_var=rv,
        bn_weight=g,
        bn_bias=beta,
        training=training,
        momentum=0.3,
        eps=1e-3,
        act=act,
        act_param=p,
    )
    ref = reference.conv_bn_act(
        x,
        w,
        b,
        args["stride"],
        args["padding"],
        args["dilation"],
        args["groups"],
        rm2,
        rv2,
        g,
        beta,
        training,
        0.3,
        1e-3,
        act,
        p,
    )
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10)
    assert out.is_contiguous(memory_format=fmt)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (x, w, b, g, beta), grad)
    want = torch.autograd.grad(ref, (x, w, b, g, beta), grad)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(rm, rm2, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(rv, rv2, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("act", ["relu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("batch_stats", [True, False])
def test_conv_bn_act_gradcheck(act, batch_stats):
    x = torch.randn(2, 3, 5, 4, dtype=torch.double, requires_grad=True)
    w = torch.randn(4, 3, 3, 3, dtype=torch.double, requires_grad=True)
    b = torch.randn(4, dtype=torch.double, requires_grad=True)
    g, beta = (t.requires_grad_() for t in bn_params(4, torch.double))
    rm, rv = stats(4, torch.double)

    def fn(x, w, b, g, beta):
        return torch.ops.fxfuse.conv_bn_act(
            x, w, b, [1, 1], [1, 1], [1, 1], 1, g, beta, rm, rv, batch_stats, 1e-5, act, 0.0
        )[0]

    assert torch.autograd.gradcheck(fn, (x, w, b, g, beta))


def _opcheck_samples(fmt):
    x = torch.randn(2, 4, 5, 6).to(memory_format=fmt)
    w = torch.randn(6, 4, 3, 3).to(memory_format=fmt)
    g, beta = bn_params(6, torch.float32)
    rm, rv = stats(6, torch.float32)
    y = torch.randn(2, 6, 5, 6).to(memory_format=fmt)
    mean, var = y.mean((0, 2, 3)), y.var((0, 2, 3), unbiased=False)
    req = lambda *ts: tuple(t.clone().requires_grad_() for t in ts)  # noqa: E731
    return [
        (
            torch.ops.fxfuse.conv_bn_act.default,
            (*req(x, w), None, [1, 1], [1, 1], [1, 1], 1, *req(g, beta), rm, rv, True, 1e-5, "relu", 0.0),
        ),
        (
            torch.ops.fxfuse.conv_bn_act.default,
            (
                *req(x, w[:, :2].contiguous(memory_format=fmt), g),
                [2, 2],
                [0, 1],
                [1, 1],
                2,
                None,
                None,
                rm,
                rv,
                False,
                1e-5,
                "hardswish",
                0.0,
            ),
        ),
        (
            torch.ops.fxfuse.conv_bn_act_backward.default,
            (
                torch.randn(2, 6, 5, 6).to(memory_format=fmt),
                x,
                w,
                None,
                [1, 1],
                [1, 1],
                [1, 1],
                1,
                g,
                beta,
                mean,
                var,
                True,
                1e-5,
                "gelu_tanh",
                0.0,
                [True, True, False, True, True],
            ),
        ),
    ]


@pytest.mark.parametrize("fmt", FORMATS, ids=["contiguous", "channels_last"])
def test_opcheck(fmt):
    for op, args in _opcheck_samples(fmt):
        torch.library.opcheck(op, args)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_is_correct(dtype):
    x = torch.randn(2, 3, 4, 5).to(dtype).requires_grad_()
    w = torch.randn(4, 3, 3, 3).to(dtype).requires_grad_()
    g, beta = (t.to(dtype).requires_grad_() for t in bn_params(4, torch.float32))
    out = conv_bn_act(x, w, None, 1, 1, 1, 1, None, None, g, beta, True, 0.1, 1e-5, "relu")
    xf, wf, gf, bf = (t.detach().float().requires_grad_() for t in (x, w, g, beta))
    ref = reference.conv_bn_act(xf, wf, None, 1, 1, 1, 1, None, None, gf, bf, True, 0.1, 1e-5, "relu")
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.05)
    out.float().sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(w.grad.float(), wf.grad, rtol=0.1, atol=0.1)


def test_padding_same_and_valid():
    x = torch.randn(2, 3, 8, 9, dtype=torch.double)
    for k, d, padding in itertools.product((2, 3, 4), (1, 2), ("same", "valid")):
        w = torch.randn(5, 3, k, k, dtype=torch.double)
        out = conv_bn_act(x, w, None, 1, padding, d, 1, None, None, None, None, True, 0.1, 1e-5)
        ref = reference.conv_bn_act(x, w, None, 1, padding, d, 1, None, None, None, None, True, 0.1, 1e-5, "none")
        torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("case", ["rank", "channels", "dtype", "batch1", "unknown_act"])
def test_bad_input_raises_like_eager(case):
    w = torch.randn(4, 3, 3, 3)
    x = {
        "rank": torch.randn(3, 8, 8, 2, 1),
        "channels": torch.randn(2, 5, 8, 8),
        "dtype": torch.randn(2, 3, 8, 8, dtype=torch.double),
        "batch1": torch.randn(1, 3, 3, 3),
        "unknown_act": torch.randn(2, 3, 8, 8),
    }[case]
    act = "swish" if case == "unknown_act" else "relu"
    rm, rv = torch.zeros(4), torch.ones(4)
    if case == "unknown_act":
        with pytest.raises(ValueError, match="unknown activation"):
            conv_bn_act(x, w, None, running_mean=rm, running_var=rv, training=True, act=act)
        return
    same_error(
        lambda: conv_bn_act(x, w, None, running_mean=rm, running_var=rv, training=True, act=act),
        lambda: F.relu(F.batch_norm(F.conv2d(x, w), rm.clone(), rv.clone(), training=True)),
    )


def test_nan_and_inf_propagate_like_eager():
    x = torch.randn(2, 3, 6, 6, dtype=torch.double)
    x[0, 0, 0, 0] = float("nan")
    x[1, 1, 2, 2] = float("inf")
    w = torch.randn(4, 3, 3, 3, dtype=torch.double)
    for training in (True, False):
        rm, rv = torch.zeros(4, dtype=torch.double), torch.ones(4, dtype=torch.double)
        out = conv_bn_act(x, w, None, 1, 1, 1, 1, rm.clone(), rv.clone(), None, None, training, 0.1, 1e-5, "relu")
        ref = reference.conv_bn_act(
            x, w, None, 1, 1, 1, 1, rm.clone(), rv.clone(), None, None, training, 0.1, 1e-5, "relu"
        )
        torch.testing.assert_close(out, ref, equal_nan=True)


def test_only_the_conv_input_is_saved():
    x = torch.randn(4, 8, 16, 16, requires_grad=True)
    w = torch.randn(16, 8, 3, 3, requires_grad=True)
    g, beta = (t.requires_grad_() for t in bn_params(16, torch.float32))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        conv_bn_act(x, w, None, 1, 1, 1, 1, None, None, g, beta, True, 0.1, 1e-5, "gelu")
    big = [t for t in saved if t.numel() > 16 * 8 * 9]
    assert len(big) == 1 and big[0].data_ptr() == x.data_ptr()
