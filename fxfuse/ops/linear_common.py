"""What the ops that are one linear layer and an activation (`linear_act`, `act_linear`) share:
the wrapper's choice between the op, its torch.compile composition and eager, and the op's fake
kernels (their Autograd kernel: csrc/autograd/linear_function.h). One schema, gradients of the
same shapes; only the eager composition differs."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from . import compiled, direct
from .checks import check_act, check_linear, linear_fusable, quiet_modes, thin_linear


def call_linear_op(op: str, composition: Callable, eager: Callable, input, weight, bias, act: str, act_param: float):
    """fxfuse::`op`(input, weight, bias, act, act_param) where it computes the call exactly; under
    torch.compile `composition(F.linear, ...)`, which inductor fuses (ops/compiled.py); else
    `eager(input, weight, bias, act=..., act_param=...)`, which raises eager's errors."""
    check_act(act)
    if quiet_modes() and thin_linear(input, weight, bias):
        return direct.call(op)(input, weight, bias, act, float(act_param))
    if linear_fusable(input, weight, bias):
        if compiled.applies(input):
            return composition(F.linear, (input, weight, bias), act, act_param)
        return direct.call(op)(input, weight, bias, act, float(act_param))
    return eager(input, weight, bias, act=act, act_param=act_param)


def register_linear_op(op: str, casts_input: bool = False) -> None:
    """Register the fake kernels of fxfuse::`op` (its Autograd kernel is C++: csrc/autograd/); `casts_input`:
    the linear's input is cast to the weight's dtype (act_linear, the form its Autocast kernel calls)."""

    def fake(input, weight, bias, act, act_param):
        check_linear(input, weight, bias, op)
        check_act(act)
        return torch.ops.aten.linear.default(input.to(weight.dtype) if casts_input else input, weight, bias)

    def backward_fake(grad_out, input, weight, bias, act, act_param, output_mask):
        check_linear(input, weight, bias, f"{op}_backward")
        check_act(act)
        # matmul / mm / sum results: fresh contiguous tensors.
        return (
            input.new_empty(input.shape) if output_mask[0] else None,
            weight.new_empty(weight.shape) if output_mask[1] else None,
            bias.new_empty(bias.shape) if output_mask[2] and bias is not None else None,
        )

    torch.library.register_fake(f"fxfuse::{op}", fake)
    torch.library.register_fake(f"fxfuse::{op}_backward", backward_fake)
