"""`conv2d`: F.conv2d whose backward is fxfuse's (`fxfuse::conv2d` / `fxfuse::conv2d_backward`).

The forward is ATen's convolution, bit for bit, and autograd keeps what eager keeps (input,
weight). The backward is `fxfuse::conv2d_backward`, which every fxfuse op holding a conv runs
too: ATen's convolution_backward, except that on CPU the weight and bias gradients of a
depthwise convolution with a kernel of 5×5 or more (float32; any depthwise kernel in float64)
come from fxfuse's own kernel. oneDNN, which eager runs there, computes that weight gradient
5–50× slower than the input gradient of the same FLOPs (benchmarks/bench_depthwise.py).
fxfuse's kernel sums in float32 too, in a different order: its error against a float64 run is
no worse than eager's beyond float32 rounding (tests/test_ops_conv2d.py holds it to 1.5× eager's or
5e-7, and below eager's at ConvNeXt's size).

Calls the op cannot serve exactly (tensor subclasses, shapes or arguments F.conv2d rejects,
padding="same" with a stride, ...) run F.conv2d, which raises eager's errors; under
torch.autocast the op's Autocast kernel casts as eager autocast casts F.conv2d.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from . import compiled
from .checks import IntPair, conv_backward_meta, conv_meta, fusable_conv_geometry, fused_call

__all__ = ["conv2d"]


def conv2d(
    input: Tensor,
    weight: Tensor,
    bias: Optional[Tensor] = None,
    stride: IntPair = 1,
    padding: Union[IntPair, str] = 0,
    dilation: IntPair = 1,
    groups: int = 1,
    *,
    pieces: Optional[Sequence[Tensor]] = None,
) -> Tensor:
    """`F.conv2d(input, weight, bias, stride, padding, dilation, groups)` with fxfuse's backward.

    `pieces`: `input` is `torch.cat(pieces, 1)`; the pieces are kept instead (ops/cat_input.py)."""
    geometry = fusable_conv_geometry(input, weight, bias, stride, padding, dilation, groups)
    if geometry is None or compiled.applies(geometry[0]):  # compositions: inductor's own convolution
        return F.conv2d(input, weight, bias, stride, padding, dilation, groups)
    given = input
    input, stride, padding, dilation, _ = geometry
    op, head = fused_call("conv2d", input, pieces, given)
    return op(*head, weight, bias, stride, padding, dilation, groups)


def _conv2d_fake(input, weight, bias, stride, padding, dilation, groups):
    return conv_meta(input, weight, bias, stride, padding, dilation, groups)


def _conv2d_backward_fake(grad_out, input, weight, bias, stride, padding, dilation, groups, output_mask):
    return conv_backward_meta(input, weight, bias, stride, padding, dilation, groups, output_mask)


def register() -> None:
    """Fake kernels of conv2d (fxfuse._C defines the ops and the Autograd kernels of conv2d and cat_conv2d)."""
    torch.library.register_fake("fxfuse::conv2d", _conv2d_fake)
    torch.library.register_fake("fxfuse::conv2d_backward", _conv2d_backward_fake)
