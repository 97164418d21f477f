"""Functions that rewritten graphs call for module-form patterns (and `add_into`).

Every module-form site calls one of the `*_module` functions here with the user's own
modules (Conv2d, BatchNorm2d, Linear), so parameters, buffers, padding and `training`
flags are read at call time, the same way for every pattern, and the modules stay
their owners. Functional-form sites call the ops in fxfuse.ops directly. Calls the
fused kernels cannot serve exactly run the modules themselves (eager semantics and
eager errors). Also `gelu_where_faster`, which rewritten standalone GELUs call.
"""

from __future__ import annotations

import functools
import platform
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import ops
from ..ops.batch_norm_act import batch_norm_act_admitted
from ..ops.bn_act_conv import bn_act_conv_admitted
from ..ops.checks import (
    apply_activation,
    conv_geometry,
    conv_plan,
    kernels_apply,
    layer_kernels_apply,
    layer_params_apply,
    quiet_modes,
    thin_dtypes,
)
from ..ops.conv_bn_act import conv_bn_act_admitted
from .known_modules import is_conv2d_same, is_norm_act, pad_same


def bn_call_config(
    bn: nn.BatchNorm2d, running_mean: Optional[Tensor], running_var: Optional[Tensor]
) -> tuple[Optional[Tensor], Optional[Tensor], bool, float]:
    """(running_mean, running_var, batch_stats, momentum) as _BatchNorm.forward derives them from its
    flags and the running statistics `bn_tensors` read.

    Like _BatchNorm.forward, it counts the batch in num_batches_tracked when training.
    """
    momentum = bn.momentum
    factor = 0.0 if momentum is None else momentum
    training = bn.training
    if training and bn.track_running_stats:
        plain = _PLAIN_CLASSES.get((type(bn), _BN_STATE))
        if plain is None:
            plain = _plain_class(type(bn), _BN_STATE)
        count = bn._buffers.get("num_batches_tracked") if plain else bn.num_batches_tracked
        if count is not None:
            count.add_(1)
            if momentum is None:
                factor = 1.0 / float(count)
    batch_stats = training or (running_mean is None and running_var is None)
    if training and not bn.track_running_stats:
        running_mean = running_var = None
    return running_mean, running_var, batch_stats, factor


_BN_STATE = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")
_LAYER_STATE = ("weight", "bias")


# _plain_class's answers. A dict the callers read first, not functools.cache: dynamo traces a dict
# lookup, and warns at every cached function it meets (torch.compile(fxfuse.optimize(model))).
_PLAIN_CLASSES: dict[tuple[type, tuple[str, ...]], bool] = {}


def _plain_class(cls: type, names: tuple[str, ...]) -> bool:
    """Whether a module class has no class attribute or property named as any of `names` (a
    parametrization's class has one), so that reading them from `_parameters` / `_buffers` is what
    `getattr` reads, at a fraction of nn.Module.__getattr__'s cost: every fused call reads several.
    Callers look in `_PLAIN_CLASSES` first."""
    plain = _PLAIN_CLASSES[(cls, names)] = not any(hasattr(cls, name) for name in names)
    return plain


def bn_tensors(bn: nn.BatchNorm2d) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """(weight, bias, running_mean, running_var) of `bn`, as its forward reads them: from its tables where
    they are there and nothing else answers to those names."""
    params, buffers = bn._parameters, bn._buffers
    plain = _PLAIN_CLASSES.get((type(bn), _BN_STATE))
    if (
        "weight" in params
        and "bias" in params
        and "running_mean" in buffers
        and "running_var" in buffers
        and (plain if plain is not None else _plain_class(type(bn), _BN_STATE))
    ):
        return params["weight"], params["bias"], buffers["running_mean"], buffers["running_var"]
    return bn.weight, bn.bias, bn.running_mean, bn.running_var


def layer_tensors(layer: nn.Module) -> tuple[Tensor, Optional[Tensor]]:
    """(weight, bias) of a conv, linear or layer norm module, as its forward reads them: from
    `_parameters` where they are there and nothing else answers to those names."""
    params = layer._parameters
    plain = _PLAIN_CLASSES.get((type(layer), _LAYER_STATE))
    if plain is None:
        plain = _plain_class(type(layer), _LAYER_STATE)
    if plain and "weight" in params and "bias" in params:
        return params["weight"], params["bias"]
    return layer.weight, layer.bias


