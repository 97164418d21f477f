"""`conv_bn_act`, fxfuse::conv_bn_act(_backward).

`conv_bn_act(...)` computes exactly `act(F.batch_norm(F.conv2d(...), ...))`, updating
running statistics the same way, but keeps only the conv input (plus weights and
per-channel statistics) for backward, which recomputes the convolution (inside
fxfuse::conv_bn_act_backward).

Under torch.autocast (CPU and CUDA) the op follows eager's precision rules: its
Autocast kernel (csrc/autocast/) casts the convolution's operands as autocast casts
conv2d's, BatchNorm keeps its float32 parameters and statistics, and the activation
runs on the low-precision result.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from . import compiled, direct
from .batch_norm_act import batch_ok
from .checks import (
    IntPair,
    apply_activation,
    check_act,
    conv_backward_meta,
    conv_geometry,
    conv_meta,
    fused_call,
    layer_kernels_apply,
    stats_like,
)
from .running_stats import update_running_stats

__all__ = ["conv_bn_act"]


def conv_bn_act(
    input: Tensor,
    weight: Tensor,
    bias: Optional[Tensor] = None,
    stride: IntPair = 1,
    padding: Union[IntPair, str] = 0,
    dilation: IntPair = 1,
    groups: int = 1,
    running_mean: Optional[Tensor] = None,
    running_var: Optional[Tensor] = None,
    bn_weight: Optional[Tensor] = None,
    bn_bias: Optional[Tensor] = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
    act: str = "none",
    act_param: float = 0.0,
    *,
    pieces: Optional[Sequence[Tensor]] = None,
) -> Tensor:
    """`act(F.batch_norm(F.conv2d(input, weight, bias, ...), running_mean, ...))`, memory-saving.

    Backward recomputes the convolution from `input` instead of keeping its output.
    Running statistics are updated in place when `training` and they are given.
    `pieces`: `input` is `torch.cat(pieces, 1)`; the pieces are kept instead (ops/cat_input.py).
    """
    check_act(act)
    if not layer_kernels_apply(input, (weight, bias), (running_mean, running_var, bn_weight, bn_bias)):
        return _eager(
            input, weight, bias, stride, padding, dilation, groups, running_mean, running_var, bn_weight, bn_bias,
            training, momentum, eps, act, act_param,
        )  # fmt: skip
    return conv_bn_act_admitted(
        input, weight, bias, stride, padding, dilation, groups, running_mean, running_var, bn_weight, bn_bias,
        training, momentum, eps, act, act_param, pieces,
    )  # fmt: skip


def _eager(
    input, weight, bias, stride, padding, dilation, groups, running_mean, running_var, bn_weight, bn_bias, training,
    momentum, eps, act, act_param,
) -> Tensor:  # fmt: skip
    y = F.conv2d(input, weight, bias, stride, padding, dilation, groups)
    y = F.batch_norm(y, running_mean, running_var, bn_weight, bn_bias, training, momentum, eps)
    return apply_activation(y, act, act_param)


def conv_bn_act_admitted(
    input: Tensor, weight: Tensor, bias: Optional[Tensor], stride: IntPair, padding: Union[IntPair, str],
    dilation: IntPair, groups: int, running_mean: Optional[Tensor], running_var: Optional[Tensor],
    bn_weight: Optional[Tensor], bn_bias: Optional[Tensor], training: bool, momentum: float, eps: float, act: str,
    act_param: float, pieces: Optional[Sequence[Tensor]] = None, geometry: Optional[tuple] = None,
) -> Tensor:  # fmt: skip
    """`conv_bn_act` for a call `layer_kernels_apply` admits and a checked `act`: the checks that are
    left, then the op. Rewritten graphs' runtime calls it after its own `layer_kernels_apply`.
    `geometry`: conv_geometry's answer for this call, where the caller also checked the shapes (the
    runtime's thin path)."""
    given = input
    if geometry is None:
        bn_params = (running_mean, running_var, bn_weight, bn_bias)
        if (
            weight.dim() == 4
            and input.shape[1] == weight.shape[1] * groups
            and _per_channel(bn_params, (weight.shape[0],))
        ):
            geometry = conv_geometry(input, weight, stride, padding, dilation)
    if not (training or running_mean is not None):
        geometry = None
    count = input.shape[0] * geometry[4][0] * geometry[4][1] if geometry else 0
    if geometry is None or not batch_ok(count, training):
        return _eager(
            input, weight, bias, stride, padding, dilation, groups, running_mean, running_var, bn_weight, bn_bias,
            training, momentum, eps, act, act_param,
        )  # fmt: skip
    input, stride, padding, dilation, _ = geometry
    if compiled.enabled and compiled.applies(input):  # under torch.compile: a composition (ops/compiled.py)
        return compiled.compiled_conv_bn_act(
            input, weight, bias, stride, padding, dilation, groups, running_mean, running_var, bn_weight, bn_bias,
            training, momentum, eps, act, act_param,
        )  # fmt: skip
    if pieces:
        op, head = fused_call("conv_bn_act", input, pieces, given)
    else:
        op, head = _op(), (input,)
    out, mean, _, unbiased_var = op(
        *head, weight, bias, stride, padding, dilation, groups, bn_weight, bn_bias, running_mean, running_var,
        training, eps, act, float(act_param),
    )  # fmt: skip
    if training and running_mean is not None and running_var is not None:
        update_running_stats(running_mean, running_var, mean, unbiased_var, momentum)
    return out


def _per_channel(tensors, shape) -> bool:
    for t in tensors:
        if t is not None and t.shape != shape:
            return False
    return True


def _op():
    """fxfuse::conv_bn_act's overload, called directly where it can be (ops/direct.py)."""
    return direct.call("conv_bn_act")


def _conv_bn_act_fake(
    input, weight, bias, stride, padding, dilation, groups, bn_weight, bn_bias, running_mean, running_var,
    batch_stats, eps, act, act_param,
):  # fmt: skip
    y = conv_meta(input, weight, bias, stride, padding, dilation, groups)
    return torch.empty_like(y), stats_like(y), stats_like(y), stats_like(y)


def _conv_bn_act_backward_fake(
    grad_out, input, weight, bias, stride, padding, dilation, groups, bn_weight, bn_bias, mean, var, batch_stats,
    eps, act, act_param, output_mask,
):  # fmt: skip
    grad_input, grad_weight, grad_bias = conv_backward_meta(
        input, weight, bias, stride, padding, dilation, groups, output_mask[:3]
    )
    return (
        grad_input,
        grad_weight,
        grad_bias,
        torch.empty_like(bn_weight) if output_mask[3] and bn_weight is not None else None,
        torch.empty_like(bn_bias) if output_mask[4] and bn_bias is not None else None,
    )


def register() -> None:
    """Fake kernels of this module's ops (fxfuse._C defines the ops and the Autograd kernels of conv_bn_act and
    cat_conv_bn_act, csrc/autograd/conv_bn_act.cpp)."""
    torch.library.register_fake("fxfuse::conv_bn_act", _conv_bn_act_fake)
    torch.library.register_fake("fxfuse::conv_bn_act_backward", _conv_bn_act_backward_fake)
