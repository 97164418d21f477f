"""`conv_act`, fxfuse::conv_act and fxfuse::conv_act_backward.

`conv_act(input, weight, bias, stride, padding, dilation, groups, act)` computes
`act(F.conv2d(...))` and keeps only the layer's input and parameters for backward, whose op
recomputes the pre-activation (the conv output) instead of keeping it.

Under torch.autocast (CPU, CUDA) it casts its operands as autocast casts F.conv2d (its
Autocast kernel, csrc/autocast/). Calls the fused op cannot serve exactly (mixed dtypes or
devices, tensor subclasses, shapes or arguments F.conv2d rejects, ...) run the eager
composition instead, so bad input raises exactly what eager raises. The fake kernels run
at::convolution's own meta function: the real kernel returns the conv output (activated in
place), so its shape and strides are the conv's (channels_last in, channels_last out).
"""

from __future__ import annotations

import functools
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from . import compiled, direct
from .checks import (
    IntPair,
    apply_activation,
    check_act,
    conv_backward_meta,
    conv_meta,
    fusable_conv_geometry,
    quiet_modes,
    thin_conv,
)

__all__ = ["conv_act"]


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
    geometry = thin_conv(input, weight, bias, stride, padding, dilation, groups) if quiet_modes() else None
    if geometry is not None:
        _, stride, padding, dilation, _ = geometry
        return direct.call("conv_act")(input, weight, bias, stride, padding, dilation, groups, act, float(act_param))
    geometry = fusable_conv_geometry(input, weight, bias, stride, padding, dilation, groups)
    if geometry is None:
        return apply_activation(F.conv2d(input, weight, bias, stride, padding, dilation, groups), act, act_param)
    input, stride, padding, dilation, _ = geometry
    if compiled.applies(input):  # under torch.compile: a composition inductor fuses (ops/compiled.py)
        conv = functools.partial(_conv2d, stride=stride, padding=padding, dilation=dilation, groups=groups)
        return compiled.compiled_layer_act(conv, (input, weight, bias), act, act_param)
    return direct.call("conv_act")(input, weight, bias, stride, padding, dilation, groups, act, float(act_param))


def _conv2d(input, weight, bias, *, stride, padding, dilation, groups):
    return F.conv2d(input, weight, bias, stride, padding, dilation, groups)


def _fake(input, weight, bias, stride, padding, dilation, groups, act, act_param):
    check_act(act)
    return conv_meta(input, weight, bias, stride, padding, dilation, groups)


def _backward_fake(grad_out, input, weight, bias, stride, padding, dilation, groups, act, act_param, output_mask):
    check_act(act)
    has_bias = bias is not None
    if not (output_mask[0] or output_mask[1] or (output_mask[2] and has_bias)):
        return None, None, None
    return conv_backward_meta(input, weight, bias, stride, padding, dilation, groups, output_mask)


def register() -> None:
    """Fake kernels of fxfuse::conv_act (fxfuse._C defines the op and its Autograd kernel)."""
    torch.library.register_fake("fxfuse::conv_act", _fake)
    torch.library.register_fake("fxfuse::conv_act_backward", _backward_fake)
