"""Concatenations rebuilt in backward: fxfuse::cat_batch_norm_act, cat_conv_bn_act, cat_bn_act_conv, cat_conv2d.

`batch_norm_act`, `conv_bn_act`, `bn_act_conv` and `conv2d` keep their input for backward. Where that
input is `torch.cat(pieces, 1)`, they keep a fresh copy of tensors that are often kept anyway: a
DenseNet layer's input is the concatenation of every earlier layer's output, so each layer keeps
its own copy of them all. `cat_<op>` is `<op>` with the pieces kept instead (Pleiss et al.'s
memory-efficient DenseNet): its forward runs `<op>` on the concatenation; its autograd keeps the
pieces (`ctx.save_for_backward`, so saved-tensor hooks see them) and not the concatenation, and
its backward concatenates them again (`torch.cat`: the same values, in the same layout), runs
`<op>`'s own backward on that and returns each piece's gradient as eager's cat backward does, a
slice of the input's gradient along dim 1. Exact by construction: the same kernels run on the same
values; running statistics are updated once, by the wrappers, from the op's outputs.

Schema: `cat_<op>(Tensor[] pieces, Tensor input, <op's other arguments>)`, where `input` is
`torch.cat(pieces, 1)`, computed by the caller (the wrappers need it to decide whether the fused
op may serve the call at all) and given no gradient. The wrappers take the pieces as `pieces=`
(`checks.fused_call` picks the op); `cat_batch_norm_act` etc. here are the functional forms.

Second-order gradients go through `<op>`'s backward, which composes eager ops when it runs for a
graph of its own (ops/higher_order.py): the rebuilt concatenation is then itself a differentiable
function of the pieces. Under torch.func transforms and forward AD the wrappers run eager's ops
(checks.fusable). Under autocast the pieces are not used (checks.fused_call): `<op>` casts its
input as eager autocast does (conv_bn_act), and what it would keep is that cast copy.
"""

from __future__ import annotations

from importlib import import_module
from types import SimpleNamespace
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from .autograd_kernel import register_autograd
from .batch_norm_act import batch_norm_act
from .bn_act_conv import bn_act_conv
from .conv2d import conv2d
from .conv_bn_act import conv_bn_act

__all__ = [
    "BASES",
    "cat_batch_norm_act",
    "cat_bn_act_conv",
    "cat_conv2d",
    "cat_conv_bn_act",
    "cat_grads",
    "check_pieces",
]

# fxfuse.ops.<op> is the op's function once the package is imported (as in torchvision.ops): the modules by name.
_batch_norm_act, _bn_act_conv, _conv2d, _conv_bn_act = (
    import_module(f"{__package__}.{op}") for op in ("batch_norm_act", "bn_act_conv", "conv2d", "conv_bn_act")
)

# The ops that have a cat_ variant: (setup_context, backward) of their registered autograd.
BASES: dict[str, tuple[Callable, Callable]] = {
    "batch_norm_act": (_batch_norm_act._batch_norm_act_setup, _batch_norm_act._batch_norm_act_bwd),
    "conv_bn_act": (_conv_bn_act._setup, _conv_bn_act._backward),
    "bn_act_conv": (_bn_act_conv._setup, _bn_act_conv._backward),
    "conv2d": (_conv2d._setup, _conv2d._backward),
}

_LIB = torch.library.Library("fxfuse", "FRAGMENT")


def cat_batch_norm_act(pieces: Sequence[Tensor], *args, **kwargs) -> Tensor:
    """`batch_norm_act(torch.cat(pieces, 1), ...)`, keeping `pieces` for backward instead of their concatenation."""
    return batch_norm_act(torch.cat(pieces, 1), *args, pieces=pieces, **kwargs)


def cat_conv_bn_act(pieces: Sequence[Tensor], *args, **kwargs) -> Tensor:
    """`conv_bn_act(torch.cat(pieces, 1), ...)`, keeping `pieces` for backward instead of their concatenation."""
    return conv_bn_act(torch.cat(pieces, 1), *args, pieces=pieces, **kwargs)


def cat_bn_act_conv(pieces: Sequence[Tensor], *args, **kwargs) -> Tensor:
    """`bn_act_conv(torch.cat(pieces, 1), ...)`, keeping `pieces` for backward instead of their concatenation."""
    return bn_act_conv(torch.cat(pieces, 1), *args, pieces=pieces, **kwargs)


def cat_conv2d(pieces: Sequence[Tensor], *args, **kwargs) -> Tensor:
    """`conv2d(torch.cat(pieces, 1), ...)`, keeping `pieces` for backward instead of their concatenation."""
    return conv2d(torch.cat(pieces, 1), *args, pieces=pieces, **kwargs)


