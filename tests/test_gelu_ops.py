"""fxfuse::gelu(_backward), linear_act(_backward), act_linear(_backward), conv_act(_backward): against eager
PyTorch, opcheck, gradcheck, the saved-tensor contract, bad input.

On CPU tensors torch.ops.fxfuse.gelu / gelu_backward dispatch to the hand-written
kernels (csrc/cpu/gelu_kernel*.cpp); the device-generic implementations are
reachable as torch.ops.fxfuse_generic.gelu / gelu_backward.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import textwrap

import cpu_probe
import pytest
import torch
import torch.nn.functional as F

from fxfuse import _extension
from fxfuse.ops.activations import ACTIVATIONS

pytestmark = pytest.mark.skipif(not _extension.loaded(), reason="fxfuse._C is not built")

if _extension.loaded():
    from fxfuse.ops import gelu_activation, layer_activation
    from fxfuse.ops.checks import apply_activation

    _C = _extension.generic_kernels()
    ops = torch.ops.fxfuse

APPROX = ["none", "tanh"]
DTYPES = [torch.float32, torch.float64]
ACT_PARAMS = {"leaky_relu": 0.2}


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


def _uses_onednn(x, approximate):
    """Whether fxfuse (like ATen for contiguous input) runs oneDNN's GELU on x."""
    return x.dtype == torch.float32 and approximate == "none" and torch.backends.mkldnn.enabled


