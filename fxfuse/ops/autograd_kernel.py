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
function, its gradient count checked), the same tensor-list handling
(`torch._library.autograd.supports_tensorlist`), the same no-grad path. torch.compile and
AOTAutograd see an Autograd kernel registered as torch.library registers it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import _C
from torch._library import utils as library_utils
from torch._library.autograd import supports_tensorlist

__all__ = ["register_autograd"]


@dataclass
class _Call:
    """The dispatch key set and keyword-only arguments of a call: one argument (a pytree leaf) of the Function."""

    keyset: _C.DispatchKeySet
    kwargs: dict


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
    tensorlist = any(library_utils.is_tensorlist_like_type(a.type) for a in (*arguments, *schema.returns))

    def below_autograd(keyset, args, kwargs):
        with _C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset & _C._after_autograd_keyset, *args, **kwargs)

    def forward(ctx, *args):
        *args, call = args
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
        ctx.needs_input_grad = needs_input_grad[:-1]
        try:
            result = backward(ctx, *grads)
        finally:
            ctx.needs_input_grad = needs_input_grad
        given = len(needs_input_grad) - 1
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
        return (*result[:given], None)

    name = f"GeneratedBackwardFor_{op._namespace}_{op._opname}_{op._overloadname}"
    function = type(
        name, (torch.autograd.Function,), {"forward": staticmethod(forward), "backward": staticmethod(backward_)}
    )
    if tensorlist:
        function = supports_tensorlist(function)

    def kernel(keyset, *args, **kwargs):
        if _C.is_grad_enabled() and _C._any_requires_grad(*args):
            return function.apply(*args, _Call(keyset, kwargs))
        return below_autograd(keyset, args, kwargs)

    namespace, opname = library_utils.parse_namespace(qualname)
    if lib is None:
        lib = _LIBS.setdefault(namespace, torch.library.Library(namespace, "FRAGMENT"))
    lib.impl(opname, kernel, "Autograd", with_keyset=True)
