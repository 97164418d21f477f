"""An opt-in alternative for torch.compile: fxfuse's ops as ATen compositions inductor can
fuse, with fxfuse's choice of what backward keeps expressed as a selective-checkpoint policy.

By default torch.compile(fxfuse.optimize(model)) keeps each fused op as one opaque call
(its C++ kernel; dynamo and AOTAutograd use its fake kernel and registered autograd), so
backward keeps exactly what fxfuse eager keeps. With `enabled = True` (set before the
first compiled call: it is read while dynamo traces), the op wrappers (fxfuse.ops.*)
instead call `compiled_*` here while dynamo traces: the same computation written with
ATen ops, run under `torch.utils.checkpoint` with a selective-checkpoint policy
(`create_selective_checkpoint_contexts`). AOTAutograd's partitioner honours the policy's
tags, so backward keeps what fxfuse's eager op keeps:

* the region's inputs (the layer input, parameters, running statistics);
* the per-channel batch statistics (`aten.var_mean`, MUST_SAVE: a reduction not worth
  redoing, C values per channel);

and recomputes everything else (the conv / linear output, the normalised value, the
activation input: MUST_RECOMPUTE), which inductor fuses into its backward kernels.
Running statistics are updated outside the checkpointed region, once per forward, from
the saved batch statistics, with the formula eager fxfuse uses
(`running_stats.update_running_stats`); GELU is F.gelu.

Measured (ResNet-50, batch 8, 224x224, channels_last float32, CPU, 2 threads; one process,
interleaved repeats): train step 0.96x plain torch.compile's with the opaque ops and 1.13x
with this composition, both at the same saved bytes (0.45x plain compile's). Inductor's
generated CPU code for the BN statistics and BN backward is slower than fxfuse's fused
kernels, which also run in place; so it is off by default. It stays for devices or models
where inductor's fusion across ops may win (`fxfuse bench ... --with compile-fxfuse-composed`).

The compositions run only for inputs they compute exactly as the fused op and eager do:
float32 / float64, outside autocast. Other calls keep the fused op.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .checks import apply_activation
from .running_stats import update_running_stats

__all__ = [
    "applies",
    "composing",
    "compiled_act_layer",
    "compiled_batch_norm_act",
    "compiled_conv_bn_act",
    "compiled_layer_act",
    "compiled_layer_norm_linear",
]

_aten = torch.ops.aten
# Saved by backward instead of recomputed: per-channel statistics (C values each).
_MUST_SAVE = frozenset({_aten.var_mean.correction})


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _MUST_SAVE else CheckpointPolicy.MUST_RECOMPUTE


# True: fused ops run the compositions below while dynamo traces (torch.compile re-traces
# when this changes, as dynamo guards on it). Off by default: the opaque ops measured faster.
enabled = False

_CONTEXTS = functools.partial(create_selective_checkpoint_contexts, _policy)
_EXACT_DTYPES = (torch.float32, torch.float64)


def composing() -> bool:
    """Whether dynamo is tracing with the compositions switched on (`enabled`)."""
    return enabled and torch.compiler.is_compiling()


def applies(input: Tensor) -> bool:
    """Whether a fused op's call may run its compile-time composition: under dynamo,
    for float32/float64 input outside autocast (there the composition computes what
    the fused kernels and eager compute, in the same precision)."""
    return composing() and input.dtype in _EXACT_DTYPES and not torch.is_autocast_enabled(input.device.type)


def _recomputed(body, *args):
    """`body(*args)` in a region whose backward keeps only `args` and `_MUST_SAVE` results."""
    return checkpoint(body, *args, use_reentrant=False, context_fn=_CONTEXTS)


def _channel(t: Tensor) -> Tensor:
    return t.reshape(1, -1, 1, 1)


def _normalize_act(
    y: Tensor,
    mean: Tensor,
    var: Tensor,
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    eps: float,
    act: str,
    act_param: float,
) -> Tensor:
    """`act(F.batch_norm(y, ...))` given the statistics: ATen's own batch-norm decomposition."""
    out = (y - _channel(mean)) * _channel(torch.rsqrt(var + eps))
    if weight is not None:
        out = out * _channel(weight)
    if bias is not None:
        out = out + _channel(bias)
    return apply_activation(out, act, act_param)