def _assert_same_layout(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype
    assert a.numel() == 0 or a.stride() == b.stride(), (a.stride(), b.stride())


def _layouts(dtype):
    """Dense layouts the CPU kernels take (contiguous, channels_last, permuted) and
    strided views they leave to ATen; sizes leave vector remainders and span
    several parallel chunks."""
    base = torch.randn(3, 5, 41, 57, dtype=dtype) * 4  # 35055 elements: > 32768, odd
    return {
        "contiguous": base,
        "channels_last": base.contiguous(memory_format=torch.channels_last),
        "permuted": base.permute(2, 0, 3, 1),
        "transposed_2d": torch.randn(301, 7, dtype=dtype).t(),
        "sliced": base[:, :, ::2],
        "expanded": torch.randn(1, 5, 1, 57, dtype=dtype).expand(3, 5, 41, 57),
        "tiny": torch.randn(13, dtype=dtype),
        "scalar": torch.tensor(0.7, dtype=dtype),
    }


def _special_values(dtype):
    fi = torch.finfo(dtype)
    v = [
        0.0,
        -0.0,
        float("inf"),
        -float("inf"),
        float("nan"),
        1e4,
        -1e4,
        1e5,
        -1e5,
        3e7,
        -3e7,
        fi.max,
        -fi.max,
        fi.tiny,
        -fi.tiny,
        fi.tiny / 4,
        1e20,
        -1e20,
        3.7,
        -3.7,
        4.4,
        -4.4,
        5.1,
        -5.1,
        8.0,
        -8.0,
        30.0,
        -30.0,
    ]
    x = torch.tensor(v, dtype=dtype)
    # Long enough for the vector loop, with a scalar remainder; specials land in both.
    return torch.cat([x, torch.randn(53, dtype=dtype) * 6, x])


# ----------------------------------------------------------------------------
# gelu / gelu_backward: accuracy against ATen


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_matches_eager(dtype, approximate):
    for name, x in _layouts(dtype).items():
        out = ops.gelu(x, approximate=approximate)
        ref = F.gelu(x, approximate=approximate)
        torch.testing.assert_close(out, ref, **tol(dtype), msg=lambda m, name=name: f"{name}: {m}")
        _assert_same_layout(out, ref)

        g = torch.randn_like(x)
        for dy in (g, torch.randn(x.shape, dtype=dtype)):  # same strides as x, and contiguous
            got = ops.gelu_backward(dy, x, approximate=approximate)
            want = torch.ops.aten.gelu_backward(dy, x, approximate=approximate)
            torch.testing.assert_close(got, want, **tol(dtype), msg=lambda m, name=name: f"{name}: {m}")
            _assert_same_layout(got, want)


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_special_values(dtype, approximate):
    x = _special_values(dtype)
    # The same values in a dense column-major layout, which ATen runs through its own
    # kernel even where it hands contiguous input to oneDNN (float32, erf form).
    xt = x.view(-1, 1).expand(-1, 2).t().contiguous().t()
    for xi in (x, xt):
        torch.testing.assert_close(
            ops.gelu(xi, approximate=approximate), F.gelu(xi, approximate=approximate), **tol(dtype)
        )
        for dy in (torch.ones_like(xi), torch.randn_like(xi)):
            torch.testing.assert_close(
                ops.gelu_backward(dy, xi, approximate=approximate),
                torch.ops.aten.gelu_backward(dy, xi, approximate=approximate),
                **tol(dtype),
            )
    # Huge and infinite grads scale the derivative's own rounding error in the tails,
    # where oneDNN and ATen's kernel disagree (0 * inf = nan vs -inf): compare with the
    # implementation fxfuse runs for these values (see test_gelu_is_bitwise_atens).
    dyt = x.flip(0).view(-1, 1).expand(-1, 2).t().contiguous().t()
    ref_dy, ref_x = (dyt.contiguous(), xt.contiguous()) if _uses_onednn(xt, approximate) else (dyt, xt)
    torch.testing.assert_close(
        ops.gelu_backward(dyt, xt, approximate=approximate),
        torch.ops.aten.gelu_backward(ref_dy, ref_x, approximate=approximate),
        **tol(dtype),
    )


@pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ("DEFAULT", "AVX2"),
    reason="bitwise agreement holds where fxfuse has the build ATen runs (baseline, AVX2); "
    "ATen's AVX512 kernels split vector and scalar work differently, which "
    "test_gelu_matches_eager holds to ATen's cross-capability spread",
)
@pytest.mark.parametrize("onednn", [True, False], ids=["onednn", "no_onednn"])
@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_is_bitwise_atens(dtype, approximate, onednn, monkeypatch):
    """fxfuse computes exactly what ATen computes for the same values: ATen's own GELU
    kernels, operation by operation (gelu_kernel_impl.h), or oneDNN's GELU for float32
    erf-GELU, which ATen runs on contiguous input only and fxfuse on any dense layout."""
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", onednn)
    for shape in [(13,), (40000,), (3, 5, 41, 57)]:
        x = torch.randn(shape, dtype=dtype) * 5
        for xi in (x, x.contiguous(memory_format=torch.channels_last)) if x.dim() == 4 else (x,):
            dy = torch.randn_like(xi)
            ref_x, ref_dy = (xi.contiguous(), dy.contiguous()) if _uses_onednn(xi, approximate) else (xi, dy)
            assert torch.equal(ops.gelu(xi, approximate=approximate), F.gelu(ref_x, approximate=approximate))
            assert torch.equal(
                ops.gelu_backward(dy, xi, approximate=approximate),
                torch.ops.aten.gelu_backward(ref_dy, ref_x, approximate=approximate),
            )


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_autograd_matches_eager(dtype, approximate):
    x = (torch.randn(4, 6, 9, 7, dtype=dtype) * 3).contiguous(memory_format=torch.channels_last)
    xr, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = gelu_activation.gelu(xr, approximate)
    ref = F.gelu(xe, approximate=approximate)
    torch.testing.assert_close(out, ref, **tol(dtype))
    grad = torch.randn_like(ref)
    torch.testing.assert_close(
        torch.autograd.grad(out, xr, grad, retain_graph=True)[0],
        torch.autograd.grad(ref, xe, grad, retain_graph=True)[0],
        **tol(dtype),
    )
    # A broadcast grad (sum().backward()) takes the ATen path.
    out.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(xr.grad, xe.grad, **tol(dtype))


def test_gelu_backward_mixed_layouts_and_broadcasting():
    x = torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)
    for dy in (
        torch.randn(2, 3, 4, 5),
        torch.randn(1, 3, 1, 5),
        torch.randn(2, 3, 4, 5, dtype=torch.double),
        torch.randn(2, 3, 4, 5, dtype=torch.bfloat16),
    ):
        got = ops.gelu_backward(dy, x)
        want = torch.ops.aten.gelu_backward(dy, x)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        _assert_same_layout(got, want)


