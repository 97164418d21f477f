"""Fake kernels and autograd formula of the ops that are one linear layer and an activation
(`linear_act`, `act_linear`): one schema, the same saved tensors (input, weight, bias) and
gradients of the same shapes; only the eager composition differs."""

from __future__ import annotations

import functools
from typing import Callable

import torch

from .checks import check_act, check_linear
from .higher_order import composed_gradients, differentiating


def register_linear_op(op: str, compose: Callable) -> None:
    """Register the fake kernels and autograd of fxfuse::`op`, whose eager composition is
    `compose(input, weight, bias, *, act, act_param)`."""

    def fake(input, weight, bias, act, act_param):
        check_linear(input, weight, bias, op)
        check_act(act)
        return torch.ops.aten.linear.default(input, weight, bias)

    def backward_fake(grad_out, input, weight, bias, act, act_param, output_mask):
        check_linear(input, weight, bias, f"{op}_backward")
        check_act(act)
        # matmul / mm / sum results: fresh contiguous tensors.
        return (
            input.new_empty(input.shape) if output_mask[0] else None,
            weight.new_empty(weight.shape) if output_mask[1] else None,
            bias.new_empty(bias.shape) if output_mask[2] and bias is not None else None,
        )

    def setup(ctx, inputs, output):
        input, weight, bias, act, act_param = inputs
        ctx.save_for_backward(input, weight, bias)
        ctx.config = (act, act_param)

    def bwd(ctx, grad_out):
        input, weight, bias = ctx.saved_tensors
        act, act_param = ctx.config
        need = ctx.needs_input_grad
        if differentiating(grad_out, input, weight, bias):
            grads = composed_gradients(
                functools.partial(compose, act=act, act_param=act_param), (input, weight, bias), need[:3], grad_out
            )
            return (*grads, None, None)
        grad_input, grad_weight, grad_bias = getattr(torch.ops.fxfuse, f"{op}_backward")(
            grad_out, input, weight, bias, act, act_param, [need[0], need[1], need[2]]
        )
        return grad_input, grad_weight, grad_bias, None, None

    torch.library.register_fake(f"fxfuse::{op}", fake)
    torch.library.register_fake(f"fxfuse::{op}_backward", backward_fake)
    torch.library.register_autograd(f"fxfuse::{op}", bwd, setup_context=setup)
