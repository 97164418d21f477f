"""`linear_act`, fxfuse::linear_act and fxfuse::linear_act_backward.

`linear_act(input, weight, bias, act)` computes `act(F.linear(input, weight, bias))` and keeps
only the layer's input and parameters for backward, whose op recomputes the pre-activation
(the wide linear output) instead of keeping it.

Under torch.autocast (CPU, CUDA) it casts its operands as autocast casts F.linear (its
Autocast kernel, csrc/autocast/). Calls the fused op cannot serve exactly (mixed dtypes or
devices, tensor subclasses, shapes F.linear rejects, ...) run the eager composition instead,
so bad input raises exactly what eager raises. The fake kernel runs aten::linear's own meta
function: the real kernel returns the layer output, activated in place.
"""

from __future__ import annotations

from typing import Optional

import torch.nn.functional as F
from torch import Tensor

from . import compiled
from .checks import apply_activation
from .linear_common import call_linear_op, register_linear_op

__all__ = ["linear_act"]


def linear_act(
    input: Tensor, weight: Tensor, bias: Optional[Tensor] = None, act: str = "gelu", act_param: float = 0.0
) -> Tensor:
    """`act(F.linear(input, weight, bias))` that keeps only input, weight and bias for backward."""
    return call_linear_op("linear_act", compiled.compiled_layer_act, _eager, input, weight, bias, act, act_param)


def _eager(input, weight, bias, *, act, act_param):
    return apply_activation(F.linear(input, weight, bias), act, act_param)


def register() -> None:
    """Fake kernels of fxfuse::linear_act (fxfuse._C defines the op and its Autograd kernel)."""
    register_linear_op("linear_act")