def _conv_input(x: Tensor, conv: nn.Conv2d) -> tuple[Tensor, Any]:
    """(input, padding) of the F.conv2d call `conv(x)` makes: Conv2dSame pads "same" from the input size,
    padding modes other than zeros pad first; both then convolve without padding."""
    if type(conv) is nn.Conv2d and conv.padding_mode == "zeros":  # the common case, asked without calls
        return x, conv.padding
    if is_conv2d_same(conv):
        return pad_same(x, conv), (0, 0)
    if conv.padding_mode != "zeros":
        return F.pad(x, conv._reversed_padding_repeated_twice, mode=conv.padding_mode), (0, 0)
    return x, conv.padding


def _eager_bn_act(y: Tensor, bn: nn.BatchNorm2d, act: str, act_param: float) -> Tensor:
    """`act(bn(y))` run by the modules themselves; a norm-act module applies `act` in its own forward."""
    out = bn(y)
    return out if is_norm_act(bn) else apply_activation(out, act, act_param)


def conv_bn_act_module(
    x: Tensor, conv: nn.Conv2d, bn: nn.BatchNorm2d, act: str, act_param: float, pieces: Optional[list] = None
) -> Tensor:
    """`act(bn(conv(x)))`, keeping only `x` for backward (or `pieces`: `x` is `torch.cat(pieces, 1)`,
    passes/cat_input.py)."""
    bn_params = bn_tensors(bn)
    conv_weight, conv_bias = layer_tensors(conv)
    geometry = None
    if pieces is None and quiet_modes():
        geometry = _thin_conv_bn_act(x, conv, bn, conv_weight, conv_bias, bn_params)
    if geometry is None and not (
        layer_kernels_apply(x, (conv_weight, conv_bias), bn_params)
        and x.shape[1] == conv.in_channels
        and bn.num_features == conv.out_channels
    ):
        return _eager_bn_act(conv(x), bn, act, act_param)
    given = x
    x, padding = _conv_input(x, conv)  # padding keeps the dtype, device and rank the check above admitted
    weight, bias, running_mean, running_var = bn_params
    running_mean, running_var, batch_stats, momentum = bn_call_config(bn, running_mean, running_var)
    return conv_bn_act_admitted(
        x, conv_weight, conv_bias, conv.stride, padding, conv.dilation, conv.groups, running_mean, running_var,
        weight, bias, batch_stats, momentum, bn.eps, act, act_param, pieces if x is given else None, geometry,
    )  # fmt: skip


def _thin_conv_bn_act(x, conv, bn, conv_weight, conv_bias, bn_params) -> Optional[tuple]:
    """The thin path of `conv_bn_act_module` (the caller checked `quiet_modes`): conv_geometry's answer for a
    plain nn.Conv2d whose tensors go with the input (checks.thin_dtypes), where the shapes match and the conv
    plan admits the call; None sends the call through the full checks."""
    if type(conv) is not nn.Conv2d or conv.padding_mode != "zeros":
        return None
    shape = x.shape
    plan = conv_plan(shape, conv_weight.shape, conv.stride, conv.padding, conv.dilation, conv.groups)
    if plan is None or not (x.is_floating_point() and x.layout is torch.strided):
        return None
    out_channels = (conv_weight.shape[0],)
    if (
        shape[1] == conv.in_channels
        and bn.num_features == out_channels[0] == conv.out_channels
        and thin_dtypes(x, (conv_weight, conv_bias), out_channels, ((bn_params, out_channels),))
    ):
        return (x, *plan)
    return None


def conv_bn_act_bn_module(
    input: Tensor, weight: Tensor, bias: Optional[Tensor], stride, padding, dilation, groups: int,
    bn: nn.BatchNorm2d, act: str, act_param: float, pieces: Optional[list] = None,
) -> Tensor:  # fmt: skip
    """`act(bn(F.conv2d(input, weight, bias, ...)))` with `bn` a BatchNorm module (a conv traced to F.conv2d,
    e.g. an nn.Conv2d subclass's own forward, then a BN module), keeping only `input` for backward.
    The BN's parameters, buffers and flags are read at call time, as its forward reads them."""
    bn_params = bn_tensors(bn)
    if not (layer_kernels_apply(input, (weight, bias), bn_params) and bn.num_features == weight.shape[0]):
        return _eager_bn_act(F.conv2d(input, weight, bias, stride, padding, dilation, groups), bn, act, act_param)
    bn_weight, bn_bias, running_mean, running_var = bn_params
    running_mean, running_var, batch_stats, momentum = bn_call_config(bn, running_mean, running_var)
    return conv_bn_act_admitted(
        input, weight, bias, stride, padding, dilation, groups, running_mean, running_var, bn_weight, bn_bias,
        batch_stats, momentum, bn.eps, act, act_param, pieces,
    )  # fmt: skip


