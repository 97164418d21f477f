"""fxfuse::layer_norm_linear (fxfuse/ops/layer_norm_linear.py): eager's bits, what it keeps, bad input, autocast,
compile."""

import pytest
import torch
import torch.nn.functional as F

from fxfuse import _extension

pytestmark = pytest.mark.skipif(not _extension.loaded(), reason="fxfuse._C is not built")

if _extension.loaded():
    from fxfuse.ops import compiled, layer_norm_linear

    ops = torch.ops.fxfuse


def _inputs(shape, c=6, out=7, dtype=torch.float64, affine=True, bias=True):
    def leaf(*size, scale=1.0):
        return (torch.randn(*size, dtype=dtype) * scale).requires_grad_()

    x = leaf(*shape, c, scale=3.0)
    ln_w, ln_b = (leaf(c), leaf(c)) if affine else (None, None)
    return x, ln_w, ln_b, leaf(out, c), leaf(out) if bias else None


def _eager(x, ln_w, ln_b, w, b, eps=1e-5):
    return F.linear(F.layer_norm(x, (x.shape[-1],), ln_w, ln_b, eps), w, b)


def _grads(out, tensors, grad):
    wanted = [t for t in tensors if t is not None]
    return torch.autograd.grad(out, wanted, grad)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(5,), (3, 4), (2, 3, 4), (2, 0), ()], ids=["2d", "3d", "4d", "empty", "1d"])
@pytest.mark.parametrize("affine,bias", [(True, True), (False, False), (True, False)], ids=["all", "bare", "no-bias"])
def test_matches_eager_bit_for_bit(dtype, shape, affine, bias, one_thread):
    # The same ATen calls in the same order: output and every gradient equal eager's.
    x, ln_w, ln_b, w, b = _inputs(shape, dtype=dtype, affine=affine, bias=bias)
    out = layer_norm_linear(x, (6,), ln_w, ln_b, 1e-5, w, b)
    ref = _eager(x, ln_w, ln_b, w, b)
    assert torch.equal(out, ref) and out.stride() == ref.stride()
    grad = torch.randn_like(ref)
    tensors = (x, ln_w, ln_b, w, b)
    for got, want in zip(_grads(out, tensors, grad), _grads(ref, tensors, grad)):
        assert torch.equal(got, want)


def test_non_contiguous_input(one_thread):
    # ConvNeXt's NCHW block: the layer norm sees a permuted (N, H, W, C) view.
    w, b = torch.randn(5, 6, dtype=torch.float64, requires_grad=True), torch.randn(5, dtype=torch.float64)
    ln_w = torch.randn(6, dtype=torch.float64, requires_grad=True)
    for x in (
        torch.randn(2, 6, 3, 4, dtype=torch.float64).permute(0, 2, 3, 1),
        torch.randn(6, 5, dtype=torch.float64).t(),
    ):
        x.requires_grad_()
        out = layer_norm_linear(x, torch.Size([6]), ln_w, None, 1e-6, w, b)
        ref = F.linear(F.layer_norm(x, (6,), ln_w, None, 1e-6), w, b)
        assert torch.equal(out, ref)
        grad = torch.randn_like(ref)
        for got, want in zip(_grads(out, (x, ln_w, w), grad), _grads(ref, (x, ln_w, w), grad)):
            assert torch.equal(got, want)


def test_only_some_gradients(one_thread):
    # A frozen linear, and an input that needs no gradient: the backward op computes what is asked.
    x, ln_w, ln_b, w, b = _inputs((4,))
    w.requires_grad_(False)
    for wanted in ((x,), (ln_w, ln_b), (b,)):
        out, ref = layer_norm_linear(x, (6,), ln_w, ln_b, 1e-5, w, b), _eager(x, ln_w, ln_b, w, b)
        grad = torch.randn_like(ref)
        for got, want in zip(torch.autograd.grad(out, wanted, grad), torch.autograd.grad(ref, wanted, grad)):
            assert torch.equal(got, want)


def test_gradcheck(one_thread):
    x, ln_w, ln_b, w, b = _inputs((2, 3), c=5, out=4)
    assert torch.autograd.gradcheck(
        lambda *t: layer_norm_linear(t[0], [5], t[1], t[2], 1e-5, t[3], t[4]), (x, ln_w, ln_b, w, b)
    )


def test_opcheck(one_thread):
    x, ln_w, ln_b, w, b = (t.float() if t is not None else None for t in _inputs((2, 3)))
    x, ln_w, w = (t.detach().requires_grad_() for t in (x, ln_w, w))
    torch.library.opcheck(ops.layer_norm_linear.default, (x, [6], ln_w, None, 1e-5, w, None))
    torch.library.opcheck(ops.layer_norm_linear.default, (x.detach(), [6], None, None, 1e-5, w.detach(), None))
    grad = torch.randn(2, 3, 7)
    torch.library.opcheck(
        ops.layer_norm_linear_backward.default,
        (grad, x.detach(), [6], ln_w.detach(), None, 1e-5, w.detach(), None, [True, True, False, True, False]),
    )


