"""`max_pool2d`: F.max_pool2d that keeps one byte per output element for backward (`fxfuse::max_pool2d`).

Max pooling's gradient sends each output gradient to the window position its maximum came from:
it needs those positions and the input's shape, never the input's values. Eager's autograd keeps
the whole input and int64 indices all the same (MaxPool2DWithIndicesBackward saves `self` and
`indices`: 8 bytes per output element besides the input). The op keeps the position inside the
window instead, one byte per output element (`window_offsets`, row * kernel width + column), saved
through `ctx.save_for_backward`. Where nothing else keeps the input (a VoVNet stage's gated output,
pooled by the next stage), the whole input is freed too. The forward is ATen's max pooling, so the
output is eager's; the backward rebuilds ATen's flat indices from the positions and runs ATen's
max_pool2d_with_indices_backward on an uninitialised tensor with the input's size and strides, so
the gradient is eager's bit for bit.

A `create_graph=True` backward is ATen's backward too, which autograd differentiates in the gradient
(a gather by the same indices). Calls the op cannot serve as eager does (no gradient needed, tensor
subclasses, torch.func transforms, autocast, strides neither contiguous nor channels_last,
`return_indices=True`, windows over 256 elements, arguments of the wrong types) run F.max_pool2d,
which raises eager's errors.
"""

from __future__ import annotations

from numbers import Integral

import torch
import torch.nn.functional as F
from torch import Tensor

from . import compiled
from .checks import int_args, pool_input_ok

__all__ = ["max_pool2d"]

# The positions inside a window are stored in one byte (uint8).
MAX_WINDOW = 256


def _pair(value, default: list[int]) -> list[int]:
    if isinstance(value, Integral):
        return [int(value)] * 2
    if value is None or len(value) == 0:
        return default
    return [int(value[0]), int(value[-1])]


def _small_window(kernel_size) -> bool:
    kh, kw = _pair(kernel_size, [0, 0])
    return kh * kw <= MAX_WINDOW


def max_pool2d(
    input: Tensor,
    kernel_size,
    stride=None,
    padding=0,
    dilation=1,
    ceil_mode: bool = False,
    return_indices: bool = False,
) -> Tensor:
    """`F.max_pool2d(input, kernel_size, stride, padding, dilation, ceil_mode, return_indices)`,
    keeping for backward one byte per output element instead of the input and int64 indices."""
    if (
        not return_indices
        and pool_input_ok(input)
        and not compiled.composing()
        and int_args(kernel_size)
        and (stride is None or int_args(stride, empty_ok=True))
        and int_args(padding)
        and int_args(dilation)
        and isinstance(ceil_mode, bool)
        and _small_window(kernel_size)
    ):
        output, _ = torch.ops.fxfuse.max_pool2d(
            input, kernel_size, [] if stride is None else stride, padding, dilation, ceil_mode
        )
        return output
    return F.max_pool2d(input, kernel_size, stride, padding, dilation, ceil_mode, return_indices)


def _fake(input, kernel_size, stride, padding, dilation, ceil_mode):
    output, indices = torch.ops.aten.max_pool2d_with_indices.default(
        input, kernel_size, stride, padding, dilation, ceil_mode
    )
    return output, torch.empty_like(indices, dtype=torch.uint8)


def _indices_fake(window_offsets, input_width, kernel_size, stride, padding, dilation):
    return torch.empty_like(window_offsets, dtype=torch.int64)


def register() -> None:
    """Fake kernels of max_pool2d and max_pool2d_indices (fxfuse._C defines the ops and their Autograd kernel)."""
    torch.library.register_fake("fxfuse::max_pool2d", _fake)
    torch.library.register_fake("fxfuse::max_pool2d_indices", _indices_fake)
