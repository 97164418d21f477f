"""fusion/regions/checkpointed.py: the lean checkpoint gives torch.utils.checkpoint's results and errors."""

from __future__ import annotations

import contextlib
import weakref

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from torch.overrides import TorchFunctionMode

from fxfuse.fusion.regions.checkpointed import checkpointed

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _body(w, x):
    return torch.tanh(F.conv2d(torch.relu(x), w, padding=1)).pow(2)


def _inputs(dtype=torch.float64):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 5, dtype=dtype, requires_grad=True)
    w = torch.randn(4, 3, 3, 3, dtype=dtype, requires_grad=True)
    return w, x


def _assert_first_and_second_order_close(want, got, inputs):
    """`want` and `got`: first-order gradients built with create_graph; they and the gradients of their
    squared sums agree."""
    for a, b in zip(want, got):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    second_want = torch.autograd.grad(sum(g.square().sum() for g in want), inputs)
    second_got = torch.autograd.grad(sum(g.square().sum() for g in got), inputs)
    for a, b in zip(second_want, second_got):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _counted():
    """A recompute context that counts how often it is entered."""
    entered = []

    @contextlib.contextmanager
    def context():
        entered.append(1)
        yield

    return context, entered


def _grads(out, inputs, create_graph=False):
    return torch.autograd.grad(out.sum(), inputs, create_graph=create_graph)


@pytest.fixture
def torch_checkpoint_calls(monkeypatch):
    calls = []
    real = torch_checkpoint.checkpoint

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch_checkpoint, "checkpoint", spy)
    return calls


def test_gradients_and_second_order_gradients_match_eager_without_torch_checkpoint(torch_checkpoint_calls):
    w, x = _inputs()
    eager = _grads(_body(w, x), (w, x), create_graph=True)
    ours = _grads(checkpointed(_body, contextlib.nullcontext, w, x), (w, x), create_graph=True)
    assert torch_checkpoint_calls == []
    _assert_first_and_second_order_close(eager, ours, (w, x))


@pytest.mark.parametrize("run", ["eager", "checkpointed"])
def test_forward_keeps_no_intermediate_alive(run):
    w, x = _inputs()
    kept = []

    def body(w, x):
        y = torch.relu(x)  # saved by the conv after it, in eager
        kept.append(weakref.ref(y))
        return F.conv2d(y, w, padding=1)

    out = body(w, x) if run == "eager" else checkpointed(body, contextlib.nullcontext, w, x)
    assert (kept[0]() is None) == (run == "checkpointed")
    _grads(out, (w, x))


def test_dropout_draws_the_same_mask_and_leaves_the_generator_where_it_was():
    w, x = _inputs()

    def body(w, x):
        return F.dropout(F.conv2d(x, w, padding=1), 0.5, training=True).sin()

    torch.manual_seed(1)
    eager = _grads(body(w, x), (w, x))
    torch.manual_seed(1)
    out = checkpointed(body, contextlib.nullcontext, w, x)
    after_forward = torch.get_rng_state()
    ours = _grads(out, (w, x))
    assert torch.equal(torch.get_rng_state(), after_forward)
    for a, b in zip(eager, ours):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_recompute_stops_after_the_last_tensor_backward_needs():
    w, x = _inputs()
    ran = []

    def body(w, x):
        y = torch.sin(F.conv2d(x, w, padding=1))
        ran.append(1)  # past the last op that saves: the recompute never gets here
        return y + 1

    out = checkpointed(body, contextlib.nullcontext, w, x)
    _grads(out, (w, x))
    assert len(ran) == 1


def test_retain_graph_backwards_recompute_once_each_and_agree():
    w, x = _inputs()
    context, entered = _counted()
    out = checkpointed(_body, context, w, x)
    first = torch.autograd.grad(out.sum(), (w, x), retain_graph=True)
    second = torch.autograd.grad(out.sum(), (w, x))
    assert len(entered) == 2
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_an_unpack_outside_backward_recomputes_the_saved_tensor():
    w, x = _inputs()
    out = checkpointed(lambda w, x: torch.sin(x * w.sum()), contextlib.nullcontext, w, x)
    assert torch.equal(out.grad_fn._saved_self, x * w.sum())


