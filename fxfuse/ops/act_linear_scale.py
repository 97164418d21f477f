"""`act_linear_scale`, fxfuse::act_linear_scale and fxfuse::act_linear_scale_backward.

`act_linear_scale(input, weight, bias, scale, act)` computes `F.linear(act(input), weight,
bias) * scale` with one scale per output feature (a LayerScale). Eager's multiply keeps the
linear's output for the scale's gradient; the op keeps only input, weight, bias and scale and
gets that gradient from the weight gradient's product.

Under torch.autocast (CPU, CUDA) its Autocast kernels cast as act_linear's do and the op
multiplies by the scale as eager does (type promotion: a float32 scale gives a float32
result); its backward is then eager's, recomputing the linear's output for the scale's
gradient (generic/act_linear_scale.cpp). Outside autocast, a scale of another dtype or device
(type promotion) gets eager's composition, as does every call the fused op cannot serve exactly
(act_linear.py).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import compiled, direct
from .act_linear import act_linear
from .act_linear import eager as _act_linear_eager
from .checks import autocast_on, check_act, check_linear, linear_fusable, plain

__all__ = ["act_linear_scale"]


def act_linear_scale(
    input: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    scale: Tensor,
    act: str = "none",
    act_param: float = 0.0,
) -> Tensor:
    """`F.linear(act(input), weight, bias) * scale`, one scale per output feature (a LayerScale),
    keeping only input, weight, bias and scale for backward (eager's multiply keeps the linear's
    output for the scale's gradient; the op gets that gradient from the weight gradient's product).

    Outside autocast, a scale of another dtype or device (type promotion) gets eager's composition."""
    check_act(act)
    if (
        linear_fusable(input, weight, bias)
        and plain(scale)
        and scale.dim() == 1
        and scale.shape[0] == weight.shape[0]
        and (scale.dtype == input.dtype or (autocast_on(input.device.type) and scale.is_floating_point()))
        and scale.device == input.device
    ):
        if compiled.composing():  # under torch.compile with the compositions: act_linear's, then the multiply
            return act_linear(input, weight, bias, act, act_param) * scale
        return direct.call("act_linear_scale")(input, weight, bias, scale, act, float(act_param))
    return _act_linear_eager(input, weight, bias, act=act, act_param=act_param) * scale


def _check_scale(weight, scale, op: str) -> None:
    torch._check(
        scale.dim() == 1 and scale.shape[0] == weight.shape[0],
        lambda: f"fxfuse::{op}: expected a scale of shape [{weight.shape[0]}], got {tuple(scale.shape)}",
    )


def _fake(input, weight, bias, scale, act, act_param):
    check_linear(input, weight, bias, "act_linear_scale")
    _check_scale(weight, scale, "act_linear_scale")
    check_act(act)
    return torch.ops.aten.mul.Tensor(torch.ops.aten.linear.default(input.to(weight.dtype), weight, bias), scale)


def _backward_fake(grad_out, input, weight, bias, scale, act, act_param, output_mask):
    check_linear(input, weight, bias, "act_linear_scale_backward")
    _check_scale(weight, scale, "act_linear_scale_backward")
    check_act(act)
    return (
        input.new_empty(input.shape) if output_mask[0] else None,
        weight.new_empty(weight.shape) if output_mask[1] else None,
        bias.new_empty(bias.shape) if output_mask[2] and bias is not None else None,
        scale.new_empty(scale.shape) if output_mask[3] else None,
    )


def register() -> None:
    """Fake kernels of fxfuse::act_linear_scale (fxfuse._C defines the op and its Autograd kernel)."""
    torch.library.register_fake("fxfuse::act_linear_scale", _fake)
    torch.library.register_fake("fxfuse::act_linear_scale_backward", _backward_fake)
