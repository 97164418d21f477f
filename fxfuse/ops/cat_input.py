"""Concatenations rebuilt in backward: fxfuse::cat_batch_norm_act, cat_conv_bn_act, cat_bn_act_conv, cat_conv2d.

`batch_norm_act`, `conv_bn_act`, `bn_act_conv` and `conv2d` keep their input for backward. Where that
input is `torch.cat(pieces, 1)`, they keep a fresh copy of tensors that are often kept anyway: a
DenseNet layer's input is the concatenation of every earlier layer's output, so each layer keeps
its own copy of them all. `cat_<op>` is `<op>` with the pieces kept instead (Pleiss et al.'s
memory-efficient DenseNet): its forward runs `<op>` on the concatenation once the pieces are checked
to make it up (csrc/cat_input.h, a C++ kernel for every device; `check_pieces` here is the fake
kernel's, which handles symbolic shapes); its Autograd kernel is
`<op>`'s C++ one given the pieces (csrc/autograd/<op>.cpp, autograd/function.h), which keeps the
pieces (`save_for_backward`, so saved-tensor hooks see them) and not the concatenation, and whose
backward concatenates them again (`at::cat`: the same values, in the same layout), runs `<op>`'s
backward on that and returns each piece's gradient as eager's cat backward does, a slice of the
input's gradient along dim 1. Exact by construction: the same kernels run on the same values;
running statistics are updated once, by the wrappers, from the op's outputs.

Schema: `cat_<op>(Tensor[] pieces, Tensor input, <op's other arguments>)`, where `input` is
`torch.cat(pieces, 1)`, computed by the caller (the wrappers need it to decide whether the fused
op may serve the call at all) and given no gradient. The wrappers take the pieces as `pieces=`
(`checks.fused_call` picks the op); `cat_batch_norm_act` etc. here are the functional forms.

Second-order gradients go through `<op>`'s backward, which composes eager ops when it runs for a
graph of its own (ops/higher_order.py): the rebuilt concatenation is then itself a differentiable
function of the pieces. The rebuilt cat names its dim in the negative form: under torch.compile,
AOTAutograd's CSE would otherwise merge it with the forward's cat, and its partitioner, which does
not recompute a cat, would keep the concatenation after all (DenseNet-121: twice the saved bytes).
Under torch.func transforms and forward AD the wrappers run eager's ops (checks.fusable). Under
autocast the pieces are not used (checks.fused_call): `<op>` casts its input as eager autocast
does (conv_bn_act), and what it would keep is that cast copy.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

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
    "check_pieces",
]

# The ops that have a cat_ variant (their Autograd kernels serve it: fxfuse._C registers cat_<op>'s).
BASES = ("batch_norm_act", "conv_bn_act", "bn_act_conv", "conv2d")

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
    torch._check(
        input.dim() >= 2,
        lambda: f"fxfuse::cat_*: expected an input of at least 2 dims (N, C, ...), got {input.dim()}-D",
    )
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


def _fake(name: str) -> Callable:
    base = getattr(torch.ops.fxfuse, name).default

    def fake(pieces, input, *args):
        check_pieces(pieces, input)
        return base(input, *args)

    return fake


def _schema(name: str) -> str:
    base = str(getattr(torch.ops.fxfuse, name).default._schema)
    head = f"fxfuse::{name}(Tensor input, "
    assert base.startswith(head), base
    return f"cat_{name}(Tensor[] pieces, Tensor input, {base[len(head) :]}"


def register() -> None:
    """Define the cat_ ops (on the base ops fxfuse._C defines) and their fake kernels (fxfuse._C registers
    their kernels)."""
    for name in BASES:
        _LIB.define(_schema(name))
        torch.library.register_fake(f"fxfuse::cat_{name}", _fake(name), lib=_LIB)
