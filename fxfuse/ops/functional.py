"""Python entry points of the fused ops, with F.batch_norm's semantics.

`conv_bn_act(...)` computes exactly `act(F.batch_norm(F.conv2d(...), ...))`, updating
running statistics the same way, but keeps only the conv input (plus weights and
per-channel statistics) for backward. `batch_norm_act(...)` does the same for
`act(F.batch_norm(...))`, keeping only the BN input.

Calls the fused kernels cannot serve exactly (wrong rank or dtype, autocast, a
batch of one value per channel in training, ...) run the eager ops instead, so bad
input raises exactly what eager raises.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _extension

_ACT_FUNCS: dict[str, Callable[[Tensor, float], Tensor]] = {
    "none": lambda x, p: x,
    "relu": lambda x, p: F.relu(x),
    "relu6": lambda x, p: F.relu6(x),
    "leaky_relu": lambda x, p: F.leaky_relu(x, p),
    "gelu": lambda x, p: F.gelu(x),
    "gelu_tanh": lambda x, p: F.gelu(x, approximate="tanh"),
    "silu": lambda x, p: F.silu(x),
    "hardswish": lambda x, p: F.hardswish(x),
}
ACTIVATIONS = tuple(_ACT_FUNCS)

IntPair = Union[int, Sequence[int]]


def apply_activation(x: Tensor, act: str, act_param: float = 0.0) -> Tensor:
    """The eager activation that the fused ops compute (out of place)."""
    return _ACT_FUNCS[act](x, act_param)


def _pair(v: IntPair) -> list[int]:
    return [int(v), int(v)] if isinstance(v, int) else [int(e) for e in v]


def _check_act(act: str) -> None:
    if act not in _ACT_FUNCS:
        raise ValueError(f"fxfuse: unknown activation {act!r}; expected one of {', '.join(ACTIVATIONS)}")


def _same_padding(input: Tensor, weight: Tensor, dilation: list[int]) -> tuple[Tensor, list[int]]:
    """padding='same' as ATen does it: symmetric part as conv padding, the odd remainder padded right."""
    left, extra = [], []
    for k, d in zip(weight.shape[2:], dilation):
        total = d * (k - 1)
        left.append(total // 2)
        extra.append(total - 2 * (total // 2))
    if any(extra):
        input = F.pad(input, [0, extra[1], 0, extra[0]])
    return input, left


def _all_match(ref: Tensor, tensors: Sequence[Optional[Tensor]]) -> bool:
    return all(t is None or (t.dtype == ref.dtype and t.device == ref.device) for t in tensors)


def kernels_apply(input: Tensor, params: Sequence[Optional[Tensor]]) -> bool:
    """Whether the fused kernels compute this call exactly as eager would (else run eager)."""
    if not _extension.loaded():
        return False
    if input.dim() != 4 or not input.is_floating_point() or input.is_complex():
        return False
    if input.device.type != "meta" and torch.is_autocast_enabled(input.device.type):
        return False
    if input.is_sparse or input.is_quantized or input.layout != torch.strided:
        return False
    return _all_match(input, params)


def update_running_stats(running_mean: Tensor, running_var: Tensor, mean: Tensor, var: Tensor,
                         count: int, momentum: float) -> None:
    """running = (1 - momentum) * running + momentum * batch, with the unbiased batch variance."""
    with torch.no_grad():
        unbiased = var * (count / (count - 1)) if count > 1 else var * float("inf")
        running_mean.copy_(momentum * mean.detach() + (1 - momentum) * running_mean)
        running_var.copy_(momentum * unbiased.detach() + (1 - momentum) * running_var)


def _batch_ok(count: int, training: bool) -> bool:
    # F.batch_norm raises "Expected more than 1 value per channel when training"; let eager raise it.
    return not (training and count <= 1)


def conv_bn_act(input: Tensor, weight: Tensor, bias: Optional[Tensor] = None, stride: IntPair = 1,
                padding: Union[IntPair, str] = 0, dilation: IntPair = 1, groups: int = 1,
                running_mean: Optional[Tensor] = None, running_var: Optional[Tensor] = None,
                bn_weight: Optional[Tensor] = None, bn_bias: Optional[Tensor] = None,
                training: bool = False, momentum: float = 0.1, eps: float = 1e-5,
                act: str = "none", act_param: float = 0.0) -> Tensor:
    """`act(F.batch_norm(F.conv2d(input, weight, bias, ...), running_mean, ...))`, memory-saving.

    Backward recomputes the convolution from `input` instead of keeping its output.
    Running statistics are updated in place when `training` and they are given.
    """
    _check_act(act)
    bn_params = (running_mean, running_var, bn_weight, bn_bias)
    if not (kernels_apply(input, (weight, bias, *bn_params)) and weight.dim() == 4
            and input.shape[1] == weight.shape[1] * groups
            and all(t is None or t.shape == (weight.shape[0],) for t in bn_params)
            and (training or running_mean is not None)):
        return _eager_conv_bn_act(input, weight, bias, stride, padding, dilation, groups, running_mean,
                                  running_var, bn_weight, bn_bias, training, momentum, eps, act, act_param)
    dilation = _pair(dilation)
    if isinstance(padding, str):
        if padding == "valid":
            padding = [0, 0]
        elif padding == "same" and _pair(stride) == [1, 1]:
            input, padding = _same_padding(input, weight, dilation)
        else:  # let F.conv2d raise its own error
            return _eager_conv_bn_act(input, weight, bias, stride, padding, dilation, groups, running_mean,
                                      running_var, bn_weight, bn_bias, training, momentum, eps, act, act_param)
    stride, padding = _pair(stride), _pair(padding)
    out_hw = [(size + 2 * p - d * (k - 1) - 1) // s + 1
              for size, p, d, k, s in zip(input.shape[2:], padding, dilation, weight.shape[2:], stride)]
    count = input.shape[0] * out_hw[0] * out_hw[1]
    if min(out_hw) <= 0 or not _batch_ok(count, training):
        return _eager_conv_bn_act(input, weight, bias, stride, padding, dilation, groups, running_mean,
                                  running_var, bn_weight, bn_bias, training, momentum, eps, act, act_param)
    out, mean, var = torch.ops.fxfuse.conv_bn_act(
        input, weight, bias, stride, padding, dilation, groups, bn_weight, bn_bias,
        running_mean, running_var, training, eps, act, float(act_param),
    )
    if training and running_mean is not None and running_var is not None:
        update_running_stats(running_mean, running_var, mean, var, count, momentum)
    return out


def batch_norm_act(input: Tensor, running_mean: Optional[Tensor], running_var: Optional[Tensor],
                   weight: Optional[Tensor] = None, bias: Optional[Tensor] = None, training: bool = False,
                   momentum: float = 0.1, eps: float = 1e-5, act: str = "none",
                   act_param: float = 0.0) -> Tensor:
    """`act(F.batch_norm(input, ...))` that keeps only `input` and the statistics for backward."""
    _check_act(act)
    count = input.numel() // input.shape[1] if input.dim() >= 2 and input.shape[1] else 0
    if not (kernels_apply(input, (running_mean, running_var, weight, bias))
            and all(t is None or t.shape == (input.shape[1],) for t in (running_mean, running_var, weight, bias))
            and (training or running_mean is not None) and _batch_ok(count, training) and input.numel() > 0):
        out = F.batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)
        return apply_activation(out, act, act_param)
    out, mean, var = torch.ops.fxfuse.batch_norm_act(
        input, weight, bias, running_mean, running_var, training, eps, act, float(act_param)
    )
    if training and running_mean is not None and running_var is not None:
        update_running_stats(running_mean, running_var, mean, var, count, momentum)
    return out


def _eager_conv_bn_act(input, weight, bias, stride, padding, dilation, groups, running_mean, running_var,
                       bn_weight, bn_bias, training, momentum, eps, act, act_param):
    y = F.conv2d(input, weight, bias, stride, padding, dilation, groups)
    y = F.batch_norm(y, running_mean, running_var, bn_weight, bn_bias, training, momentum, eps)
    return apply_activation(y, act, act_param)
