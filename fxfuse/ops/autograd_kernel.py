"""Each op's Autograd kernel: what `torch.library.register_autograd` registers, at less cost a call.

`torch.library.register_autograd` wraps the op in an autograd.Function whose forward
redispatches below autograd and then calls `setup_context` on the inputs with the schema's
defaults filled in (`torch._library.utils.fill_defaults`). That fill reads
`op._schema.arguments` once per argument, and each read builds every Argument of the schema
again. For bn_act_conv (24 arguments) torch's kernel cost 194 us a call against 24 us for this
module's (a call with grad enabled less one without, small tensors, 2-core CPU; two more runs
310/99 and 182/20 us: benchmarks/bench_autograd_kernel.py), about 23 ms of a DenseNet-121 train
step (125 calls).

`register_autograd` here registers the same kernel, with the schema read once: the same
autograd.Function structure (forward below autograd, then setup_context; backward the given
function, its gradient count checked), the same no-grad path. torch.compile and AOTAutograd see
an Autograd kernel registered as torch.library registers it.

Tensor lists: an autograd.Function takes tensors only as arguments of their own, so a `Tensor[]`
argument is spliced into the call and regrouped in forward and backward. torch does it with
`torch._library.autograd.supports_tensorlist`, which flattens and unflattens every argument with
pytree, twice a call; for a `Tensor[]` input where the schema says it is (the cat_ ops' pieces),
this module splices by position. For cat_bn_act_conv with four pieces that took the kernel's cost
from 89 to 46 us a call, and a call with its backward from 631 to 538 us (torch's: 224 us and
769 us; benchmarks/bench_autograd_kernel.py --op cat_bn_act_conv, 2-core CPU). Other list
types (`Tensor?[]`, list returns) keep torch's wrapper.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch import _C
from torch._library import utils as library_utils
from torch._library.autograd import supports_tensorlist

__all__ = ["register_autograd"]


@dataclass
class _Call:
    """A call's dispatch key set, keyword-only arguments and tensor lists' lengths: the Function's last argument."""

    keyset: _C.DispatchKeySet
    kwargs: dict
    lengths: tuple[int, ...] = ()


# Libraries the kernels were registered through: an op's kernel lives as long as its library.
_LIBS: dict[str, torch.library.Library] = {}