def conv_bn_act_conv_module(
    x: Tensor, conv: nn.Conv2d, running_mean=None, running_var=None, bn_weight=None, bn_bias=None,
    training: bool = False, momentum: float = 0.1, eps: float = 1e-5, act: str = "none", act_param: float = 0.0,
    pieces: Optional[list] = None,
) -> Tensor:  # fmt: skip
    """`act(F.batch_norm(conv(x), ...))` with `conv` an nn.Conv2d module (its padding mode and timm's
    "same" padding applied as its forward applies them), keeping only `x` (or `pieces`) for backward."""
    if not (isinstance(x, Tensor) and x.dim() == 4 and x.shape[1] == conv.in_channels):
        y = F.batch_norm(conv(x), running_mean, running_var, bn_weight, bn_bias, training, momentum, eps)
        return apply_activation(y, act, act_param)
    given = x
    x, padding = _conv_input(x, conv)
    weight, bias = layer_tensors(conv)
    return ops.conv_bn_act(
        x, weight, bias, conv.stride, padding, conv.dilation, conv.groups, running_mean, running_var,
        bn_weight, bn_bias, training, momentum, eps, act, act_param, pieces=pieces if x is given else None,
    )  # fmt: skip


def conv2d_output_like(
    input: Tensor, weight: Tensor, bias: Optional[Tensor] = None, stride=1, padding=0, dilation=1, groups=1
) -> Tensor:
    """A tensor with the shape, dtype and device of `F.conv2d(input, ...)`'s output, holding no data.

    It stands in for a fused conv's output where the graph reads only its metadata
    (`x.ndim`, `x.shape`, ...). The shape comes from the conv on the meta device, so
    input that eager's conv rejects raises eager's error here too.
    """
    return _output_like(input.to("meta"), input.device, weight, bias, stride, padding, dilation, groups)


def conv_module_output_like(x: Tensor, conv: nn.Conv2d) -> Tensor:
    """`conv2d_output_like` for `conv(x)`, with the padding the module applies."""
    meta, padding = _conv_input(x.to("meta"), conv)
    return _output_like(meta, x.device, conv.weight, conv.bias, conv.stride, padding, conv.dilation, conv.groups)


def _output_like(meta_input: Tensor, device: torch.device, weight, bias, stride, padding, dilation, groups):
    with torch.no_grad():
        meta = F.conv2d(
            meta_input, weight.to("meta"), None if bias is None else bias.to("meta"), stride, padding, dilation, groups
        )
    dtype = meta.dtype
    if (
        torch.amp.is_autocast_available(device.type)
        and torch.is_autocast_enabled(device.type)
        and dtype in (torch.float32, torch.float16, torch.bfloat16)
    ):
        dtype = torch.get_autocast_dtype(device.type)
    return torch.empty((), dtype=dtype, device=device).expand(meta.shape)


def conv_act_module(x: Tensor, conv: nn.Conv2d, act: str, act_param: float) -> Tensor:
    """`act(conv(x))`, keeping only `x` for backward."""
    x, padding = _conv_input(x, conv)
    weight, bias = layer_tensors(conv)
    return ops.conv_act(x, weight, bias, conv.stride, padding, conv.dilation, conv.groups, act, act_param)


def conv2d_module(x: Tensor, conv: nn.Conv2d, pieces: Optional[list] = None) -> Tensor:
    """`conv(x)`, with fxfuse's conv backward (ops.conv2d), keeping `x` (or `pieces`) for backward."""
    given = x
    x, padding = _conv_input(x, conv)
    weight, bias = layer_tensors(conv)
    return ops.conv2d(
        x, weight, bias, conv.stride, padding, conv.dilation, conv.groups,
        pieces=pieces if x is given else None,
    )  # fmt: skip


def linear_act_module(x: Tensor, linear: nn.Linear, act: str, act_param: float) -> Tensor:
    """`act(linear(x))`, keeping only `x` for backward."""
    return ops.linear_act(x, *layer_tensors(linear), act, act_param)


