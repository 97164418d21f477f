"""ops/rebuild.py: a registered BN→activation output is kept as its recipe and rebuilt bit for bit; every other
tensor, and the recipe's own tensors, reach the hooks already in effect."""

import collections
import gc
import sys
import weakref

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from fxfuse import ops
from fxfuse.ops import rebuild


def _bn_inputs(dtype=torch.float32):
    torch.manual_seed(0)
    x = torch.randn(2, 4, 5, 5, dtype=dtype, requires_grad=True)
    w = torch.randn(4, dtype=dtype, requires_grad=True)
    b = torch.randn(4, dtype=dtype, requires_grad=True)
    conv = torch.randn(3, 4, 3, 3, dtype=dtype, requires_grad=True)
    return x, w, b, conv


def _loss(x, w, b, conv, rebuildable, act="relu"):
    """A loss through a BN→act whose output feeds a conv and a multiply (both keep it)."""
    a = ops.batch_norm_act(x, torch.zeros(4, dtype=x.dtype), torch.ones(4, dtype=x.dtype), w, b, True,
                           act=act, rebuildable=rebuildable)  # fmt: skip
    gate = a.detach().flip(0).requires_grad_()  # a factor with a gradient: the multiply keeps `a` for it
    return F.conv2d(a, conv).sum() + (a * gate).sum()


@pytest.mark.parametrize("act", ["relu", "silu"])
def test_kept_output_is_rebuilt_bit_for_bit(act):
    inputs = _bn_inputs()
    expected = torch.autograd.grad(_loss(*inputs, rebuildable=False, act=act), inputs)
    with rebuild.Tally() as tally:
        with rebuild.Scope():
            y = _loss(*inputs, rebuildable=True, act=act)
    got = torch.autograd.grad(y, inputs)
    assert tally.count == 2  # the conv and the multiply each keep it
    assert tally.bytes == 2 * 2 * 4 * 5 * 5 * 4
    for e, g in zip(expected, got):
        assert torch.equal(e, g)


def test_outer_hooks_see_the_recipe_tensors_instead_of_the_output():
    inputs = _bn_inputs()
    packed = []

    def pack(t):
        packed.append(t)
        return t.clone()  # like an offloading hook: backward gets a copy back

    expected = torch.autograd.grad(_loss(*inputs, rebuildable=False), inputs)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with rebuild.Scope():
            y = _loss(*inputs, rebuildable=True)
    # the BN input, for the BN and for each recipe (the conv's and the multiply's): the recipes' tensors reach the hook
    assert sum(t is inputs[0] for t in packed) == 3
    assert not any(t.shape == inputs[0].shape and t.grad_fn is not None for t in packed)  # never the output
    for e, g in zip(expected, torch.autograd.grad(y, inputs)):
        assert torch.equal(e, g)


def test_output_changed_in_place_is_kept_as_it_is():
    x, w, b, conv = _bn_inputs()
    with rebuild.Tally() as tally, rebuild.Scope():
        a = ops.batch_norm_act(x, None, None, w, b, True, act="relu", rebuildable=True)
        a = a.mul_(2)  # changed after the BN: the recipe no longer describes it
        y = F.conv2d(a, conv).sum()
    assert tally.count == 0
    eager = F.conv2d(2 * F.relu(F.batch_norm(x, None, None, w, b, True)), conv).sum()
    for e, g in zip(torch.autograd.grad(eager, (x, conv)), torch.autograd.grad(y, (x, conv))):
        torch.testing.assert_close(g, e)


def test_bn_parameter_changed_in_place_before_backward_raises_as_eager():
    x, w, b, conv = _bn_inputs()
    with rebuild.Scope():
        a = ops.batch_norm_act(x, None, None, w, b, True, act="relu", rebuildable=True)
        y = F.conv2d(a, conv).sum()
    with torch.no_grad():
        w.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_output_changed_in_place_after_an_op_kept_it_raises_as_eager():
    x, w, b, conv = _bn_inputs()
    with rebuild.Tally() as tally, rebuild.Scope():
        a = ops.batch_norm_act(x, None, None, w, b, True, act="relu", rebuildable=True)
        y = F.conv2d(a, conv).sum()
    assert tally.count == 1
    a.mul_(2)  # eager's conv kept `a`: its backward raises; the recipe must not rebuild the old value silently
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_eval_statistics_are_those_of_the_forward():
    x, w, b, conv = _bn_inputs(torch.float64)
    mean, var = torch.zeros(4, dtype=x.dtype), torch.ones(4, dtype=x.dtype)
    with rebuild.Scope():
        a = ops.batch_norm_act(x, mean, var, w, b, False, act="relu", rebuildable=True)
        y = F.conv2d(a, conv).sum()
    expected = torch.autograd.grad(F.conv2d(F.relu(F.batch_norm(x, mean, var, w, b)), conv).sum(), conv)
    mean.add_(5)  # a later training call updates the running statistics in place
    torch.testing.assert_close(torch.autograd.grad(y, conv), expected, rtol=1e-12, atol=1e-12)