def register_autograd(
    qualname: str, backward: Callable, setup_context: Callable, lib: Optional[torch.library.Library] = None
) -> None:
    """What `torch.library.register_autograd(qualname, backward, setup_context=setup_context, lib=lib)` does."""
    op = library_utils.lookup_op(qualname)
    schema = op._schema
    arguments = list(schema.arguments)
    positional = [a for a in arguments if not a.kwarg_only]
    keyword_only = [a for a in arguments if a.kwarg_only]
    defaults = [a.default_value if a.has_default_value() else None for a in positional]
    keyword_defaults = {a.name: a.default_value if a.has_default_value() else None for a in keyword_only}
    n_positional = len(positional)
    tensor_list = _C.ListType(_C.TensorType.get())
    lists = tuple(i for i, a in enumerate(positional) if a.type == tensor_list)
    listlike = [a for a in (*arguments, *schema.returns) if library_utils.is_tensorlist_like_type(a.type)]
    spliced = bool(listlike) and len(listlike) == len(lists)

    def below_autograd(keyset, args, kwargs):
        with _C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset & _C._after_autograd_keyset, *args, **kwargs)

    def forward(ctx, *args):
        *args, call = args
        # Every backward here reads only the first output's gradient; the others (batch statistics,
        # pooling offsets) would be materialized as zeros, a fill each (a kernel launch on a GPU).
        ctx.set_materialize_grads(False)
        if spliced:
            args = _regroup(args, lists, call.lengths)
            ctx.fxfuse_lengths = call.lengths
        kwargs = call.kwargs
        result = below_autograd(call.keyset, args, kwargs)
        # The dispatcher drops trailing arguments equal to their defaults: setup_context gets them all.
        inputs = (*args, *defaults[len(args) :])
        if keyword_only:
            setup_context(ctx=ctx, inputs=inputs, keyword_only_inputs={**keyword_defaults, **kwargs}, output=result)
        else:
            setup_context(ctx=ctx, inputs=inputs, output=result)
        return result

    def backward_(ctx, *grads):
        needs_input_grad = ctx.needs_input_grad
        if grads[0] is None:  # only an unused output reached: every input's gradient is zero
            return (None,) * len(needs_input_grad)
        needs = needs_input_grad[:-1]
        if spliced:
            needs = tuple(_regroup(needs, lists, ctx.fxfuse_lengths))
        ctx.needs_input_grad = needs
        try:
            result = backward(ctx, *grads)
        finally:
            ctx.needs_input_grad = needs_input_grad
        given = len(needs)
        result = result if isinstance(result, tuple) else (result,)
        if len(result) not in (given, n_positional):
            raise RuntimeError(
                f"The backward formula for {op} returned an incorrect number of gradients "
                f"(expected {given}, got {len(result)})."
            )
        if any(grad is not None for grad in result[given:]):
            raise RuntimeError(
                f"The backward formula for {op} returned a gradient for an input that was not passed to the operator."
            )
        result = result[:given]
        if spliced:
            result = _splice_grads(result, lists, ctx.fxfuse_lengths, op)
        return (*result, None)

    name = f"GeneratedBackwardFor_{op._namespace}_{op._opname}_{op._overloadname}"
    function = type(
        name, (torch.autograd.Function,), {"forward": staticmethod(forward), "backward": staticmethod(backward_)}
    )
    if listlike and not spliced:
        function = supports_tensorlist(function)

    def kernel(keyset, *args, **kwargs):
        if _C.is_grad_enabled() and _C._any_requires_grad(*args):
            if spliced:
                flat, lengths = _splice(args, lists)
                return function.apply(*flat, _Call(keyset, kwargs, lengths))
            return function.apply(*args, _Call(keyset, kwargs))
        return below_autograd(keyset, args, kwargs)

    namespace, opname = library_utils.parse_namespace(qualname)
    if lib is None:
        lib = _LIBS.setdefault(namespace, torch.library.Library(namespace, "FRAGMENT"))
    lib.impl(opname, kernel, "Autograd", with_keyset=True)


def _splice(args: tuple, lists: tuple[int, ...]) -> tuple[list, tuple[int, ...]]:
    """The call's arguments with each tensor list (at `lists`, where given) spliced in, and the lists' lengths."""
    flat, lengths, start = [], [], 0
    for i in lists:
        if i >= len(args):
            break
        flat.extend(args[start:i])
        flat.extend(args[i])
        lengths.append(len(args[i]))
        start = i + 1
    flat.extend(args[start:])
    return flat, tuple(lengths)


def _regroup(flat: Sequence, lists: tuple[int, ...], lengths: tuple[int, ...]) -> list:
    """`_splice` undone: the spliced items at each list position gathered into a list again."""
    args, at = [], 0
    for i, length in zip(lists, lengths):
        take = i - len(args)
        args.extend(flat[at : at + take])
        args.append(list(flat[at + take : at + take + length]))
        at += take + length
    args.extend(flat[at:])
    return args


def _splice_grads(grads: Sequence, lists: tuple[int, ...], lengths: tuple[int, ...], op) -> list:
    """The backward's gradients spliced as `_splice` splices the call, each list's checked against its
    length first (None for a list stands for a None per tensor)."""
    grads = list(grads)
    for i, length in zip(lists, lengths):
        listed = [None] * length if grads[i] is None else grads[i]
        if not isinstance(listed, (list, tuple)) or len(listed) != length:
            raise RuntimeError(
                f"The backward formula for {op} returned {type(listed).__name__} for a list of {length} tensors; "
                f"expected a list of {length} gradients (or None)."
            )
        grads[i] = listed
    return _splice(grads, lists)[0]
