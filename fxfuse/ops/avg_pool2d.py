"""`avg_pool2d`: F.avg_pool2d that keeps none of its input for backward (`fxfuse::avg_pool2d`).

Average pooling's gradient spreads each output gradient evenly over its window: it needs the
input's shape, dtype and strides, never its values. Eager's autograd keeps the whole input all
the same (AvgPool2DBackward saves `self`). Where nothing else keeps that tensor (a DenseNet
transition's conv output, ResNet-D's pooled shortcut) the op frees it: the forward is ATen's
avg_pool2d, and the backward is ATen's avg_pool2d_backward run on an uninitialised tensor with
the input's size and strides, which the kernels read for the shape and the memory format only.
Its size is allocated for the moment of the backward, as the gradient it produces is.

A `create_graph=True` backward is ATen's avg_pool2d_backward too, which autograd differentiates
in the gradient (the pooling is linear). Calls the op cannot serve as eager does (no gradient
needed, tensor subclasses, torch.func transforms, autocast, strides neither contiguous nor
channels_last, arguments of the wrong types) run F.avg_pool2d, which raises eager's errors.
"""

from __future__ import annotations

from numbers import Integral
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import compiled
from .checks import int_args, pool_input_ok

__all__ = ["avg_pool2d"]


def _arguments_plain(kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override) -> bool:
    return (
        int_args(kernel_size)
        and (stride is None or int_args(stride, empty_ok=True))
        and int_args(padding)
        and isinstance(ceil_mode, bool)
        and isinstance(count_include_pad, bool)
        and (
            divisor_override is None
            or (isinstance(divisor_override, Integral) and not isinstance(divisor_override, bool))
        )
    )


def avg_pool2d(
    input: Tensor,
    kernel_size,
    stride=None,
    padding=0,
    ceil_mode: bool = False,
    count_include_pad: bool = True,
    divisor_override: Optional[int] = None,
) -> Tensor:
    """`F.avg_pool2d(input, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)`,
    keeping none of `input` for backward."""
    if (
        pool_input_ok(input)
        and not compiled.composing()
        and _arguments_plain(kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)
    ):
        return torch.ops.fxfuse.avg_pool2d(
            input,
            kernel_size,
            [] if stride is None else stride,
            padding,
            ceil_mode,
            count_include_pad,
            divisor_override,
        )
    return F.avg_pool2d(input, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)


def _fake(input, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    return torch.ops.aten.avg_pool2d.default(
        input, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override
    )


def register() -> None:
    """Fake kernel of avg_pool2d (fxfuse._C defines the op and its Autograd kernel)."""
    torch.library.register_fake("fxfuse::avg_pool2d", _fake)
