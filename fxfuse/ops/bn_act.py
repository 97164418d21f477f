"""Fake kernels and autograd for fxfuse::bn_stats, bn_act, bn_act_backward, batch_norm_act.

bn_act_ and bn_act_backward_ (in-place forms used inside conv_bn_act) get fake kernels
only: they are not differentiable.
"""
from __future__ import annotations

import torch

from . import fake_utils


@torch.library.register_fake("fxfuse::bn_stats")
def _bn_stats_fake(input):
    return fake_utils.stats_like(input), fake_utils.stats_like(input)


@torch.library.register_fake("fxfuse::bn_act")
def _bn_act_fake(input, mean, var, weight, bias, eps, act, act_param):
    return torch.empty_like(input)


@torch.library.register_fake("fxfuse::bn_act_backward")
def _bn_act_backward_fake(grad_out, input, mean, var, weight, bias, eps, act, act_param, batch_stats, output_mask):
    return (
        torch.empty_like(input) if output_mask[0] else None,
        torch.empty_like(weight) if output_mask[1] and weight is not None else None,
        torch.empty_like(bias) if output_mask[2] and bias is not None else None,
    )


@torch.library.register_fake("fxfuse::bn_act_")
def _bn_act_inplace_fake(self, mean, var, weight, bias, eps, act, act_param):
    return None


@torch.library.register_fake("fxfuse::bn_act_backward_")
def _bn_act_backward_inplace_fake(grad_out, input, mean, var, weight, bias, eps, act, act_param, batch_stats,
                                  output_mask):
    return (
        torch.empty_like(weight) if output_mask[0] and weight is not None else None,
        torch.empty_like(bias) if output_mask[1] and bias is not None else None,
    )


@torch.library.register_fake("fxfuse::batch_norm_act")
def _batch_norm_act_fake(input, weight, bias, running_mean, running_var, batch_stats, eps, act, act_param):
    return torch.empty_like(input), fake_utils.stats_like(input), fake_utils.stats_like(input)


def _bn_act_setup(ctx, inputs, output):
    input, mean, var, weight, bias, eps, act, act_param = inputs
    ctx.save_for_backward(input, mean, var, weight, bias)
    ctx.config = (eps, act, act_param)


def _bn_act_bwd(ctx, grad_out):
    input, mean, var, weight, bias = ctx.saved_tensors
    eps, act, act_param = ctx.config
    need = ctx.needs_input_grad
    grad_input, grad_weight, grad_bias = torch.ops.fxfuse.bn_act_backward(
        grad_out, input, mean, var, weight, bias, eps, act, act_param, False, [need[0], need[3], need[4]]
    )
    # Statistics are treated as constants here; batch_norm_act differentiates through them.
    return grad_input, None, None, grad_weight, grad_bias, None, None, None


torch.library.register_autograd("fxfuse::bn_act", _bn_act_bwd, setup_context=_bn_act_setup)


def _batch_norm_act_setup(ctx, inputs, output):
    input, weight, bias, running_mean, running_var, batch_stats, eps, act, act_param = inputs
    _, mean, var = output
    # Only the BN input and the per-channel statistics are kept; the normalized
    # value and the activation input are recomputed in backward.
    ctx.save_for_backward(input, mean, var, weight, bias)
    ctx.config = (batch_stats, eps, act, act_param)


def _batch_norm_act_bwd(ctx, grad_out, _grad_mean, _grad_var):
    input, mean, var, weight, bias = ctx.saved_tensors
    batch_stats, eps, act, act_param = ctx.config
    need = ctx.needs_input_grad
    grad_input, grad_weight, grad_bias = torch.ops.fxfuse.bn_act_backward(
        grad_out, input, mean, var, weight, bias, eps, act, act_param, batch_stats, [need[0], need[1], need[2]]
    )
    return grad_input, grad_weight, grad_bias, None, None, None, None, None, None


torch.library.register_autograd(
    "fxfuse::batch_norm_act", _batch_norm_act_bwd, setup_context=_batch_norm_act_setup
)