def _identity_now(module: nn.Module) -> bool:
    return type(module) is nn.Identity or (isinstance(module, nn.Dropout) and (module.p == 0 or not module.training))


def act_linear_module(x: Tensor, act: str, act_param: float, linear: nn.Linear, *between: nn.Module) -> Tensor:
    """`linear(between(act(x)))`, keeping only `x` for backward, where every module of `between`
    (nn.Identity, nn.Dropout: passes/act_linear.py) is the identity in this call: a Dropout
    whose p is 0 or that is in eval. Otherwise the modules run as they are, eagerly."""
    if all(_identity_now(m) for m in between):
        return ops.act_linear(x, *layer_tensors(linear), act, act_param)
    y = apply_activation(x, act, act_param)
    for module in between:
        y = module(y)
    return linear(y)


def scales_features(scale_shape: tuple, ndim: int, dims: tuple, features: int) -> bool:
    """Whether multiplying a linear output of rank `ndim`, permuted by `dims`, by a tensor of
    `scale_shape` scales each of its `features` output features (the shape broadcasts to
    `features` on that feature's axis and to 1 elsewhere)."""
    if len(scale_shape) > ndim or (dims and sorted(dims) != list(range(ndim))):
        return False
    shape = (1,) * (ndim - len(scale_shape)) + tuple(scale_shape)
    feature = dims.index(ndim - 1) if dims else ndim - 1
    return shape[feature] == features and all(s == 1 for i, s in enumerate(shape) if i != feature)


def act_linear_scale_module(
    x: Tensor,
    act: str,
    act_param: float,
    linear: nn.Linear,
    pre: tuple,
    post: tuple,
    dims: tuple,
    scale: Tensor,
) -> Tensor:
    """`permute(post(linear(pre(act(x)))), dims) * scale` (passes/layer_scale.py), keeping only `x`
    for backward, where the modules of `pre` and `post` are the identity in this call and
    `scale` scales each output feature. Otherwise the modules run as they are, eagerly."""
    if all(_identity_now(m) for m in (*pre, *post)):
        if isinstance(scale, Tensor) and scales_features(tuple(scale.shape), x.dim(), dims, linear.out_features):
            y = ops.act_linear_scale(x, *layer_tensors(linear), scale.reshape(-1), act, act_param)
            return y.permute(dims) if dims else y
    y = apply_activation(x, act, act_param)
    for module in pre:
        y = module(y)
    y = linear(y)
    for module in post:
        y = module(y)
    return (y.permute(dims) if dims else y) * scale


def layer_norm_linear_module(x: Tensor, norm: nn.LayerNorm, linear: nn.Linear) -> Tensor:
    """`linear(norm(x))`, keeping only `x` for backward."""
    return ops.layer_norm_linear(x, norm.normalized_shape, *layer_tensors(norm), norm.eps, *layer_tensors(linear))


def batch_norm_act_module(
    x: Tensor, bn: nn.BatchNorm2d, act: str, act_param: float, pieces: Optional[list] = None, rebuild: bool = False
) -> Tensor:
    """`act(bn(x))`, keeping only `x` (or `pieces`) and the statistics for backward; with `rebuild`, the ops
    that keep its output keep those instead (ops/rebuild.py, passes/rebuild.py)."""
    bn_params = bn_tensors(bn)
    if not (kernels_apply(x, bn_params) and x.shape[1] == bn.num_features):
        return _eager_bn_act(x, bn, act, act_param)
    weight, bias, running_mean, running_var = bn_params
    running_mean, running_var, batch_stats, momentum = bn_call_config(bn, running_mean, running_var)
    return batch_norm_act_admitted(
        x,
        running_mean,
        running_var,
        weight,
        bias,
        batch_stats,
        momentum,
        bn.eps,
        act,
        act_param,
        pieces,
        rebuild,
    )


