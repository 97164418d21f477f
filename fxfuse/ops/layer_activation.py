"""The layer + activation family: `linear_act`, `conv_act`, `act_linear` and their fxfuse ops.

`linear_act(input, weight, bias, act)` computes `act(F.linear(input, weight, bias))`
and `conv_act(input, weight, bias, ..., act)` computes `act(F.conv2d(...))`; both keep
only the layer's input and parameters for backward, whose ops recompute the
pre-activation (the wide linear / conv output) instead of keeping it.

`act_linear(input, weight, bias, act)` computes `F.linear(act(input), weight, bias)`
the other way round: eager keeps the activation's input for its backward and its
output for the linear's weight gradient; the op keeps only the input and recomputes
the activation (one pointwise pass) for the weight gradient. In a transformer or
ConvNeXt MLP (Linear → GELU → Linear) that is the 4×-wide GELU output, for no
matmul recomputed.

Under torch.autocast (CPU, CUDA) they cast their operands as autocast casts F.linear /
F.conv2d (their Autocast kernels, csrc/autocast/). Calls the fused ops cannot serve
exactly (mixed dtypes or devices, tensor subclasses, shapes the layer rejects, ...)
run the eager composition instead, so bad input raises exactly what eager raises.

The fake kernels run the layer's own ATen meta function on the fake inputs: the real
kernels return the layer output (activated in place), so its shape and strides are
the layer's (at::convolution's: channels_last in, channels_last out).
"""

from __future__ import annotations

import functools
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from . import compiled
from .checks import (
    IntPair,
    apply_activation,
    autocast_on,
    check_act,
    check_linear,
    conv_backward_meta,
    conv_meta,
    fusable_conv_geometry,
    linear_fusable,
    plain,
)
from .higher_order import composed_gradients, differentiating

__all__ = ["act_linear", "act_linear_scale", "conv_act", "linear_act"]


def linear_act(
    input: Tensor, weight: Tensor, bias: Optional[Tensor] = None, act: str = "gelu", act_param: float = 0.0
) -> Tensor:
    """`act(F.linear(input, weight, bias))` that keeps only input, weight and bias for backward."""
    check_act(act)
    if linear_fusable(input, weight, bias):
        if compiled.applies(input):  # under torch.compile: a composition inductor fuses (ops/compiled.py)
            return compiled.compiled_layer_act(F.linear, (input, weight, bias), act, act_param)
        return torch.ops.fxfuse.linear_act(input, weight, bias, act, float(act_param))
    return apply_activation(F.linear(input, weight, bias), act, act_param)