def _bn_act_body(y, weight, bias, running_mean, running_var, *, batch_stats, eps, act, act_param):
    if batch_stats:
        var, mean = torch.var_mean(y, dim=(0, 2, 3), correction=0)
    else:
        mean, var = running_mean, running_var
    return _normalize_act(y, mean, var, weight, bias, eps, act, act_param), mean, var


def _conv_bn_act_body(
    input, weight, bias, bn_weight, bn_bias, running_mean, running_var, *, conv, batch_stats, eps, act, act_param
):
    y = F.conv2d(input, weight, bias, *conv)
    return _bn_act_body(
        y, bn_weight, bn_bias, running_mean, running_var, batch_stats=batch_stats, eps=eps, act=act, act_param=act_param
    )


def _update(running_mean, running_var, mean, var, count, momentum, batch_stats) -> None:
    if batch_stats and running_mean is not None and running_var is not None:
        update_running_stats(running_mean, running_var, mean, var * (count / (count - 1)), momentum)


def compiled_conv_bn_act(
    input, weight, bias, stride, padding, dilation, groups, running_mean, running_var, bn_weight, bn_bias,
    batch_stats, momentum, eps, act, act_param,
):  # fmt: skip
    """conv_bn_act under torch.compile (geometry already normalized by conv_geometry)."""
    body = functools.partial(
        _conv_bn_act_body,
        conv=(stride, padding, dilation, groups),
        batch_stats=batch_stats,
        eps=eps,
        act=act,
        act_param=act_param,
    )
    out, mean, var = _recomputed(body, input, weight, bias, bn_weight, bn_bias, running_mean, running_var)
    count = out.numel() // out.shape[1]
    _update(running_mean, running_var, mean, var, count, momentum, batch_stats)
    return out


def compiled_batch_norm_act(input, running_mean, running_var, weight, bias, batch_stats, momentum, eps, act, act_param):
    """batch_norm_act under torch.compile: backward keeps the BN input and the statistics."""
    body = functools.partial(_bn_act_body, batch_stats=batch_stats, eps=eps, act=act, act_param=act_param)
    out, mean, var = _recomputed(body, input, weight, bias, running_mean, running_var)
    _update(running_mean, running_var, mean, var, input.numel() // input.shape[1], momentum, batch_stats)
    return out


def _layer_act_body(*args, layer, act, act_param):
    return apply_activation(layer(*args), act, act_param)


def compiled_layer_act(layer, args: tuple, act: str, act_param: float) -> Tensor:
    """`act(layer(*args))` (conv_act, linear_act) under torch.compile: backward keeps only `args`."""
    return _recomputed(functools.partial(_layer_act_body, layer=layer, act=act, act_param=act_param), *args)


def _act_layer_body(input, *args, layer, act, act_param):
    return layer(apply_activation(input, act, act_param), *args)


def compiled_act_layer(layer, args: tuple, act: str, act_param: float) -> Tensor:
    """`layer(act(args[0]), *args[1:])` (act_linear) under torch.compile: backward keeps only `args`."""
    return _recomputed(functools.partial(_act_layer_body, layer=layer, act=act, act_param=act_param), *args)


def _layer_norm_linear_body(input, ln_weight, ln_bias, weight, bias, *, normalized_shape, eps):
    return F.linear(F.layer_norm(input, normalized_shape, ln_weight, ln_bias, eps), weight, bias)


def compiled_layer_norm_linear(input, normalized_shape, ln_weight, ln_bias, eps, weight, bias) -> Tensor:
    """layer_norm_linear under torch.compile: backward keeps only the layer norm's input and the parameters."""
    body = functools.partial(_layer_norm_linear_body, normalized_shape=normalized_shape, eps=eps)
    return _recomputed(body, input, ln_weight, ln_bias, weight, bias)