@pytest.mark.parametrize(
    "shape,fmt",
    [
        ((0,), torch.contiguous_format),
        ((0, 3), torch.contiguous_format),
        ((2, 0, 4, 4), torch.channels_last),
        ((2, 3, 0, 4), torch.channels_last),
    ],
)
def test_gelu_empty(shape, fmt):
    x = torch.empty(shape).contiguous(memory_format=fmt)
    for approximate in APPROX:
        out = ops.gelu(x, approximate=approximate)
        _assert_same_layout(out, F.gelu(x, approximate=approximate))
        got = ops.gelu_backward(torch.empty_like(x), x, approximate=approximate)
        _assert_same_layout(got, torch.ops.aten.gelu_backward(torch.empty_like(x), x, approximate=approximate))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("approximate", APPROX)
def test_gelu_reduced_precision(dtype, approximate):
    """half / bfloat16 take the generic path (ATen's kernel, float op-math): same values as eager."""
    x = (torch.randn(2, 8, 5, 5) * 3).to(dtype).contiguous(memory_format=torch.channels_last)
    dy = torch.randn_like(x)
    out = ops.gelu(x, approximate=approximate)
    assert out.dtype == dtype
    assert torch.equal(out, F.gelu(x, approximate=approximate))
    assert torch.equal(
        ops.gelu_backward(dy, x, approximate=approximate), torch.ops.aten.gelu_backward(dy, x, approximate=approximate)
    )
    torch.testing.assert_close(out.float(), F.gelu(x.float(), approximate=approximate), rtol=0.02, atol=0.02)


@pytest.mark.parametrize("approximate", APPROX)
def test_generic_gelu_matches_eager(approximate):
    """The device-generic implementation (what CUDA and other devices run), on CPU."""
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        x = (torch.randn(3, 4, 5, 6) * 3).to(dtype).contiguous(memory_format=torch.channels_last)
        dy = torch.randn_like(x)
        out = _C.gelu(x, approximate=approximate)
        assert torch.equal(out, F.gelu(x, approximate=approximate))
        assert out.stride() == x.stride()
        assert torch.equal(
            _C.gelu_backward(dy, x, approximate=approximate),
            torch.ops.aten.gelu_backward(dy, x, approximate=approximate),
        )
    with pytest.raises(RuntimeError, match="approximate argument must be either none or tanh"):
        _C.gelu(x, approximate="erf")


_DEFAULT_CAPABILITY_SCRIPT = textwrap.dedent(
    """
    import torch, torch.nn.functional as F
    import fxfuse.ops
    assert torch.backends.cpu.get_cpu_capability() == "DEFAULT"
    ops = torch.ops.fxfuse
    torch.backends.mkldnn.enabled = False  # float32 erf-GELU would run oneDNN's kernel
    for dtype in (torch.float32, torch.float64):
        x = (torch.randn(3, 5, 41, 57, dtype=dtype) * 4).contiguous(memory_format=torch.channels_last)
        dy = torch.randn_like(x)
        for ap in ("none", "tanh"):
            # ATen's DEFAULT kernels: the same formulas without FMA, libm in the scalar tails.
            assert torch.equal(ops.gelu(x, approximate=ap), F.gelu(x, approximate=ap)), (dtype, ap)
            assert torch.equal(ops.gelu_backward(dy, x, approximate=ap),
                               torch.ops.aten.gelu_backward(dy, x, approximate=ap)), (dtype, ap)
    print("OK")
    """
)


