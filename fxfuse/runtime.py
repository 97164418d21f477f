"""Functions that rewritten graphs call for module-form patterns.

They take the user's own Conv2d/BatchNorm2d modules, so parameters, buffers and
`training` flags are read at call time and the modules stay their owners. Calls the
fused kernels cannot serve exactly run the modules themselves (eager semantics and
eager errors).
"""
from __future__ import annotations

from typing import Optional

import torch.nn.functional as F
from torch import Tensor, nn

from .ops import functional


def bn_call_config(bn: nn.BatchNorm2d) -> tuple[Optional[Tensor], Optional[Tensor], bool, float]:
    """(running_mean, running_var, batch_stats, momentum) as _BatchNorm.forward derives them.

    Like _BatchNorm.forward, it counts the batch in num_batches_tracked when training.
    """
    factor = 0.0 if bn.momentum is None else bn.momentum
    if bn.training and bn.track_running_stats and bn.num_batches_tracked is not None:
        bn.num_batches_tracked.add_(1)
        factor = 1.0 / float(bn.num_batches_tracked) if bn.momentum is None else bn.momentum
    batch_stats = bn.training or (bn.running_mean is None and bn.running_var is None)
    use_running = not bn.training or bn.track_running_stats
    running_mean = bn.running_mean if use_running else None
    running_var = bn.running_var if use_running else None
    return running_mean, running_var, batch_stats, factor


def _bn_tensors(bn: nn.BatchNorm2d):
    return bn.weight, bn.bias, bn.running_mean, bn.running_var


def conv_bn_act_module(x: Tensor, conv: nn.Conv2d, bn: nn.BatchNorm2d, act: str, act_param: float) -> Tensor:
    """`act(bn(conv(x)))`, keeping only `x` for backward."""
    if not (functional.layer_kernels_apply(x, (conv.weight, conv.bias), _bn_tensors(bn))
            and x.shape[1] == conv.in_channels and bn.num_features == conv.out_channels):
        return functional.apply_activation(bn(conv(x)), act, act_param)
    padding = conv.padding
    if conv.padding_mode != "zeros":
        x = F.pad(x, conv._reversed_padding_repeated_twice, mode=conv.padding_mode)
        padding = (0, 0)
    running_mean, running_var, batch_stats, momentum = bn_call_config(bn)
    return functional.conv_bn_act(
        x, conv.weight, conv.bias, conv.stride, padding, conv.dilation, conv.groups,
        running_mean, running_var, bn.weight, bn.bias, batch_stats, momentum, bn.eps, act, act_param,
    )


def bn_act_module(x: Tensor, bn: nn.BatchNorm2d, act: str, act_param: float) -> Tensor:
    """`act(bn(x))`, keeping only `x` and the statistics for backward."""
    if not (functional.kernels_apply(x, _bn_tensors(bn)) and x.shape[1] == bn.num_features):
        return functional.apply_activation(bn(x), act, act_param)
    running_mean, running_var, batch_stats, momentum = bn_call_config(bn)
    return functional.batch_norm_act(
        x, running_mean, running_var, bn.weight, bn.bias, batch_stats, momentum, bn.eps, act, act_param
    )
