"""`conv_layer_norm_linear`: `F.linear(F.layer_norm(F.conv2d(input, ...).permute(0, 2, 3, 1), ...),
weight, bias)` that keeps only the conv's input and the parameters for backward.

ConvNeXt's block starts depthwise conv → permute → LayerNorm → fc1. Eager keeps the conv input
(for the conv's weight gradient), the conv output (the layer norm's input) and the layer norm's
output (fc1's input). `layer_norm_linear` drops the last; this op drops the conv output too and
runs the conv again in backward: for a 7×7 depthwise conv, 98 FLOPs per element of a tensor
as wide as the model. Forward is eager's ATen calls, so the output is eager's bit for bit; the
gradients are layer_norm_linear's (eager's bits) and the conv's through `fxfuse::conv2d_backward`.

Under torch.autocast its Autocast kernels cast as eager autocast does: the conv's operands as for
F.conv2d, the layer norm and linear as in `layer_norm_linear`. On CPU the op runs whole on the
conv's low-precision output; CUDA autocast casts that output to float32 for the layer norm, a
copy the op does not make, so there the conv (fxfuse::conv2d) and `layer_norm_linear` run as
two ops, keeping the float32 copy eager keeps. Calls the op cannot serve exactly (tensor
subclasses, mixed dtypes or devices, shapes eager rejects) run the eager composition, which
raises eager's errors.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from . import compiled, direct
from .checks import IntPair, conv_backward_meta, conv_meta, fusable_conv_geometry, layer_dtype
from .layer_norm_linear import _backward_fake as _norm_linear_backward_fake
from .layer_norm_linear import _fake as _norm_linear_fake
from .layer_norm_linear import _fusable as _norm_linear_fusable
from .layer_norm_linear import _last_dim, layer_norm_linear

__all__ = ["conv_layer_norm_linear"]


def _eager(input, conv_weight, conv_bias, stride, padding, dilation, groups, shape, ln_w, ln_b, eps, w, b):
    z = F.conv2d(input, conv_weight, conv_bias, stride, padding, dilation, groups).permute(0, 2, 3, 1)
    return F.linear(F.layer_norm(z, shape, ln_w, ln_b, eps), w, b)


def conv_layer_norm_linear(
    input: Tensor,
    conv_weight: Tensor,
    conv_bias: Optional[Tensor],
    stride: IntPair,
    padding: Union[IntPair, str],
    dilation: IntPair,
    groups: int,
    normalized_shape: Sequence[int],
    ln_weight: Optional[Tensor],
    ln_bias: Optional[Tensor],
    eps: float,
    weight: Tensor,
    bias: Optional[Tensor] = None,
) -> Tensor:
    """The conv → permute → layer norm → linear above, keeping only `input` and the parameters."""
    args = (input, conv_weight, conv_bias, stride, padding, dilation, groups)
    ln_args = (normalized_shape, ln_weight, ln_bias, eps, weight, bias)
    size = _last_dim(normalized_shape)
    geometry = fusable_conv_geometry(input, conv_weight, conv_bias, stride, padding, dilation, groups)
    # The layer norm's input as its checks see it: (N, OH, OW, out_channels), the conv's dtype (autocast's
    # where it casts) and device.
    z_like = None
    if geometry is not None:
        z_like = input.new_empty((1, 1, 1, conv_weight.shape[0]), dtype=layer_dtype(input, (conv_weight, conv_bias)))
    if z_like is None or not _norm_linear_fusable(z_like, size, ln_weight, ln_bias, eps, weight, bias):
        return _eager(*args, *ln_args)
    input, stride, padding, dilation, _ = geometry
    if compiled.applies(input):  # under torch.compile: the conv, then layer_norm_linear's composition
        z = F.conv2d(input, conv_weight, conv_bias, stride, padding, dilation, groups).permute(0, 2, 3, 1)
        return layer_norm_linear(z, [size], ln_weight, ln_bias, eps, weight, bias)
    return direct.call("conv_layer_norm_linear")(
        input, conv_weight, conv_bias, stride, padding, dilation, groups, [size], ln_weight, ln_bias, float(eps),
        weight, bias,
    )  # fmt: skip


def _fake(input, conv_weight, conv_bias, stride, padding, dilation, groups, shape, ln_w, ln_b, eps, w, b):
    z = conv_meta(input, conv_weight, conv_bias, stride, padding, dilation, groups).permute(0, 2, 3, 1)
    return _norm_linear_fake(z, shape, ln_w, ln_b, eps, w, b)


def _backward_fake(grad_out, input, cw, cb, stride, padding, dilation, groups, shape, ln_w, ln_b, eps, w, b, mask):
    z = conv_meta(input, cw, cb, stride, padding, dilation, groups).permute(0, 2, 3, 1)
    conv_mask = [mask[0], mask[1], mask[2] and cb is not None]
    grads = _norm_linear_backward_fake(grad_out, z, shape, ln_w, ln_b, eps, w, b, [any(conv_mask), *mask[3:]])
    conv_grads = (None, None, None)
    if any(conv_mask):
        conv_grads = conv_backward_meta(input, cw, cb, stride, padding, dilation, groups, conv_mask)
        conv_grads = tuple(g if wanted else None for g, wanted in zip(conv_grads, conv_mask))
    return (*conv_grads, *grads[1:])


def register() -> None:
    """Fake kernels of the op (fxfuse._C defines it and its Autograd kernel)."""
    torch.library.register_fake("fxfuse::conv_layer_norm_linear", _fake)
    torch.library.register_fake("fxfuse::conv_layer_norm_linear_backward", _backward_fake)
