"""Python entry points of fxfuse's GELU and layer + activation ops.

* `gelu(x, approximate)` computes `F.gelu(x, approximate=approximate)` with fxfuse's
  hand-written CPU kernels (ATen's elsewhere).
* `linear_act(input, weight, bias, act)` computes `act(F.linear(input, weight, bias))`
  and `conv_act(input, weight, bias, ..., act)` computes `act(F.conv2d(...))`; both
  keep only the layer's input and parameters for backward, which recomputes the
  layer output instead of storing it (one wide activation less per layer).

Under torch.autocast (CPU, CUDA) linear_act / conv_act cast their operands as
autocast casts F.linear / F.conv2d (their Autocast kernels, csrc/autocast/) and gelu
runs in its input's dtype, as F.gelu does. Calls the fused ops cannot serve exactly
(mixed dtypes or devices, tensor subclasses, shapes the layer rejects, ...) run the
eager composition instead, so bad input raises exactly what eager raises.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import has_torch_function

from .. import _extension
from .functional import (AUTOCAST_DEVICES, IntPair, _autocast_on, _check_act, _same_padding, apply_activation, layer_dtype,
                         layer_kernels_apply)

if _extension.loaded():  # the wrappers rely on the ops' fake kernels and autograd formulas
    from . import gelu_op as _gelu_op  # noqa: F401
    from . import linear_conv_act as _linear_conv_act  # noqa: F401

__all__ = ["gelu", "linear_act", "conv_act"]


def _plain(tensor: Tensor, *optional: Optional[Tensor]) -> bool:
    """Tensors (None allowed after the first) without a __torch_function__ override:
    subclasses that have one get the eager ops."""
    tensors = (tensor, *(t for t in optional if t is not None))
    return all(isinstance(t, Tensor) for t in tensors) and not has_torch_function(tensors)


def _fusable(input: Tensor) -> bool:
    """A strided floating-point input, outside autocast or under autocast on a device
    where the fused ops cast as eager autocast does (AUTOCAST_DEVICES)."""
    return (_extension.loaded() and input.is_floating_point() and input.layout == torch.strided
            and not input.is_nested
            and (not _autocast_on(input.device.type) or input.device.type in AUTOCAST_DEVICES))


def gelu(input: Tensor, approximate: str = "none") -> Tensor:
    """`F.gelu(input, approximate=approximate)`."""
    if approximate in ("none", "tanh") and _plain(input) and _fusable(input):
        return torch.ops.fxfuse.gelu(input, approximate=approximate)
    return F.gelu(input, approximate=approximate)


def linear_act(input: Tensor, weight: Tensor, bias: Optional[Tensor] = None, act: str = "gelu",
               act_param: float = 0.0) -> Tensor:
    """`act(F.linear(input, weight, bias))` that keeps only input, weight and bias for backward."""
    _check_act(act)
    if (_plain(input, weight, bias) and weight is not None and _fusable(input)
            and layer_dtype(input, (weight, bias)) is not None and input.dim() >= 1 and weight.dim() == 2
            and input.shape[-1] == weight.shape[1] and (bias is None or tuple(bias.shape) == (weight.shape[0],))):
        return torch.ops.fxfuse.linear_act(input, weight, bias, act, float(act_param))
    return apply_activation(F.linear(input, weight, bias), act, act_param)


def _int_pair(v) -> Optional[list[int]]:
    """v as [int, int] if it is an int or a pair of ints, else None."""
    if type(v) is int:
        return [v, v]
    if isinstance(v, (tuple, list)) and len(v) == 2 and all(type(e) is int for e in v):
        return list(v)
    return None


def conv_act(input: Tensor, weight: Tensor, bias: Optional[Tensor] = None, stride: IntPair = 1,
             padding: Union[IntPair, str] = 0, dilation: IntPair = 1, groups: int = 1, act: str = "gelu",
             act_param: float = 0.0) -> Tensor:
    """`act(F.conv2d(input, weight, bias, stride, padding, dilation, groups))`, memory-saving.

    Backward recomputes the convolution from `input` instead of keeping its output.
    """
    _check_act(act)
    args = _conv_args(input, weight, bias, stride, padding, dilation, groups)
    if args is None:
        return apply_activation(F.conv2d(input, weight, bias, stride, padding, dilation, groups), act, act_param)
    input, stride, padding, dilation = args
    return torch.ops.fxfuse.conv_act(input, weight, bias, stride, padding, dilation, groups, act, float(act_param))


def _conv_args(input, weight, bias, stride, padding, dilation, groups):
    """(input, stride, padding, dilation) for fxfuse::conv_act, or None where eager must run."""
    if not (_plain(input, weight, bias) and weight is not None and layer_kernels_apply(input, (weight, bias))
            and weight.dim() == 4 and type(groups) is int and groups > 0
            and input.shape[1] == weight.shape[1] * groups and weight.shape[0] % groups == 0
            and (bias is None or tuple(bias.shape) == (weight.shape[0],))):
        return None
    stride, dilation = _int_pair(stride), _int_pair(dilation)
    if stride is None or dilation is None or min(stride) <= 0 or min(dilation) <= 0:
        return None
    if isinstance(padding, str):
        if padding == "valid":
            padding = [0, 0]
        elif padding == "same" and stride == [1, 1]:
            input, padding = _same_padding(input, weight, dilation)
        else:  # F.conv2d raises its own error
            return None
    else:
        padding = _int_pair(padding)
        if padding is None or min(padding) < 0:
            return None
    out_hw = [(size + 2 * p - d * (k - 1) - 1) // s + 1
              for size, p, d, k, s in zip(input.shape[2:], padding, dilation, weight.shape[2:], stride)]
    if min(out_hw) <= 0:
        return None
    return input, stride, padding, dilation
