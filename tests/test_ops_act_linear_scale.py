"""fxfuse::act_linear_scale (fxfuse/ops/act_linear_scale.py): F.linear(act(x), W, b) * scale that keeps
only its inputs; the scale's gradient comes from the weight gradient's product."""

import pytest
import torch
import torch.nn.functional as F

from fxfuse import _extension

pytestmark = pytest.mark.skipif(not _extension.loaded(), reason="fxfuse._C is not built")

if _extension.loaded():
    from fxfuse.ops import act_linear_scale
    from fxfuse.ops.checks import apply_activation

    ops = torch.ops.fxfuse


def _inputs(shape, dtype=torch.float64, bias=True, in_f=6, out_f=5):
    def leaf(*size):
        return torch.randn(*size, dtype=dtype).requires_grad_()

    return leaf(*shape, in_f), leaf(out_f, in_f), leaf(out_f) if bias else None, leaf(out_f)


def _eager(x, w, b, s, act="none", p=0.0):
    return F.linear(apply_activation(x, act, p), w, b) * s


def _grads(out, tensors, grad):
    return torch.autograd.grad(out, [t for t in tensors if t is not None], grad)


@pytest.mark.parametrize("act", ["none", "gelu", "silu", "leaky_relu"])
@pytest.mark.parametrize("shape", [(), (4,), (2, 3, 4), (0,)], ids=["1d", "2d", "4d", "empty"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_matches_eager(act, shape, bias, one_thread):
    for dtype, rtol in ((torch.float64, 1e-12), (torch.float32, 2e-6)):
        x, w, b, s = _inputs(shape, dtype, bias)
        out, ref = act_linear_scale(x, w, b, s, act, 0.2), _eager(x, w, b, s, act, 0.2)
        assert torch.equal(out, ref) and out.stride() == ref.stride()  # eager's ops, eager's order
        grad = torch.randn_like(ref)
        got, want = _grads(out, (x, w, b, s), grad), _grads(ref, (x, w, b, s), grad)
        assert torch.equal(got[0], want[0])  # the input's gradient: eager's matmul of grad * scale
        for g, e in zip(got[1:], want[1:]):  # scaled after the product instead of before: rounding
            torch.testing.assert_close(g, e, rtol=rtol, atol=rtol * (1 + e.abs().max().item() if e.numel() else 1))


def test_only_some_gradients(one_thread):
    x, w, b, s = _inputs((3,))
    for wanted in ((x,), (s,), (w,), (b,), (w, s)):
        out, ref = act_linear_scale(x, w, b, s, "gelu"), _eager(x, w, b, s, "gelu")
        grad = torch.randn_like(ref)
        for g, e in zip(torch.autograd.grad(out, wanted, grad), torch.autograd.grad(ref, wanted, grad)):
            torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)


def test_gradcheck(one_thread):
    x, w, b, s = _inputs((2, 3))
    assert torch.autograd.gradcheck(lambda *t: act_linear_scale(*t, "gelu"), (x, w, b, s))
    assert torch.autograd.gradcheck(lambda x, w, s: act_linear_scale(x, w, None, s), (x, w, s))


def test_opcheck(one_thread):
    x, w, b, s = (t.float().detach().requires_grad_() for t in _inputs((2, 3)))
    torch.library.opcheck(ops.act_linear_scale.default, (x, w, b, s, "gelu", 0.0))
    torch.library.opcheck(ops.act_linear_scale.default, (x.detach(), w.detach(), None, s.detach(), "none", 0.0))
    grad = torch.randn(2, 3, 5)
    args = (grad, x.detach(), w.detach(), b.detach(), s.detach(), "silu", 0.0, [True, False, True, True])
    torch.library.opcheck(ops.act_linear_scale_backward.default, args)


def test_keeps_only_its_inputs():
    x, w, b, s = _inputs((16,), torch.float32, in_f=32, out_f=64)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = act_linear_scale(x, w, b, s, "gelu")
    assert sorted(t.data_ptr() for t in saved) == sorted(t.data_ptr() for t in (x, w, b, s))
    eager = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: eager.append(t) or t, lambda t: t):
        _eager(x, w, b, s, "gelu")
    assert any(t.shape == out.shape for t in eager)  # eager's multiply keeps the linear's output


@pytest.mark.parametrize("case", ["scale_size", "scale_rank", "in_features", "scale_dtype", "broadcast_scalar"])
def test_other_scales_and_bad_input_get_eagers_result_or_error(case):
    x, w, b, s = (t.detach().float() for t in _inputs((3,)))
    if case == "scale_size":
        s = torch.randn(3)
    elif case == "scale_rank":
        s = torch.randn(3, 5)  # broadcasts over the rows: eager's composition
    elif case == "in_features":
        w = torch.randn(5, 4)
    elif case == "scale_dtype":
        s = s.double()  # type promotion: a float64 result, as eager's
    else:
        s = torch.randn(1)
    try:
        ref = _eager(x, w, b, s)
    except Exception as exc:  # noqa: BLE001 - the same exception type, whatever eager raises
        with pytest.raises(type(exc)):
            act_linear_scale(x, w, b, s)
        return
    out = act_linear_scale(x, w, b, s)
    assert out.dtype == ref.dtype and torch.equal(out, ref)


def test_op_checks_its_scale():
    x, w, b, _ = (t.detach().float() for t in _inputs((3,)))
    with pytest.raises(RuntimeError, match="fxfuse::act_linear_scale: expected a scale of shape \\[5\\]"):
        ops.act_linear_scale(x, w, b, torch.randn(4), "none", 0.0)


def test_autocast_is_eager_autocast():
    x, w, b, s = _inputs((4,), torch.float32, in_f=16, out_f=8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _eager(x, w, b, s, "gelu")
        outs = [act_linear_scale(x, w, b, s, "gelu"), ops.act_linear_scale(x, w, b, s, "gelu", 0.0)]
    for out in outs:
        assert out.dtype == ref.dtype == torch.float32  # bfloat16 linear output × float32 scale
        assert torch.equal(out, ref)


@pytest.mark.parametrize("composed", [False, True], ids=["opaque", "composed"])
def test_under_torch_compile(composed, monkeypatch):
    from fxfuse.ops import compiled

    monkeypatch.setattr(compiled, "enabled", composed)
    torch._dynamo.reset()
    x, w, b, s = _inputs((3,))

    def fn(x, w, b, s):
        return act_linear_scale(x, w, b, s, "gelu")

    out = torch.compile(fn, backend="aot_eager_decomp_partition", fullgraph=True)(x, w, b, s)
    ref = _eager(x, w, b, s, "gelu")
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(ref)
    for got, want in zip(_grads(out, (x, w, b, s), grad), _grads(ref, (x, w, b, s), grad)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch._dynamo.reset()
