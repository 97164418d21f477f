"""passes/inplace_add.py and runtime.add_into: the residual add written over a fused
Conv→BN output that nothing else uses, as eager's `out += identity` does."""

import copy
import operator

import pytest
import torch
from torch import nn

import fxfuse
from fxfuse.fusion import runtime
from fxfuse.testing import assert_equivalent


class Block(nn.Module):
    """ResNet-style: conv-bn(-relu) main path, conv-bn shortcut, `out += identity`."""

    def __init__(self, c=4, reuse_main=False, main_act=False, functional=False, shortcut=True):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)
        self.reuse_main, self.main_act, self.functional = reuse_main, main_act, functional
        self.shortcut = shortcut

    def forward(self, x):
        if self.functional:
            out = torch.nn.functional.batch_norm(
                self.conv1(x),
                self.bn1.running_mean,
                self.bn1.running_var,
                self.bn1.weight,
                self.bn1.bias,
                self.training,
            )
        else:
            out = self.bn1(self.conv1(x))
        if self.main_act:
            out = self.relu(out)
        identity = self.bn2(self.conv2(x)) if self.shortcut else x
        if self.reuse_main:
            return self.relu(out + identity) * out * identity
        if self.main_act:  # `out += identity` would change what relu's backward keeps, in eager too
            return self.relu(out + identity)
        out += identity
        return self.relu(out)


def _graph_adds(model):
    from fxfuse.fusion import tracing
    from fxfuse.fusion.passes import PassContext, run_passes
    from fxfuse.fusion.plan import Findings

    traced = tracing.trace(model)
    ctx = PassContext(traced.graph, model, "memory", Findings())
    run_passes(ctx)
    return [n.target for n in traced.graph.nodes if n.target in (runtime.add_into, operator.add, operator.iadd)]


@pytest.mark.parametrize("functional", [False, True])
def test_residual_add_goes_in_place_and_stays_exact(functional):
    model = Block(functional=functional)
    assert _graph_adds(model) == [runtime.add_into]
    optimized = fxfuse.optimize(copy.deepcopy(model))
    assert_equivalent(model, optimized, torch.randn(2, 4, 6, 5), dtype=torch.float64)
    assert_equivalent(model, optimized, torch.randn(2, 4, 6, 5))


def test_outputs_with_other_users_or_an_activation_are_left_alone():
    assert _graph_adds(Block(reuse_main=True)) == [operator.add]
    # the relu's output is kept by its backward: the add must not write over it
    model = Block(main_act=True, shortcut=False)
    assert _graph_adds(model) == [operator.add]
    assert_equivalent(model, fxfuse.optimize(copy.deepcopy(model)), torch.randn(2, 4, 6, 5), dtype=torch.float64)


def test_the_fresh_operand_may_be_the_right_one():
    model = Block(main_act=True)  # relu(bn1(conv1(x))) + bn2(conv2(x)): add into the second
    assert _graph_adds(model) == [runtime.add_into]
    assert_equivalent(model, fxfuse.optimize(copy.deepcopy(model)), torch.randn(2, 4, 6, 5), dtype=torch.float64)


def test_fast_mode_adds_into_theplain_batch_norm_output():
    """mode="fast" leaves Conv→BN (no activation) to eager; a BatchNorm2d's backward keeps its input,
    never its output, so the residual add may write over that output."""
    from fxfuse.fusion import tracing
    from fxfuse.fusion.passes import PassContext, run_passes
    from fxfuse.fusion.plan import Findings

    block = Block()
    traced = tracing.trace(block)
    run_passes(PassContext(traced.graph, block, "fast", Findings()))
    (add,) = [n for n in traced.graph.nodes if n.target is runtime.add_into]
    assert add.args[0].op == "call_module" and add.args[0].target in ("bn1", "bn2")
    x = torch.randn(2, 4, 6, 5)
    assert_equivalent(block, fxfuse.optimize(copy.deepcopy(block), mode="fast"), x, dtype=torch.float64)


def test_a_batch_norm_subclass_with_its_own_forward_is_not_added_into():
    class ScaledBN(nn.BatchNorm2d):
        def forward(self, x):
            return super().forward(x) * 2

    from fxfuse.fusion.passes import inplace_add

    assert inplace_add.plain_batch_norm(nn.BatchNorm2d(3))
    assert not inplace_add.plain_batch_norm(ScaledBN(3))
    hooked = nn.BatchNorm2d(3)
    hooked.register_forward_hook(lambda *a: None)
    assert not inplace_add.plain_batch_norm(hooked)


def test_add_into_writes_over_fresh_only_when_the_result_is_the_same():
    a, b = torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4, 5)
    expected = a + b
    ptr = a.data_ptr()
    out = runtime.add_into(a, b)
    assert out is a and out.data_ptr() == ptr
    torch.testing.assert_close(out, expected, rtol=0, atol=0)

    def out_of_place(fresh, other):
        before = fresh.clone()
        want = fresh + other
        got = runtime.add_into(fresh, other)
        assert got is not fresh
        torch.testing.assert_close(fresh, before, rtol=0, atol=0)  # untouched
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert got.dtype == want.dtype and got.stride() == want.stride()

    x = torch.randn(2, 3, 4, 5)
    out_of_place(x, torch.randn(1, 3, 1, 1))  # broadcast
    out_of_place(torch.randn(1, 3, 1, 5), x)  # the result is larger than fresh
    out_of_place(x, x.double())  # type promotion
    out_of_place(x, x.contiguous(memory_format=torch.channels_last))  # other layout
    out_of_place(x, 2.0)  # not a tensor
    out_of_place(x, x)  # the same tensor
    out_of_place(x[:, :2], torch.randn(2, 2, 4, 5))  # a view
    out_of_place(x[:1], torch.randn(1, 3, 4, 5))  # a view with other's shape and strides: its base would change
    out_of_place(torch.randn(1, 3, 4, 5), x)  # the strides agree, the shapes do not: the result is larger
    leaf = torch.randn(2, 3, requires_grad=True)
    got = runtime.add_into(leaf, torch.ones(2, 3))
    assert got is not leaf and got.grad_fn is not None
    with torch.inference_mode():
        inf = torch.randn(2, 3)
    got = runtime.add_into(inf, torch.ones(2, 3))
    assert got is not inf
    with torch.inference_mode():
        assert runtime.add_into(inf, torch.ones(2, 3)) is inf


def test_add_into_differentiates_like_the_add():
    w = torch.randn(2, 3, requires_grad=True)
    other = torch.randn(2, 3, requires_grad=True)
    fresh = w * 2.0  # a non-leaf nothing else keeps
    out = runtime.add_into(fresh, other)
    assert out is fresh
    gw, go = torch.autograd.grad(out.square().sum(), (w, other))
    ref = w.detach() * 2.0 + other.detach()
    torch.testing.assert_close(gw, 4.0 * ref)
    torch.testing.assert_close(go, 2.0 * ref)