def test_an_input_changed_in_place_after_forward_raises_as_eager_does():
    w, x = _inputs()
    h = x * 1
    out = checkpointed(_body, contextlib.nullcontext, w, h)
    with torch.no_grad():
        h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_a_recompute_that_saves_fewer_tensors_raises_checkpoint_error():
    w, x = _inputs()
    calls = []

    def body(w, x):
        calls.append(1)
        y = F.conv2d(x, w, padding=1)
        return y.sin() if len(calls) == 1 else y + 1

    out = checkpointed(body, contextlib.nullcontext, w, x)
    with pytest.raises(torch_checkpoint.CheckpointError, match="different number of tensors"):
        out.sum().backward()


def test_backward_outside_autocast_recomputes_under_the_forwards_autocast():
    w, x = _inputs(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = torch_checkpoint.checkpoint(_body, w, x, use_reentrant=False)
        ours = checkpointed(_body, contextlib.nullcontext, w, x)
    assert ours.dtype == torch.bfloat16
    for a, b in zip(_grads(reference, (w, x)), _grads(ours, (w, x))):
        assert torch.equal(a, b)


def test_the_recompute_context_is_entered_around_each_recompute_only():
    w, x = _inputs()
    events = []

    @contextlib.contextmanager
    def context():
        events.append("enter")
        yield
        events.append("exit")

    out = checkpointed(_body, context, w, x)
    assert events == []
    _grads(out, (w, x))
    assert events == ["enter", "exit"]


def test_without_grad_it_only_runs_the_function(torch_checkpoint_calls):
    w, x = _inputs()
    with torch.no_grad():
        out = checkpointed(_body, contextlib.nullcontext, w, x)
    assert out.grad_fn is None and torch_checkpoint_calls == []


class _Passthrough(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("setting", ["saved_tensors_hooks", "function_mode", "checkpoint_debug"])
def test_what_it_does_not_handle_goes_to_torch_checkpoint(setting, torch_checkpoint_calls):
    w, x = _inputs()
    contexts = {
        "saved_tensors_hooks": lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
        "function_mode": _Passthrough,
        "checkpoint_debug": lambda: torch_checkpoint.set_checkpoint_debug_enabled(True),
    }
    with contexts[setting]():
        out = checkpointed(_body, contextlib.nullcontext, w, x)
        ours = _grads(out, (w, x))
    assert torch_checkpoint_calls == [1]
    for a, b in zip(_grads(_body(w, x), (w, x)), ours):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_torch_func_transforms_raise_as_torch_checkpoint_does(torch_checkpoint_calls):
    w, x = _inputs()
    x = x.detach()
    runs = {
        "torch": lambda w: torch_checkpoint.checkpoint(_body, w, x, use_reentrant=False),
        "fxfuse": lambda w: checkpointed(_body, contextlib.nullcontext, w, x),
    }
    errors = {}
    for name, run in runs.items():
        with pytest.raises(RuntimeError) as error:
            torch.func.grad(lambda w, run=run: run(w).sum())(w.detach())
        errors[name] = str(error.value)
    assert errors["torch"] == errors["fxfuse"]
    assert len(torch_checkpoint_calls) == 2


def test_nested_calls_stay_lean_and_match_eager_with_dropout(torch_checkpoint_calls):
    """A link's chain: regions called inside another's forward and recompute. The inner calls' inputs are
    kept by the outer frame and rebuilt by its recompute, as torch's nested checkpoints do."""
    w, x = _inputs()

    def inner(w, x):
        return F.dropout(torch.tanh(F.conv2d(x, w, padding=1)), 0.3, training=True)

    def eager(w, x):
        return inner(w, inner(w, torch.relu(x))[:, :3]).pow(2)

    def nested(w, x):
        h = checkpointed(inner, contextlib.nullcontext, w, torch.relu(x))[:, :3]
        return checkpointed(inner, contextlib.nullcontext, w, h).pow(2)

    def outer(w, x):
        return checkpointed(nested, contextlib.nullcontext, w, x)

    torch.manual_seed(3)
    want = _grads(eager(w, x), (w, x), create_graph=True)
    torch.manual_seed(3)
    got = _grads(outer(w, x), (w, x), create_graph=True)
    assert torch_checkpoint_calls == []
    _assert_first_and_second_order_close(want, got, (w, x))


def test_partial_backwards_each_recompute_and_match_eager():
    w, x = _inputs()
    eager_out = _body(w, x)
    out = checkpointed(_body, contextlib.nullcontext, w, x)
    for wrt in ((x,), (w,)):
        want = torch.autograd.grad(eager_out.sum(), wrt, retain_graph=True)
        got = torch.autograd.grad(out.sum(), wrt, retain_graph=True)
        torch.testing.assert_close(want, got, rtol=1e-12, atol=1e-12)


def test_backwards_in_one_graph_exec_group_recompute_once():
    w, x = _inputs()
    context, entered = _counted()

    def two(w, x):
        return torch.sin(x), torch.cos(w)

    a, b = checkpointed(two, context, w, x)
    with torch_checkpoint.GraphExecGroup():
        (gx,) = torch.autograd.grad(a.sum(), (x,))
        (gw,) = torch.autograd.grad(b.sum(), (w,))
    assert len(entered) == 1
    assert torch.equal(gx, torch.cos(x)) and torch.equal(gw, -torch.sin(w))


def test_meta_tensors_run_as_under_torch_checkpoint(torch_checkpoint_calls):
    """A device without autocast (meta, where fxfuse counts bytes): its autocast state is not read."""
    w, x = (t.detach().to("meta").requires_grad_() for t in _inputs())
    out = checkpointed(_body, contextlib.nullcontext, w, x)
    gw, gx = _grads(out, (w, x))
    assert torch_checkpoint_calls == []
    assert gw.device.type == "meta" and gw.shape == w.shape and gx.shape == x.shape


@pytest.mark.parametrize("create_graph", [False, True])
def test_a_backward_inside_the_region_runs_as_under_torch_checkpoint(create_graph):
    """torch.autograd.grad inside `fn` (torch's "Rule 6"): the recompute's own graph is backwarded, so
    what its ops save must be packed there too. Before, the recompute's pack hook returned None and
    this raised a TypeError in backward."""
    torch.manual_seed(0)
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)

    def body(x):
        z = torch.cos(torch.sin(x))
        (gx,) = torch.autograd.grad(z.sum(), x, retain_graph=True, create_graph=create_graph)
        return gx * z

    want = torch.autograd.grad(torch_checkpoint.checkpoint(body, x, use_reentrant=False).sum(), x)
    got = torch.autograd.grad(checkpointed(body, contextlib.nullcontext, x).sum(), x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("run", ["torch", "checkpointed"])
def test_a_recompute_keeps_nothing_for_nodes_an_earlier_backward_freed(run):
    from torch.multiprocessing.reductions import StorageWeakRef

    w, x = _inputs()
    recomputes = []

    def body(w, x):
        a = torch.sin(x)  # saved by cos: needed by the first output's backward only
        recomputes.append(StorageWeakRef(a.untyped_storage()))
        return torch.cos(a), torch.tanh(w)

    if run == "torch":
        b, d = torch_checkpoint.checkpoint(body, w, x, use_reentrant=False)
    else:
        b, d = checkpointed(body, contextlib.nullcontext, w, x)
    b.sum().backward()  # frees cos's node and what it saved
    d.sum().backward(retain_graph=True)  # recomputes `a` again: nothing needs it now
    assert recomputes[2].expired()


def test_a_budget_step_with_dropout_in_its_regions_matches_eager(monkeypatch):
    """The same check runs on a GPU in test_cuda.py, where the CUDA RNG state is the one restored."""
    from support.dropout_regions import check_budget_step_with_dropout_matches_eager

    assert check_budget_step_with_dropout_matches_eager("cpu", monkeypatch) > 0


def test_a_torch_without_the_apis_it_calls_gets_torch_checkpoint(monkeypatch, torch_checkpoint_calls):
    """The lean path calls private torch APIs, probed once at import: the pinned torch has them all; where
    one is missing (another torch version), every call goes to torch.utils.checkpoint."""
    from fxfuse.fusion.regions import checkpointed as module

    assert module.SUPPORTED
    monkeypatch.setattr(module, "SUPPORTED", False)
    w, x = _inputs()
    out = checkpointed(_body, contextlib.nullcontext, w, x)
    for a, b in zip(_grads(_body(w, x), (w, x)), _grads(out, (w, x))):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert torch_checkpoint_calls == [1]
