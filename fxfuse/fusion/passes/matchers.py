"""Recognising the pieces of a pattern in an fx.Graph: convs, batch norms, activations.

A module matches only when it computes exactly what its library class computes:
the exact forward (subclasses that override it are not plain BN/conv), and no
hooks (the fused op would not run them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ...ops.activations import BY_FUNCTION, BY_METHOD, BY_MODULE, BY_TIMM_FORWARD, REGISTRY, ActivationSpec
from ..hooks import has_hooks, hooks_problem
from ..known_modules import is_conv2d_same, is_norm_act


@dataclass(frozen=True)
class Activation:
    name: str  # one of fxfuse.ops.ACTIVATIONS
    param: float = 0.0

    def describe(self) -> str:
        if REGISTRY[self.name].takes_param:
            return f"{self.name}({self.param:g})"
        return self.name


def module_of(node: fx.Node, modules: dict[str, nn.Module]) -> Optional[nn.Module]:
    return modules.get(node.target) if node.op == "call_module" else None


def layer_module_problem(m: nn.Module, base: type, what: str, forward_ok: bool = False) -> Optional[str]:
    """Why `m`, an instance of `base` (Conv2d, Linear), cannot be fused as one (None if it can).

    `forward_ok`: a subclass forward fxfuse knows (timm's Conv2dSame) is not a problem.
    """
    if type(m).forward is not base.forward and not forward_ok:
        return f"{type(m).__name__} overrides {base.__name__}.forward"
    if isinstance(m._parameters.get("weight"), nn.parameter.UninitializedParameter):
        return f"Lazy{base.__name__} is not initialized yet (run one forward first)"
    return hooks_problem(m, what)


def conv_module_problem(m: nn.Module) -> Optional[str]:
    """Why module `m` cannot be fused as a Conv2d (None if it can)."""
    if not isinstance(m, nn.Conv2d):
        return f"{type(m).__name__} is not a Conv2d"
    if type(m)._conv_forward is not nn.Conv2d._conv_forward:
        return f"{type(m).__name__} overrides Conv2d.forward"
    return layer_module_problem(m, nn.Conv2d, "conv", forward_ok=is_conv2d_same(m))


def bn_module_problem(m: nn.Module) -> Optional[str]:
    """Why module `m` cannot be fused as a BatchNorm2d (None if it can)."""
    if isinstance(m, nn.SyncBatchNorm):
        return "SyncBatchNorm all-reduces statistics across processes; not fused"
    if not isinstance(m, nn.BatchNorm2d):
        return f"{type(m).__name__} is not a BatchNorm2d"
    if is_norm_act(m):
        return norm_act_problem(m)
    if type(m).forward is not _BatchNorm.forward or type(m)._check_input_dim is not nn.BatchNorm2d._check_input_dim:
        return f"{type(m).__name__} overrides BatchNorm2d.forward"
    if isinstance(m._parameters.get("weight"), nn.parameter.UninitializedParameter) or isinstance(
        m._buffers.get("running_mean"), nn.parameter.UninitializedBuffer
    ):
        return "LazyBatchNorm2d is not initialized yet (run one forward first)"
    return hooks_problem(m, "BatchNorm")


def norm_act_problem(m: nn.Module) -> Optional[str]:
    """Why a timm BatchNormAct2d's drop/act cannot be part of a fused op (None if they can)."""
    drop, act = getattr(m, "drop", None), getattr(m, "act", None)
    if type(drop) is not nn.Identity or has_hooks(drop):
        return f"{type(m).__name__}.drop is {type(drop).__name__}, which the fused op does not apply"
    if act is None or has_hooks(act) or module_activation(act) is None:
        return f"{type(m).__name__}.act is {type(act).__name__}, which fxfuse has no fused kernel for"
    return None


def norm_act_activation(m: nn.Module) -> Optional[Activation]:
    """The activation a timm BatchNormAct2d applies itself ("none" for apply_act=False); None for other modules."""
    return module_activation(m.act) if is_norm_act(m) else None


def pool_module_call(
    node: fx.Node, modules: dict[str, nn.Module], cls: type, attributes: tuple[str, ...]
) -> tuple[Optional[tuple], Optional[str]]:
    """For a call of a `cls` module (exactly that class, unhooked, one positional input): the
    functional call it makes, ((input,), {attribute: value}); else why it cannot be rewritten."""
    m = modules.get(node.target)
    if has_hooks(m):
        return None, hooks_problem(m, cls.__name__)
    if len(node.args) != 1 or node.kwargs:
        return None, f"unexpected {cls.__name__} call arguments"
    return ((node.args[0],), {k: getattr(m, k) for k in attributes}), None


def is_conv_function(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in (F.conv2d, torch.conv2d)


def is_bn_function(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is F.batch_norm


def _arg(node: fx.Node, index: int, name: str, default: Any) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _configured(specs: tuple[ActivationSpec, ...], setting: Callable[[ActivationSpec], Any]) -> Optional[Activation]:
    """The first of `specs` whose setting (`setting(spec)`: its argument's value in this call
    or module) selects it, with act_param from it; None if none does."""
    for spec in specs:
        if spec.argument is None:
            return Activation(spec.name)
        value = setting(spec)
        if spec.value is not None:
            if value == spec.value:
                return Activation(spec.name)
        elif isinstance(value, (int, float)):
            return Activation(spec.name, float(value))
    return None


def module_activation(m: nn.Module) -> Optional[Activation]:
    """The activation module `m` computes (nn.Identity: "none"), or None."""
    specs = BY_MODULE.get(type(m))
    if specs:
        return _configured(specs, lambda spec: getattr(m, spec.argument))
    # timm's activation modules whose forward is exactly one torch activation (timm.layers.activations).
    forward = type(m).forward
    if getattr(forward, "__module__", None) == "timm.layers.activations":
        specs = BY_TIMM_FORWARD.get(getattr(forward, "__qualname__", ""))
        return Activation(specs[0].name) if specs else None
    return None


def activation_of(node: fx.Node, modules: dict[str, nn.Module]) -> Optional[Activation]:
    """The activation `node` computes of its first input, or None."""
    if node.op == "call_module":
        m = modules.get(node.target)
        if m is None or has_hooks(m):
            return None
        act = module_activation(m)
        return None if act is None or act.name == "none" else act
    if node.op == "call_function" and node.target in BY_FUNCTION:
        return _configured(BY_FUNCTION[node.target], lambda spec: _arg(node, 1, spec.argument, spec.default))
    if node.op == "call_method" and node.target in BY_METHOD:
        return Activation(BY_METHOD[node.target][0].name)
    return None


_METADATA_ATTRIBUTES = ("ndim", "shape", "dtype", "device")
_METADATA_METHODS = ("size", "dim")


def reads_only_metadata(user: fx.Node, node: fx.Node, attributes: tuple[str, ...] = _METADATA_ATTRIBUTES) -> bool:
    """Whether `user` reads nothing of `node` but its rank, shape, dtype or device (or, with
    `attributes`, only those of these attributes; `.size()` and `.dim()` always count)."""
    if user.kwargs or not user.args or user.args[0] is not node or node in user.args[1:]:
        return False
    if user.op == "call_function" and user.target is getattr:
        return len(user.args) == 2 and user.args[1] in attributes
    return user.op == "call_method" and user.target in _METADATA_METHODS


def first_input(node: fx.Node) -> Optional[fx.Node]:
    if node.args:
        first = node.args[0]
    else:
        first = node.kwargs.get("input", node.kwargs.get("self"))
    return first if isinstance(first, fx.Node) else None


def single_user(node: fx.Node) -> Optional[fx.Node]:
    return next(iter(node.users)) if len(node.users) == 1 else None


def node_scope(node: fx.Node) -> str:
    """Qualified name of the innermost module whose forward created `node`."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path, _ = list(stack.values())[-1]
    return path


def site_name(node: fx.Node) -> str:
    """Module path for call_module nodes; 'scope:function' for functional calls."""
    if node.op == "call_module":
        return str(node.target)
    name = getattr(node.target, "__name__", str(node.target))
    scope = node_scope(node)
    return f"{scope}:{name}" if scope else name


__all__ = [
    "Activation",
    "activation_of",
    "bn_module_problem",
    "conv_module_problem",
    "first_input",
    "layer_module_problem",
    "is_bn_function",
    "is_conv_function",
    "module_activation",
    "module_of",
    "node_scope",
    "norm_act_activation",
    "reads_only_metadata",
    "single_user",
    "site_name",
]


def permute_of(node: fx.Node) -> Optional[tuple[fx.Node, tuple[int, ...]]]:
    """(input, dims) of a permute with constant dims."""
    if node.kwargs or len(node.args) < 2:
        return None
    if node.op == "call_function" and node.target is torch.permute and len(node.args) == 2:
        dims = node.args[1]
    elif node.op == "call_method" and node.target == "permute":
        dims = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)) else node.args[1:]
    else:
        return None
    if not all(type(d) is int for d in dims):
        return None
    return node.args[0], tuple(dims)