def bn_act_conv_module(
    y: Tensor,
    bn: nn.BatchNorm2d,
    act: str,
    act_param: float,
    conv: nn.Conv2d,
    out_bn: Optional[nn.BatchNorm2d] = None,
    out_act: str = "none",
    out_act_param: float = 0.0,
    pieces: Optional[list] = None,
) -> Tensor:
    """`conv(act(bn(y)))`, or with `out_bn` `out_act(out_bn(conv(act(bn(y)))))`, keeping only `y`
    (or `pieces`: `y` is `torch.cat(pieces, 1)`, passes/cat_input.py) and the statistics for backward
    (passes/bn_act_conv.py). Calls the fused op cannot serve
    exactly run the sites it merges, each as it would run alone."""
    in_params = bn_tensors(bn)
    out_params = bn_tensors(out_bn) if out_bn is not None else ()
    conv_weight, conv_bias = layer_tensors(conv)
    geometry = None
    if pieces is None and quiet_modes():
        geometry = _thin_bn_act_conv(y, bn, conv, out_bn, in_params, conv_weight, conv_bias, out_params)
    thin = geometry is not None
    if not thin and (
        kernels_apply(y, in_params)
        and y.shape[1] == bn.num_features == conv.in_channels
        and layer_params_apply(y, (conv_weight, conv_bias), out_params)
        and (out_bn is None or out_bn.num_features == conv.out_channels)
    ):
        geometry = conv_geometry(y, conv_weight, conv.stride, conv.padding, conv.dilation)
    if geometry is None:
        x = batch_norm_act_module(y, bn, act, act_param, pieces)
        return conv(x) if out_bn is None else conv_bn_act_module(x, conv, out_bn, out_act, out_act_param)
    weight, bias, running_mean, running_var = in_params
    running_mean, running_var, batch_stats, momentum = bn_call_config(bn, running_mean, running_var)
    if batch_stats:
        # Eager's first BN raises on a batch of one value per channel before the second BN counts its batch.
        F._verify_batch_size(y.size())
    if out_bn is None:
        return bn_act_conv_admitted(
            y, running_mean, running_var, weight, bias, batch_stats, momentum, bn.eps, act, act_param,
            conv_weight, conv_bias, conv.stride, conv.padding, conv.dilation, conv.groups, False, None, None, None,
            None, False, 0.1, 1e-5, "none", 0.0, pieces, geometry, thin,
        )  # fmt: skip
    out_weight, out_bias, out_mean, out_var = out_params
    out_mean, out_var, out_batch_stats, out_momentum = bn_call_config(out_bn, out_mean, out_var)
    return bn_act_conv_admitted(
        y, running_mean, running_var, weight, bias, batch_stats, momentum, bn.eps, act, act_param,
        conv_weight, conv_bias, conv.stride, conv.padding, conv.dilation, conv.groups, True, out_mean, out_var,
        out_weight, out_bias, out_batch_stats, out_momentum, out_bn.eps, out_act, out_act_param, pieces, geometry,
        thin,
    )  # fmt: skip


def _thin_bn_act_conv(y, bn, conv, out_bn, in_params, conv_weight, conv_bias, out_params) -> Optional[tuple]:
    """The thin path of `bn_act_conv_module` (the caller checked `quiet_modes`): conv_geometry's answer where
    the call's tensors go with the input (checks.thin_dtypes; under autocast the input is a low-precision
    conv output), the shapes match and the conv plan admits the call; None sends the call through the full
    checks, which decide every case."""
    shape = y.shape
    plan = conv_plan(shape, conv_weight.shape, conv.stride, conv.padding, conv.dilation, conv.groups)
    if plan is None or not (y.is_floating_point() and y.layout is torch.strided):
        return None
    channels, out_channels = (shape[1],), (conv_weight.shape[0],)
    if (
        bn.num_features == channels[0] == conv.in_channels
        and (out_bn is None or out_bn.num_features == out_channels[0] == conv.out_channels)
        and thin_dtypes(
            y, (conv_weight, conv_bias), out_channels, ((in_params, channels), (out_params, out_channels)), True
        )
    ):
        return (y, *plan)
    return None


# fxfuse::gelu against F.gelu, forward + backward, CPU float32 (benchmarks/bench_gelu.py --only gelu),
# by the kernels ATen picks (ATEN_CPU_CAPABILITY) on x86: channels_last 4-D inputs of 1.2M-3.2M
# elements with approximate="none" took 0.87-0.90x eager's time against ATen's AVX2 kernels and
# 0.32-0.34x against its baseline ones, but 1.03-1.07x against its AVX-512 kernels (fxfuse's
# kernels are built for baseline and AVX2). No faster anywhere on contiguous inputs, with
# approximate="tanh", or in float64; slower on small tensors (25k elements), where the custom
# op's dispatch overhead dominates.
GELU_FAST_MIN_NUMEL = 1 << 20
GELU_FAST_CAPABILITIES = ("DEFAULT", "AVX2")
_GELU_FAST = "fxfuse::gelu measured faster than eager for channels_last float32 CPU inputs"


