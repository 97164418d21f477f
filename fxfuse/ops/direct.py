"""fxfuse's ops called from Python the way torch's own bindings call ATen's: `call(name)` is
fxfuse._C's direct entry for fxfuse::`name` (csrc/direct_calls.cpp), the dispatcher's typed call,
where `torch.ops.fxfuse.<name>` takes the JIT's boxed path: a few microseconds a call, which the
host spends for every fused site of every step.

Both go through the same dispatcher keys, so they compute the same. Arguments the direct entry does
not take plainly (a Tensor subclass, a `__torch_function__` mode, another Python type than the
schema's) go on to torch.ops from inside it. While dynamo traces, `register()`'s substitutes call
torch.ops, which dynamo knows (fxfuse._C's functions it does not).
"""

from __future__ import annotations

from typing import Callable

import torch

from .. import _extension

__all__ = ["call", "register"]

# The ops with a direct entry in fxfuse._C: the ones the runtime calls for every fused site.
NAMES = (
    "batch_norm_act",
    "conv_bn_act",
    "bn_act_conv",
    "update_running_stats_",
    "conv_act",
    "linear_act",
    "act_linear",
    "act_linear_scale",
    "layer_norm_linear",
    "conv_layer_norm_linear",
)

_calls: dict[str, Callable] = {}


def call(name: str) -> Callable:
    """fxfuse::`name`'s default overload, called positionally: directly where fxfuse._C has the entry."""
    found = _calls.get(name)
    return found if found is not None else getattr(torch.ops.fxfuse, name).default


def register() -> None:
    """Collect fxfuse._C's direct entries, each with its substitute for dynamo (fxfuse._C defines the ops)."""
    for name in NAMES:
        direct = getattr(_extension._C, name)
        overload = getattr(torch.ops.fxfuse, name).default

        def traced(*args, _overload=overload):
            return _overload(*args)

        torch.compiler.substitute_in_graph(direct, skip_signature_check=True)(traced)
        _calls[name] = direct
