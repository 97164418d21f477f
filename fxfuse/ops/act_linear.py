"""`act_linear`, fxfuse::act_linear and fxfuse::act_linear_backward.

`act_linear(input, weight, bias, act)` computes `F.linear(act(input), weight, bias)`: eager
keeps the activation's input for its backward and its output for the linear's weight
gradient; the op keeps only the input and recomputes the activation (one pointwise pass) for
the weight gradient. In a transformer or ConvNeXt MLP (Linear → GELU → Linear) that is the
4×-wide GELU output, for no matmul recomputed.

Under torch.autocast (CPU, CUDA) it casts as autocast casts F.linear (its Autocast kernel,
csrc/autocast/): the weight and bias; the activation runs in the input's dtype, as eager's does,
and the op casts its output for the linear (and again in backward), keeping the uncast input.
Calls the fused op cannot serve exactly (mixed dtypes or devices, tensor subclasses, shapes
F.linear rejects, ...) run the eager composition instead, so bad input raises exactly what
eager raises. The fake kernel runs aten::linear's own meta
function.
"""

from __future__ import annotations

from typing import Optional

import torch.nn.functional as F
from torch import Tensor

from . import compiled
from .checks import apply_activation
from .linear_common import call_linear_op, register_linear_op

__all__ = ["act_linear"]


def act_linear(
    input: Tensor, weight: Tensor, bias: Optional[Tensor] = None, act: str = "gelu", act_param: float = 0.0
) -> Tensor:
    """`F.linear(act(input), weight, bias)` that keeps only input, weight and bias for backward."""
    return call_linear_op("act_linear", compiled.compiled_act_layer, eager, input, weight, bias, act, act_param)


def eager(input, weight, bias, *, act, act_param):
    """The eager composition (act_linear_scale's too)."""
    return F.linear(apply_activation(input, act, act_param), weight, bias)


def register() -> None:
    """Fake kernels of fxfuse::act_linear (fxfuse._C defines the op and its Autograd kernel)."""
    register_linear_op("act_linear", casts_input=True)
