"""`layer_norm_linear`: `F.linear(F.layer_norm(input, ...), weight, bias)` that keeps only
the layer norm's input and the parameters for backward.

Eager keeps the layer norm's input (for its backward) and its output (the linear's input,
for the weight gradient): two tensors as wide as the model in every transformer block
(LayerNorm → attention's qkv Linear, LayerNorm → MLP) and every ConvNeXt block. The
fused op keeps the input alone; its backward runs the layer norm again (one pass, which
also gives back the mean and rstd) for the weight gradient, then the layer norm's backward.
No matmul runs twice. Forward is eager's ATen calls, so the output is eager's bit for bit.

It serves a layer norm over the last dimension, all tensors of the input's dtype and
device. Every other call runs the eager composition, so bad input raises what eager raises.
Under torch.autocast (CPU, CUDA) it follows eager's precision rules through its Autocast
kernels (csrc/autocast/): the layer norm runs as autocast runs it (in float32 on CUDA, in the
input's dtype with float32 parameters on CPU), its output is cast to the autocast dtype for
the linear, whose operands are cast as for F.linear; the backward recomputes that cast.
"""

from __future__ import annotations

import numbers
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from . import compiled, direct
from .checks import (
    alike,
    any_autocast,
    check_linear,
    linear_fusable,
    norm_dtype,
    plain,
    quiet_modes,
    thin_linear,
)

__all__ = ["layer_norm_linear"]


def _last_dim(normalized_shape) -> Optional[int]:
    """normalized_shape's one size when it names only the last dimension, else None (F.layer_norm
    takes a sequence only: an int gets eager's TypeError)."""
    if isinstance(normalized_shape, (tuple, list, torch.Size)) and len(normalized_shape) == 1:
        size = normalized_shape[0]
        return size if type(size) is int else None
    return None


def _fusable(input, size, ln_weight, ln_bias, eps, weight, bias) -> bool:
    """Whether the fused op computes this call exactly as eager does (else the composition runs)."""
    if size is None or not linear_fusable(input, weight, bias):
        return False
    norm_params = [t for t in (ln_weight, ln_bias) if t is not None]
    return (
        isinstance(eps, numbers.Real)
        and plain(input, *norm_params)
        and input.shape[-1] == size
        and norm_dtype(input, norm_params) is not None
        and all(tuple(t.shape) == (size,) for t in norm_params)
    )


def _thin(input, size, ln_weight, ln_bias, eps, weight, bias) -> bool:
    """`_fusable` for a call whose caller checked `quiet_modes`, outside autocast, in the common cases
    (a float eps, plain tensors of the input's dtype and device); False sends the call to `_fusable`."""
    return (
        size is not None
        and type(eps) is float
        and not any_autocast()
        and thin_linear(input, weight, bias, ln_weight, ln_bias)  # asks input.dim() >= 1 first
        and input.shape[-1] == size
        and alike(input.dtype, input.device, (size,), (ln_weight, ln_bias))
    )


def layer_norm_linear(
    input: Tensor,
    normalized_shape: Sequence[int],
    ln_weight: Optional[Tensor],
    ln_bias: Optional[Tensor],
    eps: float,
    weight: Tensor,
    bias: Optional[Tensor] = None,
) -> Tensor:
    """`F.linear(F.layer_norm(input, normalized_shape, ln_weight, ln_bias, eps), weight, bias)`,
    keeping only `input` and the parameters for backward."""
    size = _last_dim(normalized_shape)
    if quiet_modes() and _thin(input, size, ln_weight, ln_bias, eps, weight, bias):
        return direct.call("layer_norm_linear")(input, [size], ln_weight, ln_bias, eps, weight, bias)
    if _fusable(input, size, ln_weight, ln_bias, eps, weight, bias):
        if compiled.applies(input):  # under torch.compile: a composition inductor fuses (ops/compiled.py)
            return compiled.compiled_layer_norm_linear(input, [size], ln_weight, ln_bias, float(eps), weight, bias)
        return direct.call("layer_norm_linear")(input, [size], ln_weight, ln_bias, float(eps), weight, bias)
    return F.linear(F.layer_norm(input, normalized_shape, ln_weight, ln_bias, eps), weight, bias)


def _check(input, normalized_shape, weight, bias, op: str) -> None:
    torch._check(
        len(normalized_shape) == 1,
        lambda: f"fxfuse::{op}: expected a layer norm over the last dimension, got normalized_shape {normalized_shape}",
    )
    size = normalized_shape[0]
    torch._check(
        input.dim() >= 1 and input.shape[-1] == size,
        lambda: f"fxfuse::{op}: expected an input whose last dimension is {size}, got shape {tuple(input.shape)}",
    )
    check_linear(input, weight, bias, op)


def _fake(input, normalized_shape, ln_weight, ln_bias, eps, weight, bias):
    _check(input, normalized_shape, weight, bias, "layer_norm_linear")
    y = torch.ops.aten.native_layer_norm.default(input, normalized_shape, ln_weight, ln_bias, eps)[0]
    return torch.ops.aten.linear.default(y.to(weight.dtype), weight, bias)


def _backward_fake(grad_out, input, normalized_shape, ln_weight, ln_bias, eps, weight, bias, output_mask):
    _check(input, normalized_shape, weight, bias, "layer_norm_linear_backward")
    ln_mask = [output_mask[0], output_mask[1] and ln_weight is not None, output_mask[2] and ln_bias is not None]
    grad_input = grad_ln_weight = grad_ln_bias = None
    if any(ln_mask):
        _, mean, rstd = torch.ops.aten.native_layer_norm.default(input, normalized_shape, ln_weight, ln_bias, eps)
        grad_y = torch.ops.aten.matmul.default(grad_out, weight).to(input.dtype)
        grad_input, grad_ln_weight, grad_ln_bias = torch.ops.aten.native_layer_norm_backward.default(
            grad_y, input, normalized_shape, mean, rstd, ln_weight, ln_bias, ln_mask
        )
    return (
        grad_input,
        grad_ln_weight,
        grad_ln_bias,
        weight.new_empty(weight.shape) if output_mask[3] else None,
        bias.new_empty(bias.shape) if output_mask[4] and bias is not None else None,
    )


def register() -> None:
    """Fake kernels of the op (fxfuse._C defines it and its Autograd kernel)."""
    torch.library.register_fake("fxfuse::layer_norm_linear", _fake)
    torch.library.register_fake("fxfuse::layer_norm_linear_backward", _backward_fake)
