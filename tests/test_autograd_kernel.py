"""fxfuse/ops/autograd_kernel.py: the Autograd kernel torch.library.register_autograd would register,
without filling the schema's defaults through torch._library.utils.fill_defaults on every call."""

import pytest
import torch
from torch._library import utils as library_utils

import fxfuse  # noqa: F401  (registers fxfuse's ops)
from fxfuse import _extension, ops
from fxfuse.ops.autograd_kernel import register_autograd

_LIB = torch.library.Library("fxfuse_autograd_kernel_test", "DEF")
_LIB.define("scale(Tensor x, Tensor[] others, float factor=2.0, *, float shift=0.0) -> Tensor")
_LIB.define("broken(Tensor x) -> Tensor")
_LIB.define("with_stats(Tensor x, Tensor[] others) -> (Tensor, Tensor)")
_SEEN = []


def _scale(x, others, factor=2.0, *, shift=0.0):
    return x * factor + sum(others) + shift


def _scale_setup(ctx, inputs, keyword_only_inputs, output):
    _SEEN.append((inputs, keyword_only_inputs))
    ctx.factor = inputs[2]


def _scale_backward(ctx, grad):
    return grad * ctx.factor, [grad] * len(ctx.needs_input_grad[1]), None


_LIB.impl("scale", _scale, "CompositeExplicitAutograd")
_LIB.impl("with_stats", lambda x, others: (x * 3 + sum(others), x.sum()), "CompositeExplicitAutograd")
_GRADS = []


def _with_stats_backward(ctx, grad, grad_stat):
    _GRADS.append(grad_stat)
    return grad * 3, [grad] * len(ctx.needs_input_grad[1])


_LIB.impl("broken", lambda x: x.clone(), "CompositeExplicitAutograd")
register_autograd("fxfuse_autograd_kernel_test::scale", _scale_backward, _scale_setup, lib=_LIB)
register_autograd(
    "fxfuse_autograd_kernel_test::with_stats", _with_stats_backward, lambda ctx, inputs, output: None, lib=_LIB
)
register_autograd("fxfuse_autograd_kernel_test::broken", lambda ctx, g: (g, g), lambda ctx, inputs, output: None)
_ops = torch.ops.fxfuse_autograd_kernel_test


def test_setup_context_gets_the_defaults_the_dispatcher_dropped_and_gradients_reach_every_piece():
    x, a, b = (torch.randn(3, dtype=torch.float64, requires_grad=True) for _ in range(3))
    _SEEN.clear()
    out = _ops.scale(x, [a, b])
    ((inputs, keyword_only),) = _SEEN
    assert inputs[2] == 2.0 and keyword_only == {"shift": 0.0}
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))
    torch.testing.assert_close(a.grad, torch.ones_like(a))
    torch.testing.assert_close(b.grad, torch.ones_like(b))
    assert torch.autograd.gradcheck(lambda x, a: _ops.scale(x, [a], 3.0, shift=1.0), (x.detach().requires_grad_(), a))


def test_without_grad_no_graph_and_no_setup():
    x = torch.randn(3, requires_grad=True)
    _SEEN.clear()
    with torch.no_grad():
        out = _ops.scale(x, [x])
    assert out.grad_fn is None and not _SEEN
    assert _ops.scale(torch.randn(3), [torch.randn(3)]).grad_fn is None


def test_a_backward_with_the_wrong_number_of_gradients_raises():
    out = _ops.broken(torch.randn(3, requires_grad=True))
    with pytest.raises(RuntimeError, match="incorrect number of gradients"):
        out.sum().backward()


