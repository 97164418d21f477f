"""`update_running_stats`: the running-statistics update of the BN ops (batch_norm_act, conv_bn_act,
bn_act_conv) and of their compositions under torch.compile (ops/compiled.py), with the fake kernel of
fxfuse::update_running_stats_. A module of its own so that both import it and neither imports the
other."""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from . import direct

__all__ = ["update_running_stats"]


def update_running_stats(
    running_mean: Tensor, running_var: Tensor, mean: Tensor, unbiased_var: Tensor, momentum: float
) -> None:
    """running = momentum * batch + (1 - momentum) * running, rounded as ATen's CPU batch_norm
    rounds it (batch_norm_cpu_update_stats_template): momentum in the statistics' dtype, the mean
    update in that dtype, the variance's momentum * unbiased_var term in double; half statistics
    are updated in double and rounded once, as eager's are (bfloat16 ones: see the tests).

    In eager, fxfuse::update_running_stats_ does it in one call (4 us for 256 channels, against
    31 for the ATen calls below): a loop with the same roundings on CPU for float and double, the
    same ATen calls from C++ elsewhere. Traced (torch.compile, export) or without fxfuse._C, the
    calls below run."""
    if running_mean.is_meta:  # no values to update (the budget's meta-device counts): ten ops saved per BN
        return
    native = None if torch.compiler.is_compiling() else _native_update()
    if native is not None:
        if mean.requires_grad or unbiased_var.requires_grad:  # the cat_ ops' statistics: no history
            with torch.no_grad():
                native(running_mean, running_var, mean, unbiased_var, momentum)
        else:  # the C++ ops' statistics are non-differentiable outputs
            native(running_mean, running_var, mean, unbiased_var, momentum)
        return
    with torch.no_grad():  # the batch's statistics may require grad: the running ones get no history
        if running_mean.dtype == torch.float16:  # eager: the update in double, one rounding to half
            running_mean.copy_(momentum * mean.double() + (1 - momentum) * running_mean.double())
            running_var.copy_(momentum * unbiased_var.double() + (1 - momentum) * running_var.double())
            return
        m = torch.tensor(momentum, dtype=running_mean.dtype)
        running_mean.copy_(m * mean + (1 - m) * running_mean)
        var_term = m.to(torch.float64) * unbiased_var.to(torch.float64)
        running_var.copy_(var_term + ((1 - m.to(running_var.dtype)) * running_var).to(torch.float64))


@functools.cache
def _native_update():
    """fxfuse::update_running_stats_ (its overload: no overload resolution per call), or None without fxfuse._C.
    Not asked while dynamo traces (it would warn of the cache)."""
    native = hasattr(torch.ops.fxfuse, "update_running_stats_")
    return direct.call("update_running_stats_") if native else None


def _update_running_stats_fake(running_mean, running_var, mean, unbiased_var, momentum):
    return None


def register() -> None:
    """The fake kernel of fxfuse::update_running_stats_ (fxfuse._C defines the op)."""
    torch.library.register_fake("fxfuse::update_running_stats_", _update_running_stats_fake)