@functools.cache
def aten_cpu_capability() -> str:
    """The CPU kernels ATen runs in this process ("DEFAULT", "AVX2", "AVX512", ...)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "not x86"
    return torch.backends.cpu.get_cpu_capability()


def gelu_rule(
    approximate: str,
    dtype: Optional[torch.dtype] = None,
    shape=None,
    channels_last: bool = False,
    device: str = "cpu",
) -> tuple[bool, str]:
    """(whether fxfuse::gelu was measured faster than F.gelu for such an input, why).

    `channels_last`: the input is channels_last and not also contiguous. The GELU pass
    asks with the example input's metadata (dtype None: not known before run time),
    `gelu_where_faster` with each call's input. Only CPU was measured: on another device
    (`device`, a device type) F.gelu is kept.
    """
    if approximate != "none":
        return False, "approximate='tanh': fxfuse::gelu measured no faster than eager"
    if device != "cpu":
        return False, f"on {device}: fxfuse::gelu was measured faster on CPU only, so F.gelu is kept"
    capability = aten_cpu_capability()
    if capability not in GELU_FAST_CAPABILITIES:
        return False, f"ATen runs its {capability} CPU kernels here: fxfuse::gelu measured no faster"
    if dtype is None:
        return True, f"layout known only at run time: dispatches per call ({_GELU_FAST}; F.gelu otherwise)"
    if dtype != torch.float32:
        return False, f"{dtype}: fxfuse::gelu measured no faster than eager"
    if len(shape) != 4 or not channels_last:
        return False, "input not channels_last: fxfuse::gelu measured no faster than eager"
    numel = 1
    for size in shape:
        numel *= size
    if numel < GELU_FAST_MIN_NUMEL:
        return False, f"{numel} elements: too few for fxfuse::gelu to be faster"
    return True, f"channels_last float32 input; {_GELU_FAST}"


def gelu_is_faster(input: Tensor, approximate: str) -> bool:
    """Whether fxfuse::gelu was measured faster than F.gelu for a call like this one."""
    return (
        isinstance(input, Tensor)
        and gelu_rule(
            approximate,
            input.dtype,
            input.shape,
            input.is_contiguous(memory_format=torch.channels_last) and not input.is_contiguous(),
            input.device.type,
        )[0]
    )


def gelu_where_faster(input: Tensor, approximate: str = "none") -> Tensor:
    """`F.gelu(input, approximate=approximate)`, through fxfuse::gelu where that is faster.

    Both compute the same values and gradients, so choosing per call is exact either way.
    Under torch.compile with fxfuse.ops.compiled.enabled it is F.gelu, which inductor fuses.
    """
    if not ops.compiled.composing() and gelu_is_faster(input, approximate):
        return ops.gelu(input, approximate)
    return F.gelu(input, approximate=approximate)


def add_into(fresh: Tensor, other: Any) -> Tensor:
    """`fresh + other`, written over `fresh` when that gives the same tensor.

    `fresh` is a fused site's output that nothing else uses or keeps for backward
    (see passes/inplace_add.py). In place needs `other` to be a tensor of the same
    shape, strides, dtype and device (so the result's values and layout are the
    out-of-place add's), and `fresh` to be a tensor autograd lets us change.

    Under torch.compile it is the out-of-place add: inductor reuses buffers itself, and
    the checks above (`_is_view`, `is_inference`) would break dynamo's graph.
    """
    if torch.compiler.is_compiling():
        return fresh + other
    if isinstance(fresh, Tensor) and isinstance(other, Tensor) and _can_add_into(fresh, other):
        return fresh.add_(other)
    return fresh + other


def _can_add_into(fresh: Tensor, other: Tensor) -> bool:
    return (
        other is not fresh
        and fresh.layout == torch.strided
        and other.layout == torch.strided
        and other.dtype == fresh.dtype
        and other.device == fresh.device
        and other.shape == fresh.shape
        and other.stride() == fresh.stride()
        and not fresh._is_view()
        and not (fresh.is_leaf and fresh.requires_grad)
        and (not fresh.is_inference() or torch.is_inference_mode_enabled())
    )