@pytest.mark.skipif(not _extension.loaded(), reason="fxfuse._C is not built")
def test_fxfuse_ops_train_without_filling_defaults_per_call(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("fill_defaults called")

    monkeypatch.setattr(library_utils, "fill_defaults", refuse)
    f64 = {"dtype": torch.float64}
    x = torch.randn(2, 4, 6, 6, **f64, requires_grad=True)
    pieces = [x[:, :2].detach().requires_grad_(), x[:, 2:].detach().requires_grad_()]
    w = torch.randn(4, 4, 3, 3, **f64, requires_grad=True)
    g, b = torch.ones(4, **f64, requires_grad=True), torch.zeros(4, **f64, requires_grad=True)
    bn = (torch.zeros(4, **f64), torch.ones(4, **f64), g, b, True, 0.1, 1e-5, "relu", 0.0)
    out = ops.bn_act_conv(x, *bn, w, None, 1, 1)
    out = out + ops.bn_act_conv(torch.cat(pieces, 1), *bn, w, pieces=pieces)[:, :, 1:-1, 1:-1].sum()
    out = ops.gelu(out, approximate="tanh")
    out.sum().backward()
    assert all(t.grad is not None for t in (x, *pieces, w, g, b))


_LIB.define("between(Tensor x, Tensor[] first, float factor, Tensor[] second) -> Tensor")
_LIB.define("optional_list(Tensor x, Tensor?[] others) -> Tensor")
_LIB.define("short_list(Tensor[] pieces) -> Tensor")


def _between(x, first, factor, second):
    return x * factor + sum(first) * 2 + sum(second) * 3


def _between_setup(ctx, inputs, output):
    ctx.factor = inputs[2]
    ctx.grouped = tuple(map(type, inputs))


def _between_backward(ctx, grad):
    needs = ctx.needs_input_grad
    assert isinstance(needs[1], list) and isinstance(needs[3], list), needs
    first = [grad * 2 if need else None for need in needs[1]]
    return grad * ctx.factor, first, None, None if not any(needs[3]) else [grad * 3] * len(needs[3])


def _optional_list_setup(ctx, inputs, output):
    ctx.count = len(inputs[1])


_LIB.impl("between", _between, "CompositeExplicitAutograd")
_LIB.impl("optional_list", lambda x, others: x + sum(o for o in others if o is not None), "CompositeExplicitAutograd")
_LIB.impl("short_list", lambda pieces: torch.cat(pieces), "CompositeExplicitAutograd")
register_autograd("fxfuse_autograd_kernel_test::between", _between_backward, _between_setup, lib=_LIB)
register_autograd(
    "fxfuse_autograd_kernel_test::optional_list",
    lambda ctx, grad: (grad, [grad] * ctx.count),
    _optional_list_setup,
    lib=_LIB,
)
register_autograd(
    "fxfuse_autograd_kernel_test::short_list", lambda ctx, grad: [grad], lambda ctx, inputs, output: None, lib=_LIB
)


def test_tensor_lists_are_spliced_by_position_without_pytree(monkeypatch):
    from torch._library import autograd as library_autograd

    def refuse(*args, **kwargs):
        raise AssertionError("pytree used")

    monkeypatch.setattr(library_autograd._pytree, "tree_flatten", refuse)
    monkeypatch.setattr(library_autograd._pytree, "tree_unflatten", refuse)
    f64 = {"dtype": torch.float64, "requires_grad": True}
    x, a, b, c = (torch.randn(3, **f64) for _ in range(4))
    d = torch.randn(3, dtype=torch.float64)
    out = _ops.between(x, [a, d, b], 5.0, [c])
    out.sum().backward()
    for tensor, expected in ((x, 5.0), (a, 2.0), (b, 2.0), (c, 3.0)):
        torch.testing.assert_close(tensor.grad, torch.full_like(tensor, expected))
    assert d.grad is None
    # A list none of whose pieces needs a gradient: the backward may return None for it.
    e = torch.randn(3, dtype=torch.float64)
    _ops.between(x, [a], 1.0, [e, e]).sum().backward()
    assert e.grad is None
    assert torch.autograd.gradcheck(
        lambda x, a, c: _ops.between(x, [a, a], 0.5, [c]), (x.detach().requires_grad_(), a, c)
    )
    assert torch.autograd.gradgradcheck(
        lambda x, a, c: _ops.between(x, [a, a], 0.5, [c]) ** 2, (x.detach().requires_grad_(), a, c)
    )


def test_other_tensor_list_types_keep_torchs_wrapper():
    x, a = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    _ops.optional_list(x, [a, a]).sum().backward()
    torch.testing.assert_close(a.grad, torch.full_like(a, 2.0))


def test_a_list_gradient_of_the_wrong_length_raises():
    pieces = [torch.randn(2, requires_grad=True), torch.randn(2, requires_grad=True)]
    with pytest.raises(RuntimeError, match="list of 2 gradients"):
        _ops.short_list(pieces).sum().backward()


def test_unused_outputs_gradients_are_not_filled_with_zeros():
    """Backward reads only the first output's gradient: the others (batch statistics) arrive as None
    instead of a zero-filled tensor each (a fill kernel per statistic and call on a GPU). Where only
    an unused output is reached, every input's gradient is None (zero), its list's too."""
    x, a, b = (torch.randn(3, dtype=torch.float64, requires_grad=True) for _ in range(3))
    _GRADS.clear()
    out, stat = _ops.with_stats(x, [a, b])
    out.sum().backward()
    assert _GRADS == [None]
    torch.testing.assert_close(x.grad, torch.full_like(x, 3.0))
    torch.testing.assert_close(a.grad, torch.ones_like(a))
    x.grad = a.grad = b.grad = None
    _GRADS.clear()
    out, stat = _ops.with_stats(x, [a, b])
    stat.backward()
    assert _GRADS == [] and x.grad is None and a.grad is None and b.grad is None


def test_bn_act_conv_backward_fills_no_zeros_for_its_statistics():
    """fxfuse::bn_act_conv has six statistics outputs: its backward node filled six zero tensors a call."""
    from torch.profiler import ProfilerActivity, profile

    from fxfuse.fusion import runtime

    x = torch.randn(2, 8, 6, 6, requires_grad=True)
    bn, conv, bn2 = torch.nn.BatchNorm2d(8), torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8)
    out = runtime.bn_act_conv_module(x, bn, "relu", 0.0, conv, bn2, "relu", 0.0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out.sum().backward()
    nodes = [e for e in prof.events() if "BnActConv" in e.name]  # its C++ node: fxfuse::(anonymous)::BnActConv
    assert nodes and x.grad is not None
    assert not [e for e in prof.events() if e.name == "aten::zeros" and e.cpu_parent in nodes]
