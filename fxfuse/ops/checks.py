"""What the fxfuse op modules share: applying and checking an activation (activations.py
lists them), and when a fused op may serve a call.

A fused op runs only where it computes exactly what the eager ops compute (same dtypes
and devices eager would accept, autocast casts as eager's, strided floating tensors,
shapes the layer accepts, no torch.func transform or forward AD: ops/higher_order.py);
every other call runs the eager ops, so bad input raises exactly what eager raises.
The fake kernels' shape helpers live here too.
"""

from __future__ import annotations

from numbers import Integral
from typing import Optional, Sequence, Union

import torch
import torch.autograd.forward_ad as forward_ad
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import has_torch_function

from .. import _extension
from .activations import ACTIVATIONS, REGISTRY
from .higher_order import _functorch_active, transformed

IntPair = Union[int, Sequence[int]]

# Device types for which fxfuse registers Autocast kernels (csrc/autocast/): there the
# fused ops cast as eager autocast does; under autocast on any other device, eager runs.
AUTOCAST_DEVICES = ("cpu", "cuda")
_AUTOCAST_CASTS = (torch.float32, torch.float16, torch.bfloat16)  # what autocast casts (not float64)
_REDUCED = (torch.float16, torch.bfloat16)
# Device types whose autocast runs layer_norm in float32 (autocast_mode's float32 list); CPU
# autocast has it on no list, so a bfloat16 input runs with float32 parameters as it is.
_FLOAT32_NORM_DEVICES = ("cuda",)


def apply_activation(x: Tensor, act: str, act_param: float = 0.0) -> Tensor:
    """The eager activation that the fused ops compute (out of place)."""
    return REGISTRY[act].eager(x, act_param)


def check_act(act: str) -> None:
    """The one check of an activation name (wrappers and fake kernels alike; csrc's parse_act words it the same)."""
    torch._check_value(
        act in REGISTRY, lambda: f"fxfuse: unknown activation {act!r}; expected one of {', '.join(ACTIVATIONS)}"
    )


# --------------------------------------------------------------------------- convolution geometry


def int_pair(v) -> Optional[list[int]]:
    """v as [int, int] if it is an int or a pair of ints, else None."""
    if type(v) is int:
        return [v, v]
    if isinstance(v, (tuple, list)) and len(v) == 2 and type(v[0]) is int and type(v[1]) is int:
        return list(v)
    return None


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