def act_linear(
    input: Tensor, weight: Tensor, bias: Optional[Tensor] = None, act: str = "gelu", act_param: float = 0.0
) -> Tensor:
    """`F.linear(act(input), weight, bias)` that keeps only input, weight and bias for backward."""
    check_act(act)
    if linear_fusable(input, weight, bias):
        if compiled.applies(input):  # under torch.compile: a composition inductor fuses (ops/compiled.py)
            return compiled.compiled_act_layer(F.linear, (input, weight, bias), act, act_param)
        return torch.ops.fxfuse.act_linear(input, weight, bias, act, float(act_param))
    return F.linear(apply_activation(input, act, act_param), weight, bias)


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

    Under autocast, or with a scale of another dtype or device (type promotion), it is eager's
    composition."""
    check_act(act)
    if (
        linear_fusable(input, weight, bias)
        and plain(scale)
        and not autocast_on(input.device.type)
        and scale.dim() == 1
        and scale.shape[0] == weight.shape[0]
        and scale.dtype == input.dtype
        and scale.device == input.device
    ):
        if compiled.composing():  # under torch.compile with the compositions: act_linear's, then the multiply
            return act_linear(input, weight, bias, act, act_param) * scale
        return torch.ops.fxfuse.act_linear_scale(input, weight, bias, scale, act, float(act_param))
    return F.linear(apply_activation(input, act, act_param), weight, bias) * scale


def conv_act(
    input: Tensor,
    weight: Tensor,
    bias: Optional[Tensor] = None,
    stride: IntPair = 1,
    padding: Union[IntPair, str] = 0,
    dilation: IntPair = 1,
    groups: int = 1,
    act: str = "gelu",
    act_param: float = 0.0,
) -> Tensor:
    """`act(F.conv2d(input, weight, bias, stride, padding, dilation, groups))`, memory-saving.

    Backward recomputes the convolution from `input` instead of keeping its output.
    """
    check_act(act)
    geometry = fusable_conv_geometry(input, weight, bias, stride, padding, dilation, groups)
    if geometry is None:
        return apply_activation(F.conv2d(input, weight, bias, stride, padding, dilation, groups), act, act_param)
    input, stride, padding, dilation, _ = geometry
    if compiled.applies(input):  # under torch.compile: a composition inductor fuses (ops/compiled.py)
        conv = functools.partial(_conv2d, stride=stride, padding=padding, dilation=dilation, groups=groups)
        return compiled.compiled_layer_act(conv, (input, weight, bias), act, act_param)
    return torch.ops.fxfuse.conv_act(input, weight, bias, stride, padding, dilation, groups, act, float(act_param))


def _conv2d(input, weight, bias, *, stride, padding, dilation, groups):
    return F.conv2d(input, weight, bias, stride, padding, dilation, groups)


# --------------------------------------------------------------------------- linear_act, act_linear


def _linear_act_eager(input, weight, bias, *, act, act_param):
    return apply_activation(F.linear(input, weight, bias), act, act_param)


def _act_linear_eager(input, weight, bias, *, act, act_param):
    return F.linear(apply_activation(input, act, act_param), weight, bias)


def _linear_family(op: str):
    """Fake kernel, backward fake kernel and autograd formula of `op` (linear_act or act_linear):
    one schema, the same saved tensors (input, weight, bias) and gradients of the same shapes."""
    compose = _linear_act_eager if op == "linear_act" else _act_linear_eager

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

    return fake, backward_fake, setup, bwd


# --------------------------------------------------------------------------- act_linear_scale


def _check_scale(weight, scale, op: str) -> None:
    torch._check(
        scale.dim() == 1 and scale.shape[0] == weight.shape[0],
        lambda: f"fxfuse::{op}: expected a scale of shape [{weight.shape[0]}], got {tuple(scale.shape)}",
    )


def _act_linear_scale_fake(input, weight, bias, scale, act, act_param):
    check_linear(input, weight, bias, "act_linear_scale")
    _check_scale(weight, scale, "act_linear_scale")
    check_act(act)
    return torch.ops.aten.linear.default(input, weight, bias)


def _act_linear_scale_backward_fake(grad_out, input, weight, bias, scale, act, act_param, output_mask):
    check_linear(input, weight, bias, "act_linear_scale_backward")
    _check_scale(weight, scale, "act_linear_scale_backward")
    check_act(act)
    return (
        input.new_empty(input.shape) if output_mask[0] else None,
        weight.new_empty(weight.shape) if output_mask[1] else None,
        bias.new_empty(bias.shape) if output_mask[2] and bias is not None else None,
        scale.new_empty(scale.shape) if output_mask[3] else None,
    )


def _act_linear_scale_setup(ctx, inputs, output):
    input, weight, bias, scale, act, act_param = inputs
    ctx.save_for_backward(input, weight, bias, scale)
    ctx.config = (act, act_param)


def _act_linear_scale_bwd(ctx, grad_out):
    input, weight, bias, scale = ctx.saved_tensors
    act, act_param = ctx.config
    need = ctx.needs_input_grad
    if differentiating(grad_out, input, weight, bias, scale):

        def compose(x, w, b, s):
            return _act_linear_eager(x, w, b, act=act, act_param=act_param) * s

        grads = composed_gradients(compose, (input, weight, bias, scale), need[:4], grad_out)
        return (*grads, None, None)
    grads = torch.ops.fxfuse.act_linear_scale_backward(
        grad_out, input, weight, bias, scale, act, act_param, [need[0], need[1], need[2], need[3]]
    )
    return (*grads, None, None)


# --------------------------------------------------------------------------- conv_act


def _conv_act_fake(input, weight, bias, stride, padding, dilation, groups, act, act_param):
    check_act(act)
    return conv_meta(input, weight, bias, stride, padding, dilation, groups)


def _conv_act_backward_fake(
    grad_out, input, weight, bias, stride, padding, dilation, groups, act, act_param, output_mask
):
    check_act(act)
    has_bias = bias is not None
    if not (output_mask[0] or output_mask[1] or (output_mask[2] and has_bias)):
        return None, None, None
    return conv_backward_meta(input, weight, bias, stride, padding, dilation, groups, output_mask)


def _conv_act_setup(ctx, inputs, output):
    input, weight, bias, stride, padding, dilation, groups, act, act_param = inputs
    ctx.save_for_backward(input, weight, bias)
    ctx.config = (stride, padding, dilation, groups, act, act_param)


def _conv_act_bwd(ctx, grad_out):
    input, weight, bias = ctx.saved_tensors
    stride, padding, dilation, groups, act, act_param = ctx.config
    need = ctx.needs_input_grad
    if differentiating(grad_out, input, weight, bias):

        def compose(x, w, b):
            return apply_activation(F.conv2d(x, w, b, stride, padding, dilation, groups), act, act_param)

        grads = composed_gradients(compose, (input, weight, bias), need[:3], grad_out)
        return (*grads, None, None, None, None, None, None)
    grad_input, grad_weight, grad_bias = torch.ops.fxfuse.conv_act_backward(
        grad_out,
        input,
        weight,
        bias,
        stride,
        padding,
        dilation,
        groups,
        act,
        act_param,
        [need[0], need[1], need[2]],
    )
    return grad_input, grad_weight, grad_bias, None, None, None, None, None, None


def register() -> None:
    """Fake kernels and autograd of this family's ops (fxfuse._C defines the ops)."""
    for op in ("linear_act", "act_linear"):
        fake, backward_fake, setup, bwd = _linear_family(op)
        torch.library.register_fake(f"fxfuse::{op}", fake)
        torch.library.register_fake(f"fxfuse::{op}_backward", backward_fake)
        torch.library.register_autograd(f"fxfuse::{op}", bwd, setup_context=setup)
    torch.library.register_fake("fxfuse::act_linear_scale", _act_linear_scale_fake)
    torch.library.register_fake("fxfuse::act_linear_scale_backward", _act_linear_scale_backward_fake)
    torch.library.register_autograd(
        "fxfuse::act_linear_scale", _act_linear_scale_bwd, setup_context=_act_linear_scale_setup
    )
    torch.library.register_fake("fxfuse::conv_act", _conv_act_fake)
    torch.library.register_fake("fxfuse::conv_act_backward", _conv_act_backward_fake)
    torch.library.register_autograd("fxfuse::conv_act", _conv_act_bwd, setup_context=_conv_act_setup)
