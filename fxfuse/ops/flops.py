"""FLOP formulas of fxfuse's ops for `torch.utils.flop_counter.FlopCounterMode`.

The counter sees a custom op as one opaque call, not the matmul or convolution inside it,
so without these a model optimized by fxfuse would count fewer FLOPs than eager, and
fxfuse's own region costs (fusion/regions/costs.py, which count FLOPs with FlopCounterMode)
would miss every layer that sits inside a fused op. Counted as torch counts aten.mm and
aten.convolution and their backward (multiply-adds × 2, pointwise work not counted); a
backward op counts the layer it recomputes as well as its gradients.
"""

from __future__ import annotations

import math

import torch
from torch.utils.flop_counter import conv_flop_count, flop_registry, register_flop_formula


def _matmul(input_shape, weight_shape) -> int:
    """F.linear(input, weight): 2 × rows × in_features × out_features."""
    return 2 * math.prod(input_shape[:-1]) * weight_shape[1] * weight_shape[0]


def _conv(input_shape, weight_shape, out_shape) -> int:
    return conv_flop_count(list(input_shape), list(weight_shape), list(out_shape))


def _t(shape) -> list[int]:
    return [shape[1], shape[0], *shape[2:]]


def _conv_gradients(grad_out_shape, input_shape, weight_shape, grad_input: bool, grad_weight: bool) -> int:
    """aten.convolution_backward's count (torch's formula, grouped weight gradients included)."""
    flops = 0
    if grad_input:
        flops += conv_flop_count(list(grad_out_shape), list(weight_shape), list(input_shape), True)
    if grad_weight:
        flops += conv_flop_count(_t(input_shape), _t(grad_out_shape), _t(weight_shape), False)
    return flops


