"""Fake kernels and autograd for fxfuse::linear_act(_backward) and fxfuse::conv_act(_backward).

The autograd formulas save only the layer's input, weight and bias; the backward
ops recompute the pre-activation (the wide linear / conv output) instead of
keeping it.

The fake kernels run the layer's own ATen meta function on the fake inputs: the
real kernels return the layer output (activated in place), so its shape and
strides are the layer's (at::convolution's: channels_last in, channels_last out).
"""
from __future__ import annotations

import torch

from .functional import ACTIVATIONS


def _check_act(act: str) -> None:
    # The same RuntimeError the kernels raise (fxfuse::parse_act).
    torch._check(
        act in ACTIVATIONS,
        lambda: f"fxfuse: unknown activation '{act}'; expected one of {', '.join(ACTIVATIONS)}",
    )


# ---- linear_act ----


def _check_linear(input, weight, bias) -> None:
    torch._check(input.dim() >= 1, lambda: "fxfuse::linear_act: expected an input with at least 1 dimension")
    torch._check(
        weight.dim() == 2,
        lambda: f"fxfuse::linear_act: expected a 2-D weight of shape (out_features, in_features), "
        f"got shape {tuple(weight.shape)}",
    )
    torch._check(
        input.shape[-1] == weight.shape[1],
        lambda: f"fxfuse::linear_act: expected the input's last dimension to equal in_features = "
        f"{weight.shape[1]}, got input of shape {tuple(input.shape)}",
    )
    if bias is not None:
        torch._check(
            bias.dim() == 1 and bias.shape[0] == weight.shape[0],
            lambda: f"fxfuse::linear_act: expected a bias of shape [{weight.shape[0]}] (out_features), "
            f"got shape {tuple(bias.shape)}",
        )


@torch.library.register_fake("fxfuse::linear_act")
def _linear_act_fake(input, weight, bias, act, act_param):
    _check_linear(input, weight, bias)
    _check_act(act)
    return torch.ops.aten.linear.default(input, weight, bias)


@torch.library.register_fake("fxfuse::linear_act_backward")
def _linear_act_backward_fake(grad_out, input, weight, bias, act, act_param, output_mask):
    _check_linear(input, weight, bias)
    _check_act(act)
    # matmul / mm / sum results: fresh contiguous tensors.
    return (
        input.new_empty(input.shape) if output_mask[0] else None,
        weight.new_empty(weight.shape) if output_mask[1] else None,
        bias.new_empty(bias.shape) if output_mask[2] and bias is not None else None,
    )


def _linear_act_setup(ctx, inputs, output):
    input, weight, bias, act, act_param = inputs
    ctx.save_for_backward(input, weight, bias)
    ctx.config = (act, act_param)


def _linear_act_bwd(ctx, grad_out):
    input, weight, bias = ctx.saved_tensors
    act, act_param = ctx.config
    need = ctx.needs_input_grad
    grad_input, grad_weight, grad_bias = torch.ops.fxfuse.linear_act_backward(
        grad_out, input, weight, bias, act, act_param, [need[0], need[1], need[2]]
    )
    return grad_input, grad_weight, grad_bias, None, None


torch.library.register_autograd("fxfuse::linear_act", _linear_act_bwd, setup_context=_linear_act_setup)


# ---- conv_act ----


def _conv(input, weight, bias, stride, padding, dilation, groups):
    return torch.ops.aten.convolution.default(input, weight, bias, stride, padding, dilation, False, [0, 0], groups)


@torch.library.register_fake("fxfuse::conv_act")
def _conv_act_fake(input, weight, bias, stride, padding, dilation, groups, act, act_param):
    _check_act(act)
    return _conv(input, weight, bias, stride, padding, dilation, groups)


@torch.library.register_fake("fxfuse::conv_act_backward")
def _conv_act_backward_fake(grad_out, input, weight, bias, stride, padding, dilation, groups, act, act_param,
                            output_mask):
    _check_act(act)
    has_bias = bias is not None
    if not (output_mask[0] or output_mask[1] or (output_mask[2] and has_bias)):
        return None, None, None
    grad_y = torch.empty_like(_conv(input, weight, bias, stride, padding, dilation, groups))
    return torch.ops.aten.convolution_backward.default(
        grad_y, input, weight, list(bias.shape) if has_bias else None, stride, padding, dilation, False,
        [0, 0], groups, [output_mask[0], output_mask[1], output_mask[2] and has_bias],
    )


def _conv_act_setup(ctx, inputs, output):
    input, weight, bias, stride, padding, dilation, groups, act, act_param = inputs
    ctx.save_for_backward(input, weight, bias)
    ctx.config = (stride, padding, dilation, groups, act, act_param)


def _conv_act_bwd(ctx, grad_out):
    input, weight, bias = ctx.saved_tensors
    stride, padding, dilation, groups, act, act_param = ctx.config
    need = ctx.needs_input_grad
    grad_input, grad_weight, grad_bias = torch.ops.fxfuse.conv_act_backward(
        grad_out, input, weight, bias, stride, padding, dilation, groups, act, act_param,
        [need[0], need[1], need[2]],
    )
    return grad_input, grad_weight, grad_bias, None, None, None, None, None, None


torch.library.register_autograd("fxfuse::conv_act", _conv_act_bwd, setup_context=_conv_act_setup)
