"""Python entry points of the fused ops, with F.batch_norm's semantics.

`conv_bn_act(...)` computes exactly `act(F.batch_norm(F.conv2d(...), ...))`, updating
running statistics the same way, but keeps only the conv input (plus weights and
per-channel statistics) for backward. `batch_norm_act(...)` does the same for
`act(F.batch_norm(...))`, keeping only the BN input.

Under torch.autocast (CPU and CUDA) the fused ops follow eager's precision rules:
their Autocast kernels (csrc/autocast/) cast the convolution's operands as autocast
casts conv2d's, BatchNorm keeps its float32 parameters and statistics, and the
activation runs on the low-precision result.

Calls the fused kernels cannot serve exactly (wrong rank, mixed dtypes eager would
reject, a batch of one value per channel in training, ...) run the eager ops
instead, so bad input raises exactly what eager raises.
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


# Device types for which fxfuse registers Autocast kernels (csrc/autocast/): there the
# fused ops cast as eager autocast does; under autocast on any other device, eager runs.
AUTOCAST_DEVICES = ("cpu", "cuda")
_AUTOCAST_CASTS = (torch.float32, torch.float16, torch.bfloat16)  # what autocast casts (not float64)
_REDUCED = (torch.float16, torch.bfloat16)


def _autocast_on(device_type: str) -> bool:
    # The meta device (fxfuse's shape and memory estimates) has no autocast state to ask.
    return device_type != "meta" and torch.is_autocast_enabled(device_type)


def layer_dtype(input: Tensor, params: Sequence[Optional[Tensor]]) -> Optional[torch.dtype]:
    """The dtype a conv2d / linear of `input` and `params` runs in, as eager runs it, or
    None where the fused ops must not run it (mixed dtypes or devices eager would reject,
    autocast on a device without fxfuse Autocast kernels).

    Under torch.autocast, conv2d and linear are on autocast's lower-precision list: it
    casts float32/float16/bfloat16 operands to the autocast dtype (float64 ones stay).
    """
    device = input.device.type
    if not _autocast_on(device):
        return input.dtype if _all_match(input, params) else None
    if device not in AUTOCAST_DEVICES:
        return None
    low = torch.get_autocast_dtype(device)
    cast = [t.dtype if t.dtype not in _AUTOCAST_CASTS else low
            for t in (input, *params) if t is not None]
    same_device = all(t is None or t.device == input.device for t in params)
    return cast[0] if same_device and all(d == cast[0] for d in cast) else None


def bn_params_apply(dtype: torch.dtype, device: torch.device, params: Sequence[Optional[Tensor]]) -> bool:
    """Whether BatchNorm parameters / running statistics go with an input of `dtype`:
    all of one dtype, the input's or (half / bfloat16 input, as under autocast) float32,
    the combinations eager's batch_norm accepts."""
    given = [t for t in params if t is not None]
    if any(t.device != device for t in given):
        return False
    dtypes = {t.dtype for t in given}
    return not dtypes or dtypes == {dtype} or (dtype in _REDUCED and dtypes == {torch.float32})


def _input_ok(input: Tensor) -> bool:
    return (_extension.loaded() and input.dim() == 4 and input.is_floating_point() and not input.is_complex()
            and not input.is_sparse and not input.is_quantized and input.layout == torch.strided)


def kernels_apply(input: Tensor, bn_params: Sequence[Optional[Tensor]]) -> bool:
    """Whether the BN(+activation) kernels compute `act(F.batch_norm(input, *bn_params))` as
    eager would (else run eager). batch_norm and the activations are on no autocast list,
    so autocast changes nothing here (on the devices fxfuse knows)."""
    if not _input_ok(input):
        return False
    if _autocast_on(input.device.type) and input.device.type not in AUTOCAST_DEVICES:
        return False
    return bn_params_apply(input.dtype, input.device, bn_params)


def layer_kernels_apply(input: Tensor, layer_params: Sequence[Optional[Tensor]],
                        bn_params: Sequence[Optional[Tensor]] = ()) -> bool:
    """Whether a fused conv (-> BN) -> activation op computes this call as eager would,
    autocast included (else run eager)."""
    if not _input_ok(input):
        return False
    dtype = layer_dtype(input, layer_params)
    return dtype is not None and bn_params_apply(dtype, input.device, bn_params)


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
    if not (layer_kernels_apply(input, (weight, bias), bn_params) and weight.dim() == 4
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