def _linear_forward(input_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    return _matmul(input_shape, weight_shape)


def _linear_act_backward(grad_out_shape, input_shape, weight_shape, bias, act, act_param, mask, **kwargs) -> int:
    # The recomputed pre-activation, then the gradients asked for.
    return _matmul(input_shape, weight_shape) * (1 + bool(mask[0]) + bool(mask[1]))


def _act_linear_backward(grad_out_shape, input_shape, weight_shape, bias, act, act_param, mask, **kwargs) -> int:
    return _matmul(input_shape, weight_shape) * (bool(mask[0]) + bool(mask[1]))


def _act_linear_scale_backward(grad_out_shape, input_shape, weight_shape, bias, scale, act, act_param, mask, **kw):
    # grad_input's matmul; one product serves grad_weight and grad_scale.
    return _matmul(input_shape, weight_shape) * (bool(mask[0]) + (bool(mask[1]) or bool(mask[3])))


def _layer_norm_linear_forward(input_shape, normalized_shape, ln_weight, ln_bias, eps, weight_shape, *a, **kw) -> int:
    return _matmul(input_shape, weight_shape)


def _layer_norm_linear_backward(grad_out_shape, input_shape, shape, ln_w, ln_b, eps, weight_shape, bias, mask, **kw):
    return _matmul(input_shape, weight_shape) * (any(mask[:3]) + bool(mask[3]))


def _conv_layer_norm_linear_forward(input_shape, conv_weight_shape, *args, out_shape=None, **kwargs) -> int:
    weight_shape = args[9]  # after conv_bias, stride, padding, dilation, groups, shape, ln_weight, ln_bias, eps
    conv_out = [*out_shape[:1], conv_weight_shape[0], *out_shape[1:3]]
    return _conv(input_shape, conv_weight_shape, conv_out) + _matmul([*out_shape[:-1], weight_shape[1]], weight_shape)


def _conv_layer_norm_linear_backward(grad_out_shape, input_shape, conv_weight_shape, *args, **kwargs) -> int:
    weight_shape, mask = args[10], args[-1]
    conv_out = [*grad_out_shape[:1], conv_weight_shape[0], *grad_out_shape[1:3]]
    linear_in = [*grad_out_shape[:-1], weight_shape[1]]
    need_conv = mask[0] or mask[1] or mask[2]
    # The recomputed conv, the linear's gradients (its input's when anything before it needs one), the conv's.
    flops = _conv(input_shape, conv_weight_shape, conv_out)
    flops += _matmul(linear_in, weight_shape) * ((need_conv or mask[3] or mask[4]) + bool(mask[5]))
    return flops + _conv_gradients(conv_out, input_shape, conv_weight_shape, mask[0], mask[1])


def _conv_act_forward(input_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    return _conv(input_shape, weight_shape, out_shape)


def _conv_act_backward(grad_out_shape, input_shape, weight_shape, *args, **kwargs) -> int:
    mask = args[-1]
    recompute = _conv(input_shape, weight_shape, grad_out_shape)
    return recompute + _conv_gradients(grad_out_shape, input_shape, weight_shape, mask[0], mask[1])


def _conv2d_backward(grad_out_shape, input_shape, weight_shape, *args, **kwargs) -> int:
    mask = args[-1]
    return _conv_gradients(grad_out_shape, input_shape, weight_shape, mask[0], mask[1])


def _conv_bn_act_forward(input_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    return _conv(input_shape, weight_shape, out_shape[0])


def _conv_bn_act_backward(grad_out_shape, input_shape, weight_shape, *args, **kwargs) -> int:
    mask = args[-1]  # grad_input, grad_weight, grad_bias, grad_bn_weight, grad_bn_bias
    recompute = _conv(input_shape, weight_shape, grad_out_shape)
    return recompute + _conv_gradients(grad_out_shape, input_shape, weight_shape, mask[0], mask[1])


def _bn_act_conv_forward(input_shape, *args, out_shape=None, **kwargs) -> int:
    weight_shape = args[8]  # after in_weight, in_bias, in_running_mean, in_running_var, in_batch_stats, ...
    return _conv(input_shape, weight_shape, out_shape[0])


def _bn_act_conv_backward(grad_out_shape, input_shape, *args, **kwargs) -> int:
    weight_shape, epilogue, mask = args[8], args[14], args[-1]
    # The conv's input gradient feeds the first BN's backward (grad_input, in_weight, in_bias);
    # with an epilogue BN the conv output is recomputed first.
    recompute = _conv(input_shape, weight_shape, grad_out_shape) if epilogue else 0
    return recompute + _conv_gradients(grad_out_shape, input_shape, weight_shape, any(mask[:3]), mask[3])


def _on_the_concatenation(formula):
    """cat_<op>'s forward formula: <op>'s on the concatenated input. The counter sees cat_<op> alone
    (its kernel calls <op> below the counter); its backward runs <op>'s backward op, counted by that."""

    def counted(pieces_shapes, input_shape, *args, **kwargs) -> int:
        return formula(input_shape, *args, **kwargs)

    return counted


def register() -> None:
    """Register the formulas (fxfuse._C defines the ops; ops/cat_input.py the cat_ variants)."""
    fxfuse = torch.ops.fxfuse
    formulas = {
        fxfuse.linear_act: _linear_forward,
        fxfuse.act_linear: _linear_forward,
        fxfuse.linear_act_backward: _linear_act_backward,
        fxfuse.act_linear_backward: _act_linear_backward,
        fxfuse.act_linear_scale: _linear_forward,
        fxfuse.act_linear_scale_backward: _act_linear_scale_backward,
        fxfuse.layer_norm_linear: _layer_norm_linear_forward,
        fxfuse.layer_norm_linear_backward: _layer_norm_linear_backward,
        fxfuse.conv_layer_norm_linear: _conv_layer_norm_linear_forward,
        fxfuse.conv_layer_norm_linear_backward: _conv_layer_norm_linear_backward,
        fxfuse.conv2d: _conv_act_forward,
        fxfuse.conv2d_backward: _conv2d_backward,
        fxfuse.conv_act: _conv_act_forward,
        fxfuse.conv_act_backward: _conv_act_backward,
        fxfuse.conv_bn_act: _conv_bn_act_forward,
        fxfuse.conv_bn_act_backward: _conv_bn_act_backward,
        fxfuse.bn_act_conv: _bn_act_conv_forward,
        fxfuse.bn_act_conv_backward: _bn_act_conv_backward,
        fxfuse.cat_conv2d: _on_the_concatenation(_conv_act_forward),
        fxfuse.cat_conv_bn_act: _on_the_concatenation(_conv_bn_act_forward),
        fxfuse.cat_bn_act_conv: _on_the_concatenation(_bn_act_conv_forward),
    }
    for op, formula in formulas.items():
        if op not in flop_registry:  # once per process
            register_flop_formula(op)(formula)
