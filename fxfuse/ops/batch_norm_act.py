"""`batch_norm_act`, fxfuse::batch_norm_act(_backward), and the ops it and conv_bn_act build on.

`batch_norm_act(...)` computes exactly `act(F.batch_norm(...))`, updating running
statistics the same way, but keeps only the BN input and the per-channel statistics
for backward, which recomputes the normalized value and the activation input.

Ops: fxfuse::bn_stats, bn_act, bn_act_backward, batch_norm_act, and the in-place
bn_act_ / bn_act_backward_ / bn_act_backward_into_grad_ used inside conv_bn_act and
bn_act_conv (fake kernels only: they are not differentiable). Their fake kernels are
registered here; their Autograd kernels are C++ (csrc/autograd/batch_norm_act.cpp).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from . import compiled, direct, rebuild
from .checks import apply_activation, autocast_on, check_act, fused_call, kernels_apply, stats_like
from .running_stats import update_running_stats

__all__ = ["batch_norm_act"]


def batch_ok(count: int, training: bool) -> bool:
    # F.batch_norm raises "Expected more than 1 value per channel when training"; let eager raise it.
    return not (training and count <= 1)


def batch_norm_act(
    input: Tensor,
    running_mean: Optional[Tensor],
    running_var: Optional[Tensor],
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
    act: str = "none",
    act_param: float = 0.0,
    *,
    pieces: Optional[Sequence[Tensor]] = None,
    rebuildable: bool = False,
) -> Tensor:
    """`act(F.batch_norm(input, ...))` that keeps only `input` and the statistics for backward.

    `pieces`: `input` is `torch.cat(pieces, 1)`; the pieces are kept instead (ops/cat_input.py).
    `rebuildable`: inside a `rebuild.Scope`, an op that keeps the output for backward keeps `input`
    and the statistics instead (ops/rebuild.py)."""
    check_act(act)
    if not kernels_apply(input, (running_mean, running_var, weight, bias)):
        return normalize_act_eager(
            input, running_mean, running_var, weight, bias, training, momentum, eps, act, act_param
        )
    return batch_norm_act_admitted(
        input, running_mean, running_var, weight, bias, training, momentum, eps, act, act_param, pieces, rebuildable
    )


def normalize_act_eager(input, running_mean, running_var, weight, bias, training, momentum, eps, act, act_param):
    """What eager runs (and raises): `act(F.batch_norm(...))`."""
    out = F.batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)
    return apply_activation(out, act, act_param)


def batch_norm_act_admitted(
    input: Tensor,
    running_mean: Optional[Tensor],
    running_var: Optional[Tensor],
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    training: bool,
    momentum: float,
    eps: float,
    act: str,
    act_param: float,
    pieces: Optional[Sequence[Tensor]] = None,
    rebuildable: bool = False,
) -> Tensor:
    """`batch_norm_act` for a call `kernels_apply` admits and a checked `act`: the checks that are
    left, then the op. Rewritten graphs' runtime calls it after their own `kernels_apply`, so that a
    call pays for each check once."""
    shape = (input.shape[1],)
    numel = input.numel()
    if not (
        (running_mean is None or running_mean.shape == shape)
        and (running_var is None or running_var.shape == shape)
        and (weight is None or weight.shape == shape)
        and (bias is None or bias.shape == shape)
        and (training or running_mean is not None)
        and numel > 0
        and not (training and numel // shape[0] <= 1)  # batch_ok: eager raises its error
    ):
        return normalize_act_eager(
            input, running_mean, running_var, weight, bias, training, momentum, eps, act, act_param
        )
    if compiled.enabled and compiled.applies(input):  # under torch.compile: a composition (ops/compiled.py)
        return compiled.compiled_batch_norm_act(
            input, running_mean, running_var, weight, bias, training, momentum, eps, act, act_param
        )
    if pieces:
        op, head = fused_call("batch_norm_act", input, pieces)
    else:
        op, head = _op(), (input,)
    out, mean, var, unbiased_var = op(
        *head, weight, bias, running_mean, running_var, training, eps, act, float(act_param)
    )
    if training and running_mean is not None and running_var is not None:
        update_running_stats(running_mean, running_var, mean, unbiased_var, momentum)
    if (
        rebuildable
        and not pieces
        and rebuild.active()
        and not autocast_on(input.device.type)
        and _keeps_input(input, weight, bias)
    ):
        if not training:  # running statistics, which a later training call updates in place
            mean, var = mean.clone(), var.clone()
        rebuild.register(out, _bn_act, (input, mean, var, weight, bias), (eps, act, float(act_param)))
    return out


def _op():
    """fxfuse::batch_norm_act's overload, called directly where it can be (ops/direct.py)."""
    return direct.call("batch_norm_act")


def _keeps_input(input: Tensor, weight: Optional[Tensor], bias: Optional[Tensor]) -> bool:
    """Whether the op's backward keeps `input` (it records one where something needs a gradient): a recipe
    keeps only what is kept anyway."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (input, weight, bias))


def _bn_act(input, mean, var, weight, bias, eps, act, act_param) -> Tensor:
    """What batch_norm_act's kernel computed, from the statistics it computed: the same bits (ops/rebuild.py)."""
    return torch.ops.fxfuse.bn_act(input, mean, var, weight, bias, eps, act, act_param)


# --------------------------------------------------------------------------- fake kernels


def _bn_stats_fake(input):
    return stats_like(input), stats_like(input), stats_like(input)


def _bn_act_fake(input, mean, var, weight, bias, eps, act, act_param):
    return torch.empty_like(input)


def _bn_act_backward_fake(grad_out, input, mean, var, weight, bias, eps, act, act_param, batch_stats, output_mask):
    return (
        torch.empty_like(input) if output_mask[0] else None,
        torch.empty_like(weight) if output_mask[1] and weight is not None else None,
        torch.empty_like(bias) if output_mask[2] and bias is not None else None,
    )


def _bn_act_inplace_fake(self, mean, var, weight, bias, eps, act, act_param):
    return None


def _bn_act_backward_inplace_fake(
    grad_out, input, mean, var, weight, bias, eps, act, act_param, batch_stats, output_mask
):
    return (
        torch.empty_like(weight) if output_mask[0] and weight is not None else None,
        torch.empty_like(bias) if output_mask[1] and bias is not None else None,
    )


def _batch_norm_act_fake(input, weight, bias, running_mean, running_var, batch_stats, eps, act, act_param):
    return torch.empty_like(input), stats_like(input), stats_like(input), stats_like(input)


def register() -> None:
    """Fake kernels of this module's ops (fxfuse._C defines the ops and their Autograd kernels,
    csrc/autograd/batch_norm_act.cpp)."""
    for name, fake in (
        ("bn_stats", _bn_stats_fake),
        ("bn_act", _bn_act_fake),
        ("bn_act_backward", _bn_act_backward_fake),
        ("bn_act_", _bn_act_inplace_fake),
        ("bn_act_backward_", _bn_act_backward_inplace_fake),
        ("bn_act_backward_into_grad_", _bn_act_backward_inplace_fake),
        ("batch_norm_act", _batch_norm_act_fake),
    ):
        torch.library.register_fake(f"fxfuse::{name}", fake)