def conv_geometry(input: Tensor, weight: Tensor, stride, padding, dilation):
    """(input, stride, padding, dilation, out_hw) as the fused conv ops take them, with padding='same'
    applied as ATen applies it; None where F.conv2d must run (it raises its own errors there)."""
    stride, dilation = int_pair(stride), int_pair(dilation)
    if stride is None or dilation is None or min(stride) <= 0 or min(dilation) <= 0:
        return None
    if isinstance(padding, str):
        if padding == "valid":
            padding = [0, 0]
        elif padding == "same" and stride == [1, 1]:
            input, padding = _same_padding(input, weight, dilation)
        else:
            return None
    else:
        padding = int_pair(padding)
        if padding is None or min(padding) < 0:
            return None
    if input.dim() != 4 or weight.dim() != 4:
        return None
    _, _, h, w = input.shape
    kh, kw = weight.shape[2:]
    out_hw = [
        (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1,
        (w + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1,
    ]
    if out_hw[0] <= 0 or out_hw[1] <= 0:
        return None
    return input, stride, padding, dilation, out_hw


# conv_plan's answers, keyed by everything it reads: a site runs with the same shapes call after call.
_CONV_PLANS: dict[tuple, Optional[tuple]] = {}
_CONV_PLANS_MAX = 4096  # a model whose input sizes keep changing starts over rather than grow without end


def conv_plan(input_shape, weight_shape, stride, padding, dilation, groups) -> Optional[tuple]:
    """(stride, padding, dilation, out_hw) as `conv_geometry` gives them for an input of `input_shape` and a
    weight of `weight_shape`, where the fused ops' shape checks admit them (4-D, `groups` an int that
    divides the input's channels as the weight says) and padding is numbers; else None. Remembered
    per key: the thin path of the runtime's fused calls asks it every call (fusion/runtime.py)."""
    key = (input_shape, weight_shape, stride, padding, dilation, groups)
    try:
        return _CONV_PLANS[key]
    except KeyError:
        pass
    except TypeError:  # a list among them: not remembered, the full checks decide
        return None
    plan = None
    if (
        len(input_shape) == 4
        and len(weight_shape) == 4
        and type(groups) is int
        and groups > 0
        and input_shape[1] == weight_shape[1] * groups
        and int_pair(padding) is not None
    ):
        meta = torch.empty(input_shape, device="meta"), torch.empty(weight_shape, device="meta")
        geometry = conv_geometry(*meta, stride, padding, dilation)
        plan = None if geometry is None else tuple(geometry[1:])
    if len(_CONV_PLANS) >= _CONV_PLANS_MAX:
        _CONV_PLANS.clear()
    _CONV_PLANS[key] = plan
    return plan


def conv_meta(input, weight, bias, stride, padding, dilation, groups) -> Tensor:
    """The convolution's output as the fake kernels see it (ATen's own meta function)."""
    return torch.ops.aten.convolution.default(input, weight, bias, stride, padding, dilation, False, [0, 0], groups)


def conv_backward_meta(input, weight, bias, stride, padding, dilation, groups, output_mask) -> tuple:
    """(grad_input, grad_weight, grad_bias) of the convolution as the fake kernels see them."""
    grad_y = torch.empty_like(conv_meta(input, weight, bias, stride, padding, dilation, groups))
    has_bias = bias is not None
    return torch.ops.aten.convolution_backward.default(
        grad_y,
        input,
        weight,
        list(bias.shape) if has_bias else None,
        stride,
        padding,
        dilation,
        False,
        [0, 0],
        groups,
        [output_mask[0], output_mask[1], output_mask[2] and has_bias],
    )


# --------------------------------------------------------------------------- dtypes, devices, autocast


def autocast_on(device_type: str) -> bool:
    # The meta device (fxfuse's shape and memory estimates) has no autocast state to ask.
    return device_type != "meta" and torch.is_autocast_enabled(device_type)


any_autocast = torch._C._is_any_autocast_enabled


def quiet_modes() -> bool:
    """Whether the extension is loaded and no mode is in effect that the fused calls' checks look for
    beyond their tensors and autocast: forward AD, a torch.func transform, a dynamo trace. The runtime's
    thin path runs only then (fusion/runtime.py); every other call takes the full checks."""
    return (
        _extension._C is not None
        and forward_ad._current_level < 0
        and not _functorch_active()
        and not torch.compiler.is_compiling()
    )


def alike(
    dtype: torch.dtype, device: torch.device, shape: Optional[tuple], tensors: Sequence[Optional[Tensor]]
) -> bool:
    """Whether every tensor given (None: absent) has `dtype`, `device` and, unless it is None, `shape`."""
    for t in tensors:
        if t is not None and (t.dtype is not dtype or t.device != device or (shape is not None and t.shape != shape)):
            return False
    return True


def thin_dtypes(
    input: Tensor,
    layer: Sequence[Optional[Tensor]],
    layer_shape: Optional[tuple],
    norms: Sequence[tuple[Sequence[Optional[Tensor]], tuple]],
    low_input: bool = False,
) -> bool:
    """The runtime's thin path's one pass over a call's tensors (its caller checked `quiet_modes`):
    whether `layer` (a conv's weight, then its bias, of `layer_shape`) and each group of BatchNorm
    tensors in `norms` (tensors, shape) go with `input` as the full checks require, in the common
    cases: outside autocast, every tensor of the input's dtype and device; under autocast on a device
    fxfuse casts for, the layer's tensors (and the input, unless `low_input`: it must then be in the
    autocast dtype already) of a dtype autocast casts, and each BN group all float32 or all of the
    autocast dtype. False sends the call to the full checks, which decide every case."""
    device = input.device
    autocast = any_autocast() and torch.is_autocast_enabled(device.type)
    if autocast:
        if device.type not in AUTOCAST_DEVICES:
            return False
        low = torch.get_autocast_dtype(device.type)
        if (input.dtype is not low) if low_input else (input.dtype not in _AUTOCAST_CASTS):
            return False
    dtype = input.dtype
    # No function calls below: every fused call runs this.
    for i, t in enumerate(layer):
        if t is not None and (
            (t.dtype not in _AUTOCAST_CASTS if autocast else t.dtype is not dtype)
            or t.device != device
            or (i and t.shape != layer_shape)
        ):
            return False
    for group, shape in norms:
        seen = None
        for t in group:
            if t is None:
                continue
            if seen is None:
                seen = t.dtype
                if not ((seen is low or seen is torch.float32) if autocast else seen is dtype):
                    return False
            if t.dtype is not seen or t.device != device or t.shape != shape:
                return False
    return True


_PLAIN_TYPES = (Tensor, torch.nn.Parameter)  # no __torch_function__ of their own
_function_mode = torch._C._is_torch_function_mode_enabled


def thin_plain(input: Tensor, *optional: Optional[Tensor]) -> bool:
    """`plain` for the thin path: a torch.Tensor input and plain tensors (or None) after it, no
    `__torch_function__` mode; False where `plain` may still hold (a subclass without an override)."""
    if type(input) is not Tensor or _function_mode():
        return False
    for t in optional:
        if t is not None and type(t) not in _PLAIN_TYPES:
            return False
    return input.is_floating_point() and input.layout is torch.strided and not input.is_nested


def thin_linear(input: Tensor, weight: Tensor, bias: Optional[Tensor], *others: Optional[Tensor]) -> bool:
    """`linear_fusable` for a call whose caller checked `quiet_modes`, in the common cases (plain tensors
    that `thin_dtypes` admits); False sends the call to `linear_fusable`. `others`: more tensors of the
    call that must be plain too (a layer norm's before the linear), checked in the same pass."""
    return (
        thin_plain(input, weight, bias, *others)
        and weight.dim() == 2
        and input.dim() >= 1
        and input.shape[-1] == weight.shape[1]
        and thin_dtypes(input, (weight, bias), (weight.shape[0],), ())
    )


def thin_conv(input: Tensor, weight: Tensor, bias: Optional[Tensor], stride, padding, dilation, groups):
    """`fusable_conv_geometry` for a call whose caller checked `quiet_modes`, in the common cases (plain
    tensors that `thin_dtypes` admits, a conv plan); None sends the call to `fusable_conv_geometry`."""
    if not thin_plain(input, weight, bias):
        return None
    plan = conv_plan(input.shape, weight.shape, stride, padding, dilation, groups)
    if plan is None or weight.shape[0] % groups or not thin_dtypes(input, (weight, bias), (weight.shape[0],), ()):
        return None
    return (input, *plan)


def _all_match(ref: Tensor, tensors: Sequence[Optional[Tensor]]) -> bool:
    return all(t is None or (t.dtype == ref.dtype and t.device == ref.device) for t in tensors)


def plain(tensor: Tensor, *optional: Optional[Tensor]) -> bool:
    """Tensors (None allowed after the first) without a __torch_function__ override:
    subclasses that have one get the eager ops."""
    tensors = (tensor, *(t for t in optional if t is not None))
    return all(isinstance(t, Tensor) for t in tensors) and not has_torch_function(tensors)


def fusable(input: Tensor) -> bool:
    """A strided floating-point input, outside autocast or under autocast on a device
    where the fused ops cast as eager autocast does (AUTOCAST_DEVICES)."""
    return (
        _extension.loaded()
        and not transformed()
        and input.is_floating_point()
        and input.layout == torch.strided
        and not input.is_nested
        and (not autocast_on(input.device.type) or input.device.type in AUTOCAST_DEVICES)
    )


def pool_input_ok(input) -> bool:
    """Where a pooling op (avg_pool2d, max_pool2d) serves a call as eager does: a tensor that needs a
    gradient, plain and fusable, contiguous or channels_last strides. Pooling is on no autocast list
    (it runs in its input's dtype under autocast), so autocast changes nothing here."""
    return (
        isinstance(input, Tensor)
        and input.requires_grad
        and torch.is_grad_enabled()
        and plain(input)
        and fusable(input)
        and (input.is_contiguous() or (input.dim() == 4 and input.is_contiguous(memory_format=torch.channels_last)))
    )


def int_args(value, empty_ok: bool = False) -> bool:
    """An int, or a list/tuple of one or two ints (or none, with `empty_ok`): what a pooling schema's
    int[2] takes as eager does."""
    if isinstance(value, Integral) and not isinstance(value, bool):
        return True
    return isinstance(value, (list, tuple)) and (
        (empty_ok and len(value) == 0)
        or (len(value) in (1, 2) and all(isinstance(v, Integral) and not isinstance(v, bool) for v in value))
    )


def layer_dtype(input: Tensor, params: Sequence[Optional[Tensor]]) -> Optional[torch.dtype]:
    """The dtype a conv2d / linear of `input` and `params` runs in, as eager runs it, or
    None where the fused ops must not run it (mixed dtypes or devices eager would reject,
    autocast on a device without fxfuse Autocast kernels).

    Under torch.autocast, conv2d and linear are on autocast's lower-precision list: it
    casts float32/float16/bfloat16 operands to the autocast dtype (float64 ones stay).
    """
    device = input.device.type
    if not autocast_on(device):
        return input.dtype if _all_match(input, params) else None
    if device not in AUTOCAST_DEVICES:
        return None
    low = torch.get_autocast_dtype(device)
    cast = [t.dtype if t.dtype not in _AUTOCAST_CASTS else low for t in (input, *params) if t is not None]
    same_device = all(t is None or t.device == input.device for t in params)
    return cast[0] if same_device and all(d == cast[0] for d in cast) else None


def norm_dtype(input: Tensor, params: Sequence[Optional[Tensor]]) -> Optional[torch.dtype]:
    """The dtype of F.layer_norm(input, ..., *params)'s output as eager runs it, or None where the
    fused ops must not run it: outside autocast, parameters of the input's dtype and device; under
    autocast (AUTOCAST_DEVICES), what eager accepts there: on CUDA everything cast to float32
    (float64 stays), on CPU parameters of the input's dtype or, for a half / bfloat16 input (a
    low-precision layer's output), float32 ones."""
    given = [t for t in params if t is not None]
    if any(t.device != input.device for t in given):
        return None
    device = input.device.type
    if not autocast_on(device):
        return input.dtype if all(t.dtype == input.dtype for t in given) else None
    if device not in AUTOCAST_DEVICES:
        return None
    if device in _FLOAT32_NORM_DEVICES:
        cast = [torch.float32 if t.dtype in _AUTOCAST_CASTS else t.dtype for t in (input, *given)]
        return cast[0] if all(d == cast[0] for d in cast) else None
    dtypes = {t.dtype for t in given}
    ok = not dtypes or dtypes == {input.dtype} or (input.dtype in _REDUCED and dtypes == {torch.float32})
    return input.dtype if ok else None


def bn_params_apply(dtype: torch.dtype, device: torch.device, params: Sequence[Optional[Tensor]]) -> bool:
    """Whether BatchNorm parameters / running statistics go with an input of `dtype`:
    all of one dtype, the input's or (half / bfloat16 input, as under autocast) float32,
    the combinations eager's batch_norm accepts. One loop: every fused BN call asks."""
    seen = None
    for t in params:
        if t is None:
            continue
        if t.device != device or (seen is not None and t.dtype != seen):
            return False
        seen = t.dtype
    return seen is None or seen == dtype or (seen == torch.float32 and dtype in _REDUCED)


def _input_ok(input: Tensor) -> bool:
    # Every fused call asks this (with transformed() and the extension check inlined): no helper calls.
    # is_floating_point is false for complex and quantized dtypes, and a strided layout is not sparse.
    return (
        _extension._C is not None
        and input.dim() == 4
        and input.is_floating_point()
        and input.layout == torch.strided
        and forward_ad._current_level < 0
        and not _functorch_active()
    )


def kernels_apply(input: Tensor, bn_params: Sequence[Optional[Tensor]]) -> bool:
    """Whether the BN(+activation) kernels compute `act(F.batch_norm(input, *bn_params))` as
    eager would (else run eager). batch_norm and the activations are on no autocast list,
    so autocast changes nothing here (on the devices fxfuse knows)."""
    if not _input_ok(input):
        return False
    device = input.device
    if device.type != "meta" and torch.is_autocast_enabled(device.type) and device.type not in AUTOCAST_DEVICES:
        return False
    return bn_params_apply(input.dtype, device, bn_params)


def layer_kernels_apply(
    input: Tensor, layer_params: Sequence[Optional[Tensor]], bn_params: Sequence[Optional[Tensor]] = ()
) -> bool:
    """Whether a fused conv (-> BN) -> activation op computes this call as eager would,
    autocast included (else run eager)."""
    return _input_ok(input) and layer_params_apply(input, layer_params, bn_params)


def layer_params_apply(
    input: Tensor, layer_params: Sequence[Optional[Tensor]], bn_params: Sequence[Optional[Tensor]] = ()
) -> bool:
    """`layer_kernels_apply` for an input its caller already checked (`kernels_apply` or
    `layer_kernels_apply` admitted it): the parameters' part."""
    device = input.device
    if device.type == "meta" or not torch.is_autocast_enabled(device.type):
        for t in layer_params:
            if t is not None and (t.dtype != input.dtype or t.device != device):
                return False
        return bn_params_apply(input.dtype, device, bn_params)
    dtype = layer_dtype(input, layer_params)
    return dtype is not None and bn_params_apply(dtype, device, bn_params)


def fusable_conv_geometry(input: Tensor, weight: Tensor, bias: Optional[Tensor], stride, padding, dilation, groups):
    """conv_geometry's (input, stride, padding, dilation, out_hw) when a fused op computes
    F.conv2d(input, weight, bias, stride, padding, dilation, groups) exactly as eager (autocast
    included); None where F.conv2d must run (it raises eager's errors there)."""
    if not (
        plain(input, weight, bias)
        and weight is not None
        and layer_kernels_apply(input, (weight, bias))
        and input.dim() == 4
        and weight.dim() == 4
        and type(groups) is int
        and groups > 0
        and input.shape[1] == weight.shape[1] * groups
        and weight.shape[0] % groups == 0
        and (bias is None or tuple(bias.shape) == (weight.shape[0],))
    ):
        return None
    return conv_geometry(input, weight, stride, padding, dilation)


# --------------------------------------------------------------------------- linear layers


def linear_fusable(input: Tensor, weight: Tensor, bias: Optional[Tensor]) -> bool:
    """Whether the fused linear ops compute F.linear(input, weight, bias) exactly (else the eager composition runs)."""
    return (
        plain(input, weight, bias)
        and weight is not None
        and fusable(input)
        and layer_dtype(input, (weight, bias)) is not None
        and input.dim() >= 1
        and weight.dim() == 2
        and input.shape[-1] == weight.shape[1]
        and (bias is None or tuple(bias.shape) == (weight.shape[0],))
    )


def check_linear(input, weight, bias, op: str) -> None:
    """F.linear's operand shapes, for the fake kernels of the ops holding a linear (one wording)."""
    torch._check(input.dim() >= 1, lambda: f"fxfuse::{op}: expected an input with at least 1 dimension")
    torch._check(
        weight.dim() == 2,
        lambda: (
            f"fxfuse::{op}: expected a 2-D weight of shape (out_features, in_features), got shape {tuple(weight.shape)}"
        ),
    )
    torch._check(
        input.shape[-1] == weight.shape[1],
        lambda: (
            f"fxfuse::{op}: expected the input's last dimension to equal in_features = "
            f"{weight.shape[1]}, got input of shape {tuple(input.shape)}"
        ),
    )
    if bias is not None:
        torch._check(
            bias.dim() == 1 and bias.shape[0] == weight.shape[0],
            lambda: (
                f"fxfuse::{op}: expected a bias of shape [{weight.shape[0]}] (out_features), "
                f"got shape {tuple(bias.shape)}"
            ),
        )


# --------------------------------------------------------------------------- fake kernels


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """Statistics are kept in float32 for half/bfloat16 inputs, else in the input dtype."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def stats_like(input: Tensor) -> Tensor:
    torch._check(input.dim() == 4, lambda: f"fxfuse: expected a 4-D (N, C, H, W) input, got {input.dim()}-D")
    return input.new_empty((input.shape[1],), dtype=stats_dtype(input.dtype))


# --------------------------------------------------------------------------- concatenated inputs


def fused_call(name: str, input: Tensor, pieces: Optional[Sequence[Tensor]], given: Optional[Tensor] = None) -> tuple:
    """(op, leading arguments) of a fused call on `input`: fxfuse::<name>(input, ...), or
    fxfuse::cat_<name>(pieces, input, ...), which keeps the pieces for backward in place of
    `input` (ops/cat_input.py), where the wrapper's caller said that its input `given` (default:
    `input`) is `torch.cat(pieces, 1)` and `input` is still that tensor (not padded or cast
    since). Not under autocast, where the op may keep a cast copy of its input instead."""
    if given is None:
        given = input
    if (
        not pieces
        or input is not given
        or autocast_on(input.device.type)
        or not plain(*pieces)
        or any(p.device != input.device for p in pieces)
    ):
        return getattr(torch.ops.fxfuse, name), (input,)
    return getattr(torch.ops.fxfuse, f"cat_{name}"), (list(pieces), input.detach())