def test_keeps_only_its_inputs():
    x, ln_w, ln_b, w, b = _inputs((8,), c=32, out=16, dtype=torch.float32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        layer_norm_linear(x, (32,), ln_w, ln_b, 1e-5, w, b)
    assert sorted(t.data_ptr() for t in saved) == sorted(t.data_ptr() for t in (x, ln_w, ln_b, w, b))
    eager = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: eager.append(t) or t, lambda t: t):
        _eager(x, ln_w, ln_b, w, b)
    wide = {t.untyped_storage().data_ptr() for t in eager if t.shape == x.shape}
    assert len(wide) == 2  # eager keeps x and the layer norm's output


def _same_error(fused, eager):
    with pytest.raises(Exception) as eager_exc:
        eager()
    with pytest.raises(type(eager_exc.value)):
        fused()


@pytest.mark.parametrize(
    "case", ["in_features", "ln_shape", "weight_rank", "bias_shape", "dtype", "int_shape", "scalar_input"]
)
def test_bad_input_raises_what_eager_raises(case):
    x, ln_w, ln_b, w, b = (t.detach() for t in _inputs((3,), dtype=torch.float32))
    shape = (6,)
    if case == "in_features":
        w = torch.randn(7, 5)
    elif case == "ln_shape":
        ln_w = torch.randn(5)
    elif case == "weight_rank":
        w = torch.randn(7, 6, 1)
    elif case == "bias_shape":
        b = torch.randn(3)
    elif case == "dtype":
        w = w.double()
    elif case == "int_shape":
        shape = 6
    else:
        x, shape = torch.tensor(1.0), (1,)
    _same_error(
        lambda: layer_norm_linear(x, shape, ln_w, ln_b, 1e-5, w, b),
        lambda: F.linear(F.layer_norm(x, shape, ln_w, ln_b, 1e-5), w, b),
    )
    if case in ("in_features", "weight_rank", "bias_shape"):  # the op checks shapes itself
        with pytest.raises(RuntimeError, match="fxfuse::layer_norm_linear"):
            ops.layer_norm_linear(x, list(shape), ln_w, ln_b, 1e-5, w, b)
    with pytest.raises(RuntimeError, match="fxfuse::layer_norm_linear"):
        ops.layer_norm_linear(torch.randn(3, 6), [6], None, None, 1e-5, torch.randn(7, 5), None)


def test_layer_norm_over_two_dims_runs_the_composition():
    x, w = torch.randn(2, 3, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    ref = F.linear(F.layer_norm(x, (3, 6)), w)
    assert torch.equal(layer_norm_linear(x, (3, 6), None, None, 1e-5, w), ref)
    with pytest.raises(RuntimeError, match="fxfuse::layer_norm_linear: expected a layer norm over the last"):
        ops.layer_norm_linear(x, [3, 6], None, None, 1e-5, w, None)


@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_autocast_is_eager_autocast(input_dtype):
    # Eager rounds the layer norm output to bfloat16 for the linear; the op makes the same cast
    # (forward and backward), through the wrapper and through the op's Autocast kernel alike.
    x, ln_w, ln_b, w, b = _inputs((4,), c=16, out=8, dtype=torch.float32)
    x = x.detach().to(input_dtype).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _eager(x, ln_w, ln_b, w, b)
        for out in (
            layer_norm_linear(x, (16,), ln_w, ln_b, 1e-5, w, b),
            ops.layer_norm_linear(x, [16], ln_w, ln_b, 1e-5, w, b),
        ):
            assert out.dtype == ref.dtype == torch.bfloat16
            assert torch.equal(out, ref)
    grad = torch.randn_like(ref)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer_norm_linear(x, (16,), ln_w, ln_b, 1e-5, w, b)
    for got, want in zip(_grads(out, (x, ln_w, w), grad), _grads(ref, (x, ln_w, w), grad)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("composed", [False, True], ids=["opaque", "composed"])
def test_under_torch_compile(composed, monkeypatch):
    monkeypatch.setattr(compiled, "enabled", composed)
    torch._dynamo.reset()
    x, ln_w, ln_b, w, b = _inputs((3,))

    def fn(x, ln_w, ln_b, w, b):
        return layer_norm_linear(x, (6,), ln_w, ln_b, 1e-5, w, b)

    out = torch.compile(fn, backend="aot_eager_decomp_partition", fullgraph=True)(x, ln_w, ln_b, w, b)
    ref = _eager(x, ln_w, ln_b, w, b)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(ref)
    tensors = (x, ln_w, ln_b, w, b)
    for got, want in zip(_grads(out, tensors, grad), _grads(ref, tensors, grad)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch._dynamo.reset()