def test_gelu_default_capability_build():
    """ATEN_CPU_CAPABILITY=default selects the baseline (non-AVX2) build of the kernels."""
    cpu_probe.skip_unless_runs("default")
    env = cpu_probe.env_for("default")
    res = subprocess.run(
        [sys.executable, "-c", _DEFAULT_CAPABILITY_SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr[-4000:]


# ----------------------------------------------------------------------------
# linear_act / conv_act against eager


def _linear_inputs(shape, in_f, out_f, dtype, bias=True):
    x = torch.randn(*shape, in_f, dtype=dtype, requires_grad=True)
    w = (torch.randn(out_f, in_f, dtype=dtype) / in_f**0.5).requires_grad_()
    b = torch.randn(out_f, dtype=dtype, requires_grad=True) if bias else None
    return x, w, b


# op -> (fused wrapper, the eager composition it computes, input scale: for act_linear the
# activation's input is x itself, scaled to cover both sides of every activation's kinks)
LINEAR_FAMILY = {
    "linear_act": (
        lambda x, w, b, act, p: layer_activation.linear_act(x, w, b, act, p),
        lambda x, w, b, act, p: apply_activation(F.linear(x, w, b), act, p),
        1,
    ),
    "act_linear": (
        lambda x, w, b, act, p: layer_activation.act_linear(x, w, b, act, p),
        lambda x, w, b, act, p: F.linear(apply_activation(x, act, p), w, b),
        3,
    ),
}


@pytest.mark.parametrize("op", LINEAR_FAMILY)
@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("shape", [(), (5,), (3, 4), (2, 0)], ids=["1d", "2d", "3d", "empty"])
def test_linear_family_matches_eager(op, act, shape):
    fused, eager, scale = LINEAR_FAMILY[op]
    p = ACT_PARAMS.get(act, 0.0)
    for dtype, bias in ((torch.float64, True), (torch.float32, False)):
        x, w, b = _linear_inputs(shape, 6, 7, dtype, bias)
        x = (x.detach() * scale).requires_grad_()
        params = [t for t in (x, w, b) if t is not None]
        out = fused(x, w, b, act, p)
        ref = eager(x, w, b, act, p)
        assert torch.equal(out, ref)  # the same ATen ops, in the same order
        _assert_same_layout(out, ref)
        grad = torch.randn_like(ref)
        for a, e in zip(torch.autograd.grad(out, params, grad), torch.autograd.grad(ref, params, grad)):
            torch.testing.assert_close(a, e, **tol(dtype))


def test_act_linear_non_contiguous_input():
    # A transposed activation input (the matmul path of F.linear) and a permuted 4-D one.
    w, b = torch.randn(7, 6, dtype=torch.float64, requires_grad=True), torch.randn(7, dtype=torch.float64)
    for x in (
        torch.randn(6, 5, dtype=torch.float64).t(),
        torch.randn(2, 6, 3, 4, dtype=torch.float64).permute(0, 2, 3, 1),
    ):
        x.requires_grad_()
        out, ref = layer_activation.act_linear(x, w, b, "gelu"), F.linear(F.gelu(x), w, b)
        assert torch.equal(out, ref)
        grad = torch.randn_like(ref)
        for a, e in zip(torch.autograd.grad(out, (x, w), grad), torch.autograd.grad(ref, (x, w), grad)):
            torch.testing.assert_close(a, e, **tol(torch.float64))


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
        out = layer_activation.conv_act(x, w, b, act=act, act_param=p, **kw)
        ref = apply_activation(F.conv2d(x, w, b, **kw), act, p)
        assert torch.equal(out, ref), kw
        _assert_same_layout(out, ref)
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
    out = layer_activation.conv_act(x, w, None, padding="same", dilation=dilation, act="gelu")
    ref = F.gelu(F.conv2d(x, w, None, padding="same", dilation=dilation))
    assert torch.equal(out, ref)
    grad = torch.randn_like(ref)
    for a, e in zip(torch.autograd.grad(out, (x, w), grad), torch.autograd.grad(ref, (x, w), grad)):
        torch.testing.assert_close(a, e, **tol(torch.double))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_layer_act_reduced_precision(dtype):
    x = torch.randn(2, 3, 8).to(dtype)
    w = torch.randn(5, 8).to(dtype)
    assert torch.equal(layer_activation.linear_act(x, w, None, "gelu"), F.gelu(F.linear(x, w)))
    assert torch.equal(layer_activation.act_linear(x, w, None, "silu"), F.linear(F.silu(x), w))
    xc, wc = torch.randn(2, 3, 6, 6).to(dtype), torch.randn(4, 3, 3, 3).to(dtype)
    assert torch.equal(
        layer_activation.conv_act(xc, wc, None, padding=1, act="silu"), F.silu(F.conv2d(xc, wc, None, 1, 1))
    )


def test_autocast_matches_eager_autocast():
    # Fused under autocast (its Autocast kernel casts like F.linear's): same ops, same bits.
    x, w = torch.randn(4, 16), torch.randn(8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer_activation.linear_act(x, w, None, "gelu")
        ref = F.gelu(F.linear(x, w))
    assert out.dtype == ref.dtype == torch.bfloat16
    assert torch.equal(out, ref)


@pytest.mark.parametrize("input_dtype", [torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_act_linear_autocast_matches_eager_autocast(input_dtype):
    # Eager autocast runs the activation in the input's dtype, then casts for linear. A bfloat16
    # input (a linear's output under autocast) or a float64 one takes the fused op; a float32 one
    # would be rounded before the activation, so it takes the eager composition.
    x = torch.randn(4, 16).to(input_dtype).requires_grad_()
    w = torch.randn(8, 16, dtype=torch.float64 if input_dtype == torch.float64 else torch.float32)
    w.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer_activation.act_linear(x, w, None, "gelu")
        ref = F.linear(F.gelu(x), w)
    assert out.dtype == ref.dtype
    assert torch.equal(out, ref)
    grad = torch.randn_like(ref)
    for a, e in zip(torch.autograd.grad(out, (x, w), grad), torch.autograd.grad(ref, (x, w), grad)):
        assert a.dtype == e.dtype
        torch.testing.assert_close(a, e, rtol=2e-2, atol=2e-2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, saved = _saved_tensors(lambda: layer_activation.act_linear(x, w, None, "gelu"))
    wide = {t.untyped_storage().data_ptr() for t in saved if t.numel() == x.numel()}
    assert wide == {x.untyped_storage().data_ptr()} if input_dtype != torch.float32 else len(wide) == 2


# ----------------------------------------------------------------------------
# gradcheck (float64)


@pytest.mark.parametrize("approximate", APPROX)
def test_gelu_gradcheck(approximate, one_thread):
    x = (torch.randn(3, 4, 5, dtype=torch.double) * 3).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: ops.gelu(t, approximate=approximate), (x,))
    xcl = (torch.randn(2, 3, 4, 5, dtype=torch.double) * 3).contiguous(memory_format=torch.channels_last)
    assert torch.autograd.gradcheck(lambda t: ops.gelu(t, approximate=approximate), (xcl.requires_grad_(),))


@pytest.mark.parametrize("op", LINEAR_FAMILY)
@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "silu", "leaky_relu", "none"])
def test_linear_family_gradcheck(op, act, one_thread):
    fn = getattr(ops, op)
    x, w, b = _linear_inputs((2, 3), 5, 4, torch.double)
    assert torch.autograd.gradcheck(lambda x, w, b: fn(x, w, b, act, 0.1), (x, w, b))
    x1, w1, _ = _linear_inputs((), 5, 4, torch.double)
    assert torch.autograd.gradcheck(lambda x, w: fn(x, w, None, act, 0.1), (x1, w1))


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "hardswish"])
def test_conv_act_gradcheck(act, one_thread):
    x = torch.randn(2, 4, 3, 4, dtype=torch.double, requires_grad=True)
    w = torch.randn(4, 2, 2, 2, dtype=torch.double, requires_grad=True)
    b = torch.randn(4, dtype=torch.double, requires_grad=True)

    def fn(x, w, b):
        return ops.conv_act(x, w, b, [2, 1], [1, 0], [1, 2], 2, act, 0.0)

    assert torch.autograd.gradcheck(fn, (x, w, b))


# ----------------------------------------------------------------------------
# opcheck: schema, fake kernels (shapes and strides), autograd registration


def _opcheck_samples(fmt):
    """Every op on contiguous inputs; the ops whose output layout follows a 4-D
    input's memory format again on channels_last inputs."""
    req = lambda *ts: tuple(t.clone().requires_grad_() for t in ts)  # noqa: E731
    x4 = torch.randn(2, 4, 5, 6).to(memory_format=fmt)
    w4 = torch.randn(6, 4, 3, 3).to(memory_format=fmt)
    wg = torch.randn(6, 2, 3, 3).to(memory_format=fmt)
    b6 = torch.randn(6)
    x3, w2, b7 = torch.randn(2, 3, 5), torch.randn(7, 5), torch.randn(7)
    layout_sensitive = [
        (ops.gelu.default, req(x4), {}),
        (ops.gelu_backward.default, (torch.randn_like(x4), x4), {"approximate": "tanh"}),
        (ops.linear_act.default, (*req(x4, torch.randn(3, 6)), None, "leaky_relu", 0.1), {}),
        (
            ops.linear_act_backward.default,
            (torch.randn(2, 4, 5, 3), x4, torch.randn(3, 6), torch.randn(3), "gelu", 0.0, [True, True, True]),
            {},
        ),
        (ops.act_linear.default, (*req(x4, torch.randn(3, 6)), torch.randn(3), "gelu", 0.0), {}),
        (
            ops.act_linear_backward.default,
            (torch.randn(2, 4, 5, 3), x4, torch.randn(3, 6), None, "silu", 0.0, [True, True, False]),
            {},
        ),
        (ops.conv_act.default, (*req(x4, wg), None, [2, 2], [0, 1], [1, 1], 2, "gelu", 0.0), {}),
        (
            ops.conv_act_backward.default,
            (
                torch.randn(2, 6, 5, 6).to(memory_format=fmt),
                x4,
                w4,
                b6,
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
        return layout_sensitive
    return layout_sensitive + [
        (ops.gelu.default, req(x3), {"approximate": "tanh"}),
        (ops.gelu.default, (x4.to(torch.bfloat16),), {}),
        # A broadcast grad takes the ATen path. (Not with approximate="none": ATen hands
        # contiguous float32 to oneDNN, which rejects the broadcast.)
        (ops.gelu_backward.default, (torch.randn(2, 1, 5), x3), {"approximate": "tanh"}),
        (ops.linear_act.default, (*req(x3, w2, b7), "gelu", 0.0), {}),
        (ops.act_linear.default, (*req(x3, w2, b7), "gelu_tanh", 0.0), {}),
        (ops.act_linear_backward.default, (torch.randn(2, 3, 7), x3, w2, b7, "hardswish", 0.0, [True, True, True]), {}),
        (ops.linear_act_backward.default, (torch.randn(2, 3, 7), x3, w2, b7, "gelu_tanh", 0.0, [True, True, True]), {}),
        (
            ops.linear_act_backward.default,
            (torch.randn(7).expand(2, 3, 7), x3, w2, None, "silu", 0.0, [True, False, True]),
            {},
        ),
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
    """The fake kernels promise the real kernels' layout, channels_last included."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.randn(2, 4, 5, 6).to(memory_format=torch.channels_last)
    w = torch.randn(6, 4, 3, 3)
    cases = [
        lambda x, w: ops.gelu(x),
        lambda x, w: ops.gelu(x.permute(0, 2, 3, 1)),
        lambda x, w: ops.gelu_backward(x.contiguous(), x),
        lambda x, w: ops.conv_act(x, w, None, [1, 1], [1, 1], [1, 1], 1, "gelu", 0.0),
        lambda x, w: ops.linear_act(x, w[:, :, 0, 0].t().contiguous(), None, "silu", 0.0),
    ]
    for fn in cases:
        real = fn(x, w)
        with FakeTensorMode() as mode:
            fake = fn(mode.from_tensor(x), mode.from_tensor(w))
        assert fake.shape == real.shape and fake.stride() == real.stride()


# ----------------------------------------------------------------------------
# Memory: only the layer's input and parameters are kept for backward


def _saved_tensors(fn):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn()
    return out, saved


def test_linear_act_saves_only_its_inputs():
    x, w, b = _linear_inputs((8, 16), 32, 128, torch.float32)
    out, saved = _saved_tensors(lambda: layer_activation.linear_act(x, w, b, "gelu"))
    assert sorted(t.data_ptr() for t in saved) == sorted(t.data_ptr() for t in (x, w, b))
    assert not any(t.shape == out.shape for t in saved)  # the wide pre-activation is recomputed
    _, eager_saved = _saved_tensors(lambda: F.gelu(F.linear(x, w, b)))
    assert any(t.shape == out.shape for t in eager_saved)  # ... where eager keeps it


def test_act_linear_saves_only_its_inputs():
    x, w, b = _linear_inputs((8, 16), 128, 32, torch.float32)
    _, saved = _saved_tensors(lambda: layer_activation.act_linear(x, w, b, "gelu"))
    assert sorted(t.data_ptr() for t in saved) == sorted(t.data_ptr() for t in (x, w, b))
    _, eager_saved = _saved_tensors(lambda: F.linear(F.gelu(x), w, b))
    assert len({t.untyped_storage().data_ptr() for t in eager_saved if t.numel() == x.numel()}) == 2  # x, gelu(x)


def test_conv_act_saves_only_its_inputs():
    x = torch.randn(2, 8, 16, 16, requires_grad=True)
    w = torch.randn(32, 8, 3, 3, requires_grad=True)
    out, saved = _saved_tensors(lambda: layer_activation.conv_act(x, w, None, padding=1, act="silu"))
    assert sorted(t.data_ptr() for t in saved) == sorted(t.data_ptr() for t in (x, w))
    assert not any(t.shape == out.shape for t in saved)


def test_gelu_saves_only_its_input():
    x = torch.randn(4, 64, requires_grad=True)
    _, saved = _saved_tensors(lambda: gelu_activation.gelu(x))
    assert [t.data_ptr() for t in saved] == [x.data_ptr()]


# ----------------------------------------------------------------------------
# Bad input: the exception eager raises


def _same_error(fn_fused, fn_eager):
    with pytest.raises(Exception) as eager_exc:
        fn_eager()
    with pytest.raises(type(eager_exc.value)):
        fn_fused()


def test_gelu_bad_approximate():
    x = torch.randn(3, 4)
    _same_error(lambda: gelu_activation.gelu(x, "erf"), lambda: F.gelu(x, approximate="erf"))
    _same_error(lambda: ops.gelu(x, approximate="erf"), lambda: F.gelu(x, approximate="erf"))
    _same_error(
        lambda: ops.gelu_backward(x, x, approximate="Tanh"),
        lambda: torch.ops.aten.gelu_backward(x, x, approximate="Tanh"),
    )
    with pytest.raises(RuntimeError, match="approximate argument must be either none or tanh"):
        ops.gelu(x, approximate="erf")


def test_gelu_bad_dtype():
    x = torch.arange(6)
    _same_error(lambda: gelu_activation.gelu(x), lambda: F.gelu(x))
    _same_error(lambda: ops.gelu(x), lambda: F.gelu(x))


def _bad_linear_args(case):
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


BAD_LINEAR_CASES = ["in_features", "weight_rank", "bias_shape", "dtype", "scalar_input"]


@pytest.mark.parametrize("case", BAD_LINEAR_CASES)
def test_linear_act_bad_input(case):
    x, w, b = _bad_linear_args(case)
    _same_error(lambda: layer_activation.linear_act(x, w, b, "gelu"), lambda: F.gelu(F.linear(x, w, b)))
    if case != "dtype":  # the op itself checks shapes (ATen checks dtypes)
        with pytest.raises(RuntimeError, match="fxfuse::linear_act"):
            ops.linear_act(x, w, b, "gelu", 0.0)


@pytest.mark.parametrize("case", BAD_LINEAR_CASES)
def test_act_linear_bad_input(case):
    x, w, b = _bad_linear_args(case)
    _same_error(lambda: layer_activation.act_linear(x, w, b, "gelu"), lambda: F.linear(F.gelu(x), w, b))
    if case != "dtype":  # the op itself checks shapes (ATen checks dtypes)
        with pytest.raises(RuntimeError, match="fxfuse::act_linear"):
            ops.act_linear(x, w, b, "gelu", 0.0)


def test_act_linear_bad_activation():
    with pytest.raises(ValueError, match="swish"):
        layer_activation.act_linear(torch.randn(3, 5), torch.randn(4, 5), None, "swish")


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
    _same_error(
        lambda: layer_activation.conv_act(x, w, None, act="relu", **kw), lambda: F.relu(F.conv2d(x, w, None, **kw))
    )


def test_unknown_activation():
    x, w = torch.randn(3, 5), torch.randn(4, 5)
    with pytest.raises(ValueError, match="unknown activation"):
        layer_activation.linear_act(x, w, None, "swish")
    with pytest.raises(ValueError, match="unknown activation"):
        ops.linear_act(x, w, None, "swish", 0.0)
    with pytest.raises(ValueError, match="unknown activation"):
        ops.conv_act(torch.randn(1, 5, 4, 4), w[:, :, None, None], None, [1, 1], [0, 0], [1, 1], 1, "swish", 0.0)