def check_pieces(pieces: Sequence[Tensor], input: Tensor) -> None:
    """`input` has the shape of `torch.cat(pieces, 1)` (what the op can check of the contract).
    Concrete shapes are compared as tuples first (7 us against 23 for eight pieces through
    torch._check, every call of a DenseNet layer); symbolic ones, or a mismatch, go through
    torch._check, which records the checks in a trace and words the error."""
    if pieces and input.dim() >= 2 and all(type(d) is int for d in input.shape):
        rest = (*input.shape[:1], *input.shape[2:])
        if (
            all(p.dim() == input.dim() and (*p.shape[:1], *p.shape[2:]) == rest for p in pieces)
            and sum(p.shape[1] for p in pieces) == input.shape[1]
        ):
            return
    torch._check(len(pieces) > 0, lambda: "fxfuse::cat_*: expected at least one piece")
    for piece in pieces:
        torch._check(
            piece.dim() == input.dim() and piece.shape[:1] == input.shape[:1] and piece.shape[2:] == input.shape[2:],
            lambda piece=piece: (
                f"fxfuse::cat_*: a piece of shape {tuple(piece.shape)} cannot be part of an input of shape "
                f"{tuple(input.shape)} concatenated along dim 1"
            ),
        )
    torch._check(
        sum(p.shape[1] for p in pieces) == input.shape[1],
        lambda: (
            f"fxfuse::cat_*: the pieces' channels add up to {sum(p.shape[1] for p in pieces)}, "
            f"the input has {input.shape[1]}"
        ),
    )


def cat_grads(grad: Optional[Tensor], pieces: Sequence[Tensor], needed: Sequence[bool]) -> list[Optional[Tensor]]:
    """Each piece's gradient from the concatenation's, as eager's cat backward gives it: a slice along dim 1."""
    grads: list[Optional[Tensor]] = []
    offset = 0
    for piece, need in zip(pieces, needed):
        size = piece.shape[1]
        grads.append(grad.narrow(1, offset, size) if grad is not None and need else None)
        offset += size
    return grads


def rebuild(pieces: Sequence[Tensor]) -> Tensor:
    """`torch.cat(pieces, 1)` again, in backward; differentiable in the pieces when the backward is
    (create_graph). The dim is given in its negative form: under torch.compile, AOTAutograd's CSE
    would otherwise merge this cat with the forward's, and its partitioner, which does not recompute
    a cat, would keep the concatenation after all (DenseNet-121: twice the saved bytes)."""
    return torch.cat(pieces, 1 - pieces[0].dim())


class _Recorded:
    """The ctx a base op's setup_context fills: what it saves, and its other attributes (its config)."""

    def save_for_backward(self, *tensors: Optional[Tensor]) -> None:
        self.saved = tensors


def _autograd(name: str) -> tuple[Callable, Callable]:
    """(setup_context, backward) of cat_<name>: <name>'s own, with the pieces kept in place of the input."""
    base_setup, base_backward = BASES[name]

    def setup(ctx, inputs, output):
        pieces, input, *rest = inputs
        recorded = _Recorded()
        base_setup(recorded, (input, *rest), output)
        saved = list(recorded.saved)
        slot = next(i for i, t in enumerate(saved) if t is input)
        saved[slot] = None
        ctx.save_for_backward(*pieces, *saved)
        ctx.cat_slot = (len(pieces), slot)
        ctx.base = {k: v for k, v in vars(recorded).items() if k != "saved"}  # the base's config: no tensors

    def backward(ctx, *grads):
        count, slot = ctx.cat_slot
        saved = ctx.saved_tensors
        pieces, rest = saved[:count], list(saved[count:])
        rest[slot] = rebuild(pieces)
        needed = list(ctx.needs_input_grad[0])
        inner = SimpleNamespace(
            saved_tensors=tuple(rest), needs_input_grad=(any(needed), *ctx.needs_input_grad[2:]), **ctx.base
        )
        grad_input, *others = base_backward(inner, *grads)
        return (cat_grads(grad_input, pieces, needed), None, *others)

    return setup, backward


def _kernel(name: str) -> Callable:
    base = getattr(torch.ops.fxfuse, name).default

    def kernel(pieces, input, *args):
        check_pieces(pieces, input)
        return base(input, *args)

    return kernel


def _schema(name: str) -> str:
    base = str(getattr(torch.ops.fxfuse, name).default._schema)
    head = f"fxfuse::{name}(Tensor input, "
    assert base.startswith(head), base
    return f"cat_{name}(Tensor[] pieces, Tensor input, {base[len(head) :]}"


def register() -> None:
    """Define the cat_ ops (on the base ops fxfuse._C defines), their kernel, fake kernel and autograd."""
    for name in BASES:
        _LIB.define(_schema(name))
        kernel = _kernel(name)
        _LIB.impl(f"cat_{name}", kernel, "CompositeExplicitAutograd")
        torch.library.register_fake(f"fxfuse::cat_{name}", kernel, lib=_LIB)
        setup, backward = _autograd(name)
        register_autograd(f"fxfuse::cat_{name}", backward, setup_context=setup, lib=_LIB)
