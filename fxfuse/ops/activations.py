"""The activation registry: every activation the fused ops apply, one entry each.

The op schemas take an activation by name (`act`) and one float (`act_param`). What the
rest of fxfuse knows about an activation derives from its entry here: the eager function
the ops compute (checks.apply_activation), the module classes, functions and Tensor methods
the matchers recognise (fusion/passes/matchers.py), and whether eager's backward keeps the
activation's input (fusion/passes/estimates.py). The C++ kernels take the same names from
csrc/act.h's FXFUSE_ACTIVATIONS; tests/test_ops_activations.py checks that the two agree.
Adding an activation is one entry here, one line there, and its kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class ActivationSpec:
    name: str  # as in the op schemas and csrc/act.h
    eager: Callable[[Tensor, float], Tensor]  # act(x, act_param): what the fused ops compute, out of place
    saves_input: bool  # whether eager's backward keeps the activation's input alive
    modules: tuple[type[nn.Module], ...] = ()  # module classes computing it (exact type)
    functions: tuple[Callable, ...] = ()  # functional forms, taking the input first (in-place ones too)
    methods: tuple[str, ...] = ()  # Tensor methods taking no argument
    # The one setting after the input: the functions' second argument and the modules'
    # attribute of that name, with the functions' default. With `value` it selects this
    # activation (it must equal `value`); without, it is act_param (a number).
    argument: Optional[str] = None
    default: Any = None
    value: Any = None
    timm_forwards: tuple[str, ...] = ()  # qualnames of timm.layers.activations forwards computing it

    @property
    def takes_param(self) -> bool:
        """Whether act_param means something for this activation (else it is ignored)."""
        return self.argument is not None and self.value is None


REGISTRY: dict[str, ActivationSpec] = {
    spec.name: spec
    for spec in (
        ActivationSpec(
            "none",
            lambda x, p: x,
            saves_input=False,
            modules=(nn.Identity,),
        ),
        ActivationSpec(
            "relu",
            lambda x, p: F.relu(x),
            saves_input=False,  # its backward reads its output
            modules=(nn.ReLU,),
            functions=(F.relu, F.relu_, torch.relu, torch.relu_),
            methods=("relu", "relu_"),
        ),
        ActivationSpec(
            "relu6",
            lambda x, p: F.relu6(x),
            saves_input=True,
            modules=(nn.ReLU6,),
            functions=(F.relu6,),
        ),
        ActivationSpec(
            "leaky_relu",
            lambda x, p: F.leaky_relu(x, p),
            saves_input=True,
            modules=(nn.LeakyReLU,),
            functions=(F.leaky_relu, F.leaky_relu_),
            argument="negative_slope",
            default=0.01,
        ),
        ActivationSpec(
            "gelu",
            lambda x, p: F.gelu(x),
            saves_input=True,
            modules=(nn.GELU,),
            functions=(F.gelu,),
            argument="approximate",
            default="none",
            value="none",
            timm_forwards=("GELU.forward",),
        ),
        ActivationSpec(
            "gelu_tanh",
            lambda x, p: F.gelu(x, approximate="tanh"),
            saves_input=True,
            modules=(nn.GELU,),
            functions=(F.gelu,),
            argument="approximate",
            default="none",
            value="tanh",
            timm_forwards=("GELUTanh.forward",),
        ),
        ActivationSpec(
            "silu",
            lambda x, p: F.silu(x),
            saves_input=True,
            modules=(nn.SiLU,),
            functions=(F.silu,),
        ),
        ActivationSpec(
            "hardswish",
            lambda x, p: F.hardswish(x),
            saves_input=True,
            modules=(nn.Hardswish,),
            functions=(F.hardswish,),
        ),
    )
}
ACTIVATIONS = tuple(REGISTRY)  # the names, in csrc/act.h's Act order


def _index(key: str) -> dict[Any, tuple[ActivationSpec, ...]]:
    index: dict[Any, tuple[ActivationSpec, ...]] = {}
    for spec in REGISTRY.values():
        for form in getattr(spec, key):
            index[form] = (*index.get(form, ()), spec)
    return index


# Each form to the activations it may compute (several where `argument` selects: nn.GELU, F.gelu).
BY_MODULE = _index("modules")
BY_FUNCTION = _index("functions")
BY_METHOD = _index("methods")
BY_TIMM_FORWARD = _index("timm_forwards")