def test_no_scope_without_grad_under_torch_func_or_without_registration():
    x, w, b, conv = _bn_inputs()
    with torch.no_grad(), rebuild.Scope():
        assert not rebuild.active()
    with rebuild.Tally() as tally:  # counts what the scopes that end inside it packed as recipes
        with rebuild.Scope():
            assert rebuild.active()
            a = ops.batch_norm_act(x, None, None, w, b, True, act="relu")  # not rebuildable: kept as eager would
            F.conv2d(a, conv)
    assert not rebuild.active() and tally.count == 0

    def f(x):
        with rebuild.Scope():
            assert not rebuild.active()  # torch.func disables saved-tensor hooks
            return x.sin().sum()

    torch.func.grad(f)(torch.ones(3))


def test_tensors_held_as_themselves_keep_autograds_in_place_check():
    # Autograd checks no version of what saved-tensor hooks pack; the scope checks what it holds.
    x = torch.randn(3, requires_grad=True)
    with rebuild.Scope():
        a = x * 2
        y = (a * a).sum()
    a.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_nothing_registered_where_a_checkpoint_packs(monkeypatch):
    # Inside a checkpoint its hooks keep what is saved: a recipe would only hold the BN input longer.
    # (The scope drops an entry when its output dies, so `scope._recipes` is empty after the call either way:
    # the registrations themselves are what is checked.)
    registered = []
    register = rebuild.Scope.register

    def spy(self, out, *rest):
        registered.append(out)
        register(self, out, *rest)

    monkeypatch.setattr(rebuild.Scope, "register", spy)
    x, w, b, conv = _bn_inputs()
    with rebuild.Scope():
        _loss(x, w, b, conv, True)
        assert len(registered) == 1  # outside the checkpoint it registers
        torch.utils.checkpoint.checkpoint(_loss, x, w, b, conv, True, use_reentrant=False)
        assert rebuild.active() and len(registered) == 1


def test_a_dropped_forward_leaves_nothing_alive():
    x = torch.randn(64, requires_grad=True)
    with rebuild.Scope():
        y = torch.sigmoid(x * 2)  # sigmoid keeps its own output
    ref = weakref.ref(y)
    del y
    gc.collect()
    assert ref() is None


def test_frozen_bn_keeps_its_output_as_eager():
    # Nothing needs the BN's gradient, so it keeps no input: a recipe would keep one in the output's place.
    x, w, b, conv = _bn_inputs()
    x, w, b = x.detach(), w.detach(), b.detach()
    with rebuild.Tally() as tally, rebuild.Scope():
        a = ops.batch_norm_act(x, torch.zeros(4), torch.ones(4), w, b, False, act="relu", rebuildable=True)
        F.conv2d(a, conv).sum()
    assert tally.count == 0


def test_parameters_reach_the_outer_hooks_too():
    x, w, b, conv = _bn_inputs()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
        with rebuild.Scope():
            y = _loss(x, w, b, conv, rebuildable=True)
    expected = torch.autograd.grad(_loss(x, w, b, conv, rebuildable=False), conv, retain_graph=True)
    with torch.no_grad():
        w.add_(1)  # the hook kept a copy, as it keeps one of everything eager saves: no error, as in eager
    torch.testing.assert_close(torch.autograd.grad(y, conv), expected)


def test_bn_input_changed_in_place_after_the_bn_keeps_the_output_as_it_is():
    # The recipe would rebuild the output from the changed input: autograd.grad to the conv's weight (which
    # never reaches the BN's own version check) would come out silently wrong. Eager gives the right one.
    x0, w, b, conv = _bn_inputs(torch.float64)

    def conv_grad(rebuildable):
        with rebuild.Tally() as tally, rebuild.Scope():
            x = x0 * 1.0
            a = ops.batch_norm_act(x, None, None, w, b, True, act="relu", rebuildable=rebuildable)
            x.mul_(3)
            y = F.conv2d(a, conv).sum()
        assert tally.count == 0
        return torch.autograd.grad(y, conv)[0]

    torch.testing.assert_close(conv_grad(True), conv_grad(False), rtol=0, atol=0)


def test_a_tensor_kept_as_it_came_costs_one_python_call_each_way():
    # Every tensor autograd keeps in an optimized forward goes through the scope's hooks.
    a, b = torch.randn(4, requires_grad=True), torch.randn(4, requires_grad=True)
    calls = collections.Counter()

    def count(frame, event, arg):
        if event == "call" and frame.f_code.co_filename == rebuild.__file__:
            calls[frame.f_code.co_name] += 1

    with rebuild.Scope():
        sys.setprofile(count)
        try:
            out = a * b  # keeps a and b
        finally:
            sys.setprofile(None)
    sys.setprofile(count)
    try:
        out.sum().backward()
    finally:
        sys.setprofile(None)
    assert calls == {"_pack": 2, "_unpack": 2}
    torch.testing.assert_close(a.grad, b)
