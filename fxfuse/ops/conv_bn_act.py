"""Fake kernels and autograd for fxfuse::conv_bn_act(_backward).

The autograd formula saves only the conv input, the weights and the per-channel
statistics; backward recomputes the convolution (inside conv_bn_act_backward).
"""
from __future__ import annotations

import torch

from . import fake_utils


def _conv(input, weight, bias, stride, padding, dilation, groups):
    return torch.ops.aten.convolution(input, weight, bias, stride, padding, dilation, False, [0, 0], groups)


@torch.library.register_fake("fxfuse::conv_bn_act")
def _conv_bn_act_fake(input, weight, bias, stride, padding, dilation, groups, bn_weight, bn_bias,
                      running_mean, running_var, batch_stats, eps, act, act_param):
    y = _conv(input, weight, bias, stride, padding, dilation, groups)
    return torch.empty_like(y), fake_utils.stats_like(y), fake_utils.stats_like(y)


@torch.library.register_fake("fxfuse::conv_bn_act_backward")
def _conv_bn_act_backward_fake(grad_out, input, weight, bias, stride, padding, dilation, groups, bn_weight,
                               bn_bias, mean, var, batch_stats, eps, act, act_param, output_mask):
    y = _conv(input, weight, bias, stride, padding, dilation, groups)
    grad_y = torch.empty_like(y)
    has_bias = bias is not None
    grad_input, grad_weight, grad_bias = torch.ops.aten.convolution_backward(
        grad_y, input, weight, list(bias.shape) if has_bias else None, stride, padding, dilation, False,
        [0, 0], groups, [output_mask[0], output_mask[1], output_mask[2] and has_bias],
    )
    return (
        grad_input,
        grad_weight,
        grad_bias,
        torch.empty_like(bn_weight) if output_mask[3] and bn_weight is not None else None,
        torch.empty_like(bn_bias) if output_mask[4] and bn_bias is not None else None,
    )


def _setup(ctx, inputs, output):
    (input, weight, bias, stride, padding, dilation, groups, bn_weight, bn_bias,
     _running_mean, _running_var, batch_stats, eps, act, act_param) = inputs
    _, mean, var = output
    ctx.save_for_backward(input, weight, bias, bn_weight, bn_bias, mean, var)
    ctx.config = (stride, padding, dilation, groups, batch_stats, eps, act, act_param)


def _backward(ctx, grad_out, _grad_mean, _grad_var):
    input, weight, bias, bn_weight, bn_bias, mean, var = ctx.saved_tensors
    stride, padding, dilation, groups, batch_stats, eps, act, act_param = ctx.config
    need = ctx.needs_input_grad
    grads = torch.ops.fxfuse.conv_bn_act_backward(
        grad_out, input, weight, bias, stride, padding, dilation, groups, bn_weight, bn_bias, mean, var,
        batch_stats, eps, act, act_param, [need[0], need[1], need[2], need[7], need[8]],
    )
    grad_input, grad_weight, grad_bias, grad_bn_weight, grad_bn_bias = grads
    return (grad_input, grad_weight, grad_bias, None, None, None, None, grad_bn_weight, grad_bn_bias,
            None, None, None, None, None, None)


torch.library.register_autograd("fxfuse::conv_bn_act", _backward, setup_context=_setup)
