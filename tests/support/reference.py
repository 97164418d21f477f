"""Plain-PyTorch references for the fused ops: the truth the kernels are tested against."""

from __future__ import annotations

import torch.nn.functional as F

from fxfuse.ops.activations import REGISTRY
from fxfuse.ops.checks import apply_activation

# Every activation the fused ops take, with act_param 0.1 where it means something
# (leaky_relu's negative slope): (act, act_param).
ACTS = [(name, 0.1 if spec.takes_param else 0.0) for name, spec in REGISTRY.items()]


def conv_bn_act(
    input,
    weight,
    bias,
    stride,
    padding,
    dilation,
    groups,
    running_mean,
    running_var,
    bn_weight,
    bn_bias,
    training,
    momentum,
    eps,
    act,
    act_param=0.0,
):
    y = F.conv2d(input, weight, bias, stride, padding, dilation, groups)
    y = F.batch_norm(y, running_mean, running_var, bn_weight, bn_bias, training, momentum, eps)
    return apply_activation(y, act, act_param)


def batch_norm_act(input, running_mean, running_var, weight, bias, training, momentum, eps, act, act_param=0.0):
    y = F.batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)
    return apply_activation(y, act, act_param)


def bn_act(input, mean, var, weight, bias, eps, act, act_param=0.0):
    """act(BN-apply(input)) with given statistics (no running-stat update)."""
    y = F.batch_norm(input, mean, var, weight, bias, False, 0.0, eps)
    return apply_activation(y, act, act_param)
