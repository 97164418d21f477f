"""fxfuse's C++ ops: against the plain-PyTorch reference, opcheck, gradcheck, bad input."""

import itertools

import pytest
import reference
import torch
import torch.nn.functional as F

import fxfuse
from fxfuse import _extension
from fxfuse.ops import ACTIVATIONS, batch_norm, conv_batch_norm
from fxfuse.ops.checks import apply_activation

ACT_PARAMS = {"leaky_relu": 0.2}
FORMATS = [torch.contiguous_format, torch.channels_last]


def _bn_params(c, dtype, affine=True):
    if not affine:
        return None, None
    return torch.rand(c, dtype=dtype) + 0.5, torch.randn(c, dtype=dtype)


def _stats(c, dtype):
    return torch.randn(c, dtype=dtype) * 0.1, torch.rand(c, dtype=dtype) + 0.5


@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("training", [True, False])
def test_conv_bn_act_matches_reference_float64(act, fmt, training):
    x = torch.randn(3, 4, 9, 7, dtype=torch.double).to(memory_format=fmt).requires_grad_()
    w = torch.randn(6, 2, 3, 3, dtype=torch.double, requires_grad=True)
    b = torch.randn(6, dtype=torch.double, requires_grad=True)
    g, beta = (t.requires_grad_() for t in _bn_params(6, torch.double))
    rm, rv = _stats(6, torch.double)
    rm2, rv2 = rm.clone(), rv.clone()
    p = ACT_PARAMS.get(act, 0.0)
    args = dict(stride=(2, 1), padding=(1, 2), dilation=(1, 2), groups=2)
    out = conv_batch_norm.conv_bn_act(
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


@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_batch_norm_act_matches_reference_float32(act, fmt):
    x = (torch.randn(4, 5, 6, 7) * 3 + 2).to(memory_format=fmt).requires_grad_()
    g, beta = (t.requires_grad_() for t in _bn_params(5, torch.float32))
    rm, rv = _stats(5, torch.float32)
    rm2, rv2 = rm.clone(), rv.clone()
    p = ACT_PARAMS.get(act, 0.0)
    out = batch_norm.batch_norm_act(x, rm, rv, g, beta, True, 0.1, 1e-5, act, p)
    ref = reference.batch_norm_act(x, rm2, rv2, g, beta, True, 0.1, 1e-5, act, p)
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)
    grad = torch.randn_like(out)
    for a, e in zip(torch.autograd.grad(out, (x, g, beta), grad), torch.autograd.grad(ref, (x, g, beta), grad)):
        torch.testing.assert_close(a, e, rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(rm, rm2)
    torch.testing.assert_close(rv, rv2)


@pytest.mark.parametrize("act", ["relu", "gelu_tanh", "silu"])
@pytest.mark.parametrize("batch_stats", [True, False])
def test_conv_bn_act_gradcheck(act, batch_stats):
    x = torch.randn(2, 3, 5, 4, dtype=torch.double, requires_grad=True)
    w = torch.randn(4, 3, 3, 3, dtype=torch.double, requires_grad=True)
    b = torch.randn(4, dtype=torch.double, requires_grad=True)
    g, beta = (t.requires_grad_() for t in _bn_params(4, torch.double))
    rm, rv = _stats(4, torch.double)

    def fn(x, w, b, g, beta):
        return torch.ops.fxfuse.conv_bn_act(
            x, w, b, [1, 1], [1, 1], [1, 1], 1, g, beta, rm, rv, batch_stats, 1e-5, act, 0.0
        )[0]

    assert torch.autograd.gradcheck(fn, (x, w, b, g, beta))


@pytest.mark.parametrize("act", ["none", "leaky_relu", "gelu", "hardswish"])
def test_batch_norm_act_gradcheck(act):
    x = torch.randn(3, 4, 3, 2, dtype=torch.double, requires_grad=True)
    g, beta = (t.requires_grad_() for t in _bn_params(4, torch.double))

    def fn(x, g, beta):
        return torch.ops.fxfuse.batch_norm_act(x, g, beta, None, None, True, 1e-5, act, 0.1)[0]

    assert torch.autograd.gradcheck(fn, (x, g, beta))


def _opcheck_samples(fmt):
    x = torch.randn(2, 4, 5, 6).to(memory_format=fmt)
    w = torch.randn(6, 4, 3, 3).to(memory_format=fmt)
    g, beta = _bn_params(6, torch.float32)
    rm, rv = _stats(6, torch.float32)
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


@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_generic_kernels_match_reference(act, fmt):
    """The device-generic ATen path (what CUDA and other devices run), exercised on CPU."""
    C = _extension.generic_kernels()
    x = torch.randn(3, 5, 4, 6, dtype=torch.double).to(memory_format=fmt)
    g, beta = _bn_params(5, torch.double)
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_is_correct(dtype):
    x = torch.randn(2, 3, 4, 5).to(dtype).requires_grad_()
    w = torch.randn(4, 3, 3, 3).to(dtype).requires_grad_()
    g, beta = (t.to(dtype).requires_grad_() for t in _bn_params(4, torch.float32))
    out = conv_batch_norm.conv_bn_act(x, w, None, 1, 1, 1, 1, None, None, g, beta, True, 0.1, 1e-5, "relu")
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
        out = conv_batch_norm.conv_bn_act(x, w, None, 1, padding, d, 1, None, None, None, None, True, 0.1, 1e-5)
        ref = reference.conv_bn_act(x, w, None, 1, padding, d, 1, None, None, None, None, True, 0.1, 1e-5, "none")
        torch.testing.assert_close(out, ref)


def _same_error(fn_fused, fn_eager):
    with pytest.raises(Exception) as eager_exc:
        fn_eager()
    with pytest.raises(type(eager_exc.value)):
        fn_fused()


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
            conv_batch_norm.conv_bn_act(x, w, None, running_mean=rm, running_var=rv, training=True, act=act)
        return
    _same_error(
        lambda: conv_batch_norm.conv_bn_act(x, w, None, running_mean=rm, running_var=rv, training=True, act=act),
        lambda: F.relu(F.batch_norm(F.conv2d(x, w), rm.clone(), rv.clone(), training=True)),
    )


def test_nan_and_inf_propagate_like_eager():
    x = torch.randn(2, 3, 6, 6, dtype=torch.double)
    x[0, 0, 0, 0] = float("nan")
    x[1, 1, 2, 2] = float("inf")
    w = torch.randn(4, 3, 3, 3, dtype=torch.double)
    for training in (True, False):
        rm, rv = torch.zeros(4, dtype=torch.double), torch.ones(4, dtype=torch.double)
        out = conv_batch_norm.conv_bn_act(
            x, w, None, 1, 1, 1, 1, rm.clone(), rv.clone(), None, None, training, 0.1, 1e-5, "relu"
        )
        ref = reference.conv_bn_act(
            x, w, None, 1, 1, 1, 1, rm.clone(), rv.clone(), None, None, training, 0.1, 1e-5, "relu"
        )
        torch.testing.assert_close(out, ref, equal_nan=True)


def test_only_the_conv_input_is_saved():
    x = torch.randn(4, 8, 16, 16, requires_grad=True)
    w = torch.randn(16, 8, 3, 3, requires_grad=True)
    g, beta = (t.requires_grad_() for t in _bn_params(16, torch.float32))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        conv_batch_norm.conv_bn_act(x, w, None, 1, 1, 1, 1, None, None, g, beta, True, 0.1, 1e-5, "gelu")
    big = [t for t in saved if t.numel() > 16 * 8 * 9]
    assert len(big) == 1 and big[0].data_ptr() == x.data_ptr()


def test_missing_extension_is_reported_clearly(monkeypatch):
    monkeypatch.setattr(_extension, "_C", None)
    monkeypatch.setattr(_extension, "_load_error", ImportError("libfoo.so: cannot open shared object file"))
    with pytest.raises(fxfuse.FxFuseError, match="failed to load.*libfoo.*Rebuild"):
        fxfuse.optimize(torch.nn.Conv2d(1, 1, 1))
