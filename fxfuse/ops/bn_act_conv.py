"""`bn_act_conv`, fxfuse::bn_act_conv(_backward).

`bn_act_conv(...)` computes exactly `F.conv2d(act(F.batch_norm(input, ...)), ...)`,
updating running statistics the same way, but keeps only the BN input and its
per-channel statistics for backward: the activation output, which the conv keeps in
eager for its weight gradient, is rebuilt in backward by one pointwise pass (the same
fxfuse::bn_act kernel, so the same bits). With `epilogue=True` a second BatchNorm2d (→
activation) follows the conv, and backward recomputes the convolution too, as
conv_bn_act's does: the op then keeps the first BN's input in place of the conv input.

So a BN→act whose output feeds one conv and nothing else costs its output in no
backward: in a ResNet bottleneck, eager keeps each BN input *and* each ReLU output,
these ops keep only the BN inputs, and only the convs whose output would otherwise be
kept (before a residual add) are recomputed.

Under autocast the wrapper casts the conv's weight and bias as autocast would and runs the op
with autocast off, where the BN input is already in the autocast dtype (a conv output under
autocast is); other autocast calls, and every call the fused kernels cannot serve exactly, run
`batch_norm_act` and then the conv (or `conv_bn_act`), which follow eager.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from . import compiled, direct
from .batch_norm_act import batch_norm_act
from .checks import (
    _AUTOCAST_CASTS,
    AUTOCAST_DEVICES,
    IntPair,
    autocast_on,
    check_act,
    conv_backward_meta,
    conv_geometry,
    conv_meta,
    fused_call,
    int_pair,
    kernels_apply,
    layer_kernels_apply,
    stats_like,
)
from .conv_bn_act import conv_bn_act
from .running_stats import update_running_stats

__all__ = ["bn_act_conv"]


def bn_act_conv(
    input: Tensor,
    in_running_mean: Optional[Tensor],
    in_running_var: Optional[Tensor],
    in_weight: Optional[Tensor],
    in_bias: Optional[Tensor],
    in_training: bool,
    in_momentum: float,
    in_eps: float,
    in_act: str,
    in_act_param: float,
    weight: Tensor,
    bias: Optional[Tensor] = None,
    stride: IntPair = 1,
    padding: IntPair = 0,
    dilation: IntPair = 1,
    groups: int = 1,
    *,
    epilogue: bool = False,
    running_mean: Optional[Tensor] = None,
    running_var: Optional[Tensor] = None,
    bn_weight: Optional[Tensor] = None,
    bn_bias: Optional[Tensor] = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
    act: str = "none",
    act_param: float = 0.0,
    pieces: Optional[Sequence[Tensor]] = None,
) -> Tensor:
    """`F.conv2d(in_act(F.batch_norm(input, in_*...)), weight, ...)`, followed with `epilogue` by
    `act(F.batch_norm(·, running_mean, ...))`; keeps only `input` and the statistics for backward.

    Running statistics (both BNs') are updated in place when training and they are given.
    `pieces`: `input` is `torch.cat(pieces, 1)`; the pieces are kept instead (ops/cat_input.py).
    """
    check_act(in_act)
    check_act(act)
    cast = _autocast_conv_operands(input, weight, bias)
    if cast is not None:
        # As eager autocast runs these ops: BN and activation in the input's (low) dtype, the conv
        # on operands cast to it. Cast here, then run the op with autocast off.
        with torch.autocast(input.device.type, enabled=False):
            return bn_act_conv(
                input, in_running_mean, in_running_var, in_weight, in_bias, in_training, in_momentum, in_eps,
                in_act, in_act_param, *cast, stride, padding, dilation, groups, epilogue=epilogue,
                running_mean=running_mean, running_var=running_var, bn_weight=bn_weight, bn_bias=bn_bias,
                training=training, momentum=momentum, eps=eps, act=act, act_param=act_param, pieces=pieces,
            )  # fmt: skip
    in_params = (in_running_mean, in_running_var, in_weight, in_bias)
    bn_params = (running_mean, running_var, bn_weight, bn_bias) if epilogue else ()
    geometry = _geometry(input, in_params, weight, bias, stride, padding, dilation, groups, bn_params)
    return _run(
        geometry, input, in_running_mean, in_running_var, in_weight, in_bias, in_training, in_momentum, in_eps,
        in_act, in_act_param, weight, bias, stride, padding, dilation, groups, epilogue, running_mean, running_var,
        bn_weight, bn_bias, training, momentum, eps, act, act_param, pieces,
    )  # fmt: skip


def bn_act_conv_admitted(
    input, in_running_mean, in_running_var, in_weight, in_bias, in_training, in_momentum, in_eps, in_act,
    in_act_param, weight, bias, stride, padding, dilation, groups, epilogue, running_mean, running_var, bn_weight,
    bn_bias, training, momentum, eps, act, act_param, pieces=None, geometry=None, checked=False,
) -> Tensor:  # fmt: skip
    """`bn_act_conv` for a call its caller already checked as rewritten graphs' runtime does
    (fusion/runtime.py: `kernels_apply` for the first BN, `layer_kernels_apply` for the conv and the
    second BN, matching channels, a conv geometry) with checked activations: the checks left, then
    the op. `geometry`: the caller's `conv_geometry` of this call, if it has it. Under autocast the
    conv's operands are cast as `bn_act_conv` casts them. `checked`: the caller also checked what is
    left here (the runtime's thin path: every dtype and shape), and gives `geometry`."""
    if checked:
        device = input.device.type
        if autocast_on(device):  # the caller checked the dtypes: cast the conv's operands as bn_act_conv does
            low = torch.get_autocast_dtype(device)
            with torch.autocast(device, enabled=False):
                return _run(
                    geometry, input, in_running_mean, in_running_var, in_weight, in_bias, in_training, in_momentum,
                    in_eps, in_act, in_act_param, weight.to(low), None if bias is None else bias.to(low), stride,
                    padding, dilation, groups, epilogue, running_mean, running_var, bn_weight, bn_bias, training,
                    momentum, eps, act, act_param, pieces,
                )  # fmt: skip
        return _run(
            geometry, input, in_running_mean, in_running_var, in_weight, in_bias, in_training, in_momentum, in_eps,
            in_act, in_act_param, weight, bias, stride, padding, dilation, groups, epilogue, running_mean,
            running_var, bn_weight, bn_bias, training, momentum, eps, act, act_param, pieces,
        )  # fmt: skip
    device = input.device.type
    if device != "meta" and torch.is_autocast_enabled(device):
        return bn_act_conv(
            input, in_running_mean, in_running_var, in_weight, in_bias, in_training, in_momentum, in_eps, in_act,
            in_act_param, weight, bias, stride, padding, dilation, groups, epilogue=epilogue,
            running_mean=running_mean, running_var=running_var, bn_weight=bn_weight, bn_bias=bn_bias,
            training=training, momentum=momentum, eps=eps, act=act, act_param=act_param, pieces=pieces,
        )  # fmt: skip
    channels = (input.shape[1],)
    out_channels = (weight.shape[0],)
    if not (
        weight.dim() == 4
        and type(groups) is int
        and groups > 0
        and channels[0] == weight.shape[1] * groups
        and (in_running_mean is None or in_running_mean.shape == channels)
        and (in_running_var is None or in_running_var.shape == channels)
        and (in_weight is None or in_weight.shape == channels)
        and (in_bias is None or in_bias.shape == channels)
        and (bias is None or bias.shape == out_channels)
        and (
            not epilogue
            or (
                (running_mean is None or running_mean.shape == out_channels)
                and (running_var is None or running_var.shape == out_channels)
                and (bn_weight is None or bn_weight.shape == out_channels)
                and (bn_bias is None or bn_bias.shape == out_channels)
            )
        )
        and not isinstance(padding, str)  # "same" may pad the conv input unevenly: see _geometry
    ):
        geometry = None
    elif geometry is None:
        geometry = conv_geometry(input, weight, stride, padding, dilation)
    return _run(
        geometry, input, in_running_mean, in_running_var, in_weight, in_bias, in_training, in_momentum, in_eps,
        in_act, in_act_param, weight, bias, stride, padding, dilation, groups, epilogue, running_mean, running_var,
        bn_weight, bn_bias, training, momentum, eps, act, act_param, pieces,
    )  # fmt: skip


def _run(
    geometry, input, in_running_mean, in_running_var, in_weight, in_bias, in_training, in_momentum, in_eps, in_act,
    in_act_param, weight, bias, stride, padding, dilation, groups, epilogue, running_mean, running_var, bn_weight,
    bn_bias, training, momentum, eps, act, act_param, pieces,
) -> Tensor:  # fmt: skip
    """The op where `geometry` (conv_geometry's, or None) and the batch sizes allow it, else the
    ops it merges, each as it runs alone."""
    in_count = input.numel() // input.shape[1] if geometry else 0
    count = input.shape[0] * geometry[4][0] * geometry[4][1] if geometry else 0
    if (
        geometry is None
        or not (in_training or in_running_mean is not None)
        or (epilogue and not training and running_mean is None)
        or (in_training and in_count <= 1)  # batch_ok: eager raises its error
        or (epilogue and training and count <= 1)
        or (compiled.enabled and compiled.composing())
    ):
        x = batch_norm_act(
            input, in_running_mean, in_running_var, in_weight, in_bias, in_training, in_momentum, in_eps,
            in_act, in_act_param, pieces=pieces,
        )  # fmt: skip
        if not epilogue:
            return F.conv2d(x, weight, bias, stride, padding, dilation, groups)
        return conv_bn_act(
            x, weight, bias, stride, padding, dilation, groups, running_mean, running_var, bn_weight, bn_bias,
            training, momentum, eps, act, act_param,
        )  # fmt: skip
    _, stride, padding, dilation, _ = geometry
    if pieces:
        op, head = fused_call("bn_act_conv", input, pieces)
    else:
        op, head = _op(), (input,)
    out, in_mean, _, in_unbiased_var, mean, _, unbiased_var = op(
        *head, in_weight, in_bias, in_running_mean, in_running_var, in_training, in_eps, in_act,
        float(in_act_param), weight, bias, stride, padding, dilation, groups, epilogue, bn_weight, bn_bias,
        running_mean, running_var, training, eps, act, float(act_param),
    )  # fmt: skip
    if in_training and in_running_mean is not None and in_running_var is not None:
        update_running_stats(in_running_mean, in_running_var, in_mean, in_unbiased_var, in_momentum)
    if epilogue and training and running_mean is not None and running_var is not None:
        update_running_stats(running_mean, running_var, mean, unbiased_var, momentum)
    return out


def _op():
    """fxfuse::bn_act_conv's overload, called directly where it can be (ops/direct.py)."""
    return direct.call("bn_act_conv")


def _autocast_conv_operands(input: Tensor, weight, bias) -> Optional[tuple]:
    """(weight, bias) cast as autocast casts conv2d's, where the op can run this autocast call
    exactly: the BN input already in the autocast dtype (as a conv output under autocast is), so
    the activation output the conv reads needs no cast. None otherwise (or outside autocast)."""
    device = input.device.type
    if not (isinstance(weight, Tensor) and autocast_on(device) and device in AUTOCAST_DEVICES):
        return None
    low = torch.get_autocast_dtype(device)
    if input.dtype != low or any(t is not None and t.dtype not in _AUTOCAST_CASTS for t in (weight, bias)):
        return None
    return weight.to(low), None if bias is None else bias.to(low)


def _geometry(input, in_params, weight, bias, stride, padding, dilation, groups, bn_params):
    """conv_geometry's (input, stride, padding, dilation, out_hw) where the fused op computes this
    call exactly as eager would, else None. Padding must be numbers: padding="same" may pad the
    conv input unevenly, which the op, convolving the BN output it computes, does not do."""
    if not (
        isinstance(weight, Tensor)
        and kernels_apply(input, in_params)
        and not autocast_on(input.device.type)
        and layer_kernels_apply(input, (weight, bias), bn_params)
        and weight.dim() == 4
        and type(groups) is int
        and groups > 0
        and all(t is None or t.shape == (input.shape[1],) for t in in_params)
        and input.shape[1] == weight.shape[1] * groups
        and (bias is None or bias.shape == (weight.shape[0],))
        and all(t is None or t.shape == (weight.shape[0],) for t in bn_params)
        and int_pair(padding) is not None
    ):
        return None
    return conv_geometry(input, weight, stride, padding, dilation)


# --------------------------------------------------------------------------- fake kernels


def _bn_act_conv_fake(
    input, in_weight, in_bias, in_running_mean, in_running_var, in_batch_stats, in_eps, in_act, in_act_param,
    weight, bias, stride, padding, dilation, groups, epilogue, bn_weight, bn_bias, running_mean, running_var,
    batch_stats, eps, act, act_param,
):  # fmt: skip
    y = conv_meta(torch.empty_like(input), weight, bias, stride, padding, dilation, groups)
    if epilogue:
        second = (stats_like(y), stats_like(y), stats_like(y))
    else:
        second = tuple(y.new_empty((0,), dtype=stats_like(y).dtype) for _ in range(3))
    return (torch.empty_like(y), stats_like(input), stats_like(input), stats_like(input), *second)


def _bn_act_conv_backward_fake(
    grad_out, input, in_weight, in_bias, in_mean, in_var, in_batch_stats, in_eps, in_act, in_act_param, weight,
    bias, stride, padding, dilation, groups, epilogue, bn_weight, bn_bias, mean, var, batch_stats, eps, act,
    act_param, output_mask,
):  # fmt: skip
    _, grad_weight, grad_bias = conv_backward_meta(
        torch.empty_like(input), weight, bias, stride, padding, dilation, groups,
        [False, output_mask[3], output_mask[4]],
    )  # fmt: skip

    def like(t, needed):
        return torch.empty_like(t) if needed and t is not None else None

    return (
        like(input, output_mask[0]),
        like(in_weight, output_mask[1]),
        like(in_bias, output_mask[2]),
        grad_weight,
        grad_bias,
        like(bn_weight, epilogue and output_mask[5]),
        like(bn_bias, epilogue and output_mask[6]),
    )


def register() -> None:
    """Fake kernels of this module's ops (fxfuse._C defines the ops and bn_act_conv's Autograd kernel,
    csrc/autograd/bn_act_conv.cpp, which serves cat_bn_act_conv too; FLOPs:
    ops/flops.py)."""
    torch.library.register_fake("fxfuse::bn_act_conv", _bn_act_conv_fake)
    torch.library.register_fake("fxfuse::bn_act_conv_backward", _bn_act_conv_backward_fake)
