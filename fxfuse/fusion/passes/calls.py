"""Conv2d, BatchNorm2d and Linear calls in either form (module call or F.* call), normalised.

`as_conv` / `as_batch_norm` return `(call, problem)` (`as_linear`: F.linear's arguments
by name, {} for a module call): `call` when the node is a
fusable conv/BN, `problem` (a reason) when it is a conv/BN that cannot be fused
exactly, and `(None, None)` when it is neither.
"""

from __future__ import annotations

import functools
import inspect
import numbers
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .context import PassContext
from .matchers import (
    Activation,
    activation_of,
    bn_module_problem,
    conv_module_problem,
    first_input,
    is_bn_function,
    is_conv_function,
    layer_module_problem,
    norm_act_activation,
    site_name,
)

_CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_CONV_DEFAULTS = {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1}
_BN_SIGNATURE = inspect.signature(F.batch_norm)


@dataclass
class LayerCall:
    """A Conv2d or BatchNorm2d call: the module (module form) or the F.* arguments by name (functional form)."""

    node: fx.Node
    name: str
    module: Optional[nn.Module]
    args: dict[str, Any]
    # BN only: the activation the module applies itself (timm's BatchNormAct2d), "none" included.
    own_act: Optional[Activation] = None

    @property
    def input(self) -> fx.Node:
        return self.node.args[0] if self.module is not None else self.args["input"]


_LINEAR_ARGS = ("input", "weight", "bias")


def as_linear(node: fx.Node, ctx: PassContext) -> tuple[Optional[dict[str, Any]], Optional[str]]:
    """F.linear's arguments (nodes or constants) for a functional call, {} for a module call, or why not."""
    if node.op == "call_module":
        m = ctx.modules.get(node.target)
        if not isinstance(m, nn.Linear):
            return None, None
        problem = layer_module_problem(m, nn.Linear, "Linear") or (
            None if len(node.args) == 1 and not node.kwargs else "unexpected Linear call arguments"
        )
        return (None, problem) if problem else ({}, None)
    if node.op == "call_function" and node.target in (F.linear, torch._C._nn.linear):
        if len(node.args) > 3 or set(node.kwargs) - set(_LINEAR_ARGS):
            return None, "unrecognised F.linear arguments"
        return {"bias": None, **dict(zip(_LINEAR_ARGS, node.args)), **node.kwargs}, None
    return None, None


def _bind_conv(node: fx.Node) -> Optional[dict[str, Any]]:
    if len(node.args) > len(_CONV_ARGS) or set(node.kwargs) - set(_CONV_ARGS):
        return None
    bound = dict(_CONV_DEFAULTS)
    bound.update(zip(_CONV_ARGS, node.args))
    bound.update(node.kwargs)
    return bound if "input" in bound and "weight" in bound else None


def as_conv(node: fx.Node, ctx: PassContext) -> tuple[Optional[LayerCall], Optional[str]]:
    if node.op == "call_module":
        m = ctx.modules.get(node.target)
        if not isinstance(m, nn.Conv2d):
            return None, None
        problem = conv_module_problem(m)
        if problem is None and (len(node.args) != 1 or node.kwargs):
            problem = "unexpected conv call arguments"
        return (None, problem) if problem else (LayerCall(node, node.target, m, {}), None)
    if is_conv_function(node):
        args = _bind_conv(node)
        if args is None:
            return None, "unrecognised F.conv2d arguments"
        for key in ("stride", "padding", "dilation", "groups"):
            if isinstance(args[key], fx.Node):
                return None, f"F.conv2d {key} is computed at run time"
        return LayerCall(node, site_name(node), None, args), None
    return None, None


def conv_weight_shape(conv: LayerCall, ctx: PassContext) -> Optional[tuple[int, ...]]:
    """The conv's weight shape: the module's, or the example inputs' metadata for a functional call."""
    if conv.module is not None:
        return tuple(conv.module.weight.shape)
    weight = conv.args["weight"]
    meta = ctx.shapes.get(weight) if isinstance(weight, fx.Node) else None
    return None if meta is None else tuple(meta.shape)


def conv_arguments(conv: LayerCall, ctx: PassContext) -> dict[str, Any]:
    """F.conv2d's arguments for `conv`; for a module, get_attr nodes of its parameters (at the insertion point)."""
    if conv.module is None:
        return dict(conv.args)
    m = conv.module
    return {
        "input": conv.input,
        "weight": ctx.get_attr(f"{conv.name}.weight"),
        "bias": ctx.get_attr(f"{conv.name}.bias") if m.bias is not None else None,
        "stride": m.stride,
        "padding": m.padding,
        "dilation": m.dilation,
        "groups": m.groups,
    }


def as_batch_norm(node: fx.Node, ctx: PassContext) -> tuple[Optional[LayerCall], Optional[str]]:
    if node.op == "call_module":
        m = ctx.modules.get(node.target)
        if not isinstance(m, _BatchNorm):
            return None, None
        problem = bn_module_problem(m)
        if problem is None and (len(node.args) != 1 or node.kwargs):
            problem = "unexpected BatchNorm call arguments"
        if problem:
            return None, problem
        return LayerCall(node, node.target, m, {}, norm_act_activation(m)), None
    if is_bn_function(node):
        try:
            bound = _BN_SIGNATURE.bind(*node.args, **node.kwargs)
        except TypeError:
            return None, "unrecognised F.batch_norm arguments"
        bound.apply_defaults()
        args = dict(bound.arguments)
        for key in ("momentum", "eps"):
            if not isinstance(args[key], numbers.Real) or isinstance(args[key], bool):
                return None, f"F.batch_norm {key} is not a constant number"
        if isinstance(args["training"], fx.Node):
            return None, "F.batch_norm training flag is computed at run time"
        return LayerCall(node, site_name(node), None, args), None
    return None, None


@dataclass
class ActivationUse:
    activation: Activation
    node: fx.Node
    inplace: bool
    # Other users of the BN output that run after an in-place activation: they see
    # the activated value, so they can read the fused output too.
    later_users: tuple[fx.Node, ...] = ()
    own: bool = False  # applied inside the BN module itself (node is the BN node)

    def chain(self) -> list[fx.Node]:
        """The activation's node(s) to replace together with the BN node."""
        return [] if self.own else [self.node]


@functools.cache
def _inplace_index(function) -> Optional[int]:
    """The position of `function`'s `inplace` argument (F.relu: 1, F.leaky_relu: 2), if it has one."""
    try:
        parameters = list(inspect.signature(function).parameters)
    except (TypeError, ValueError):  # builtins (torch.relu, F.gelu) take no inplace flag
        return None
    return parameters.index("inplace") if "inplace" in parameters else None


def is_inplace(node: fx.Node, ctx: PassContext) -> bool:
    """Whether activation `node` writes its input (a trailing-underscore form or inplace=True)."""
    if node.op == "call_method":
        return node.target.endswith("_")
    if node.op == "call_module":
        return bool(getattr(ctx.modules.get(node.target), "inplace", False))
    if getattr(node.target, "__name__", "").endswith("_"):  # F.relu_, F.leaky_relu_, torch.relu_
        return True
    if node.kwargs.get("inplace") is True:
        return True
    index = _inplace_index(node.target)
    return index is not None and len(node.args) > index and node.args[index] is True


def bn_activation(bn: LayerCall, ctx: PassContext) -> Optional[ActivationUse]:
    """The activation fused with `bn`: the one its module applies itself, else the one applied to its output."""
    if bn.own_act is not None and bn.own_act.name != "none":
        return ActivationUse(bn.own_act, bn.node, bool(getattr(bn.module.act, "inplace", False)), own=True)
    return activation_after(bn.node, ctx)


def activation_after(bn_node: fx.Node, ctx: PassContext) -> Optional[ActivationUse]:
    """The activation applied to `bn_node`'s output that can be fused into it, if any."""
    users = list(bn_node.users)
    if len(users) > 1:
        order = {n: i for i, n in enumerate(ctx.graph.nodes)}
        users.sort(key=order.__getitem__)
    for user in users:
        act = activation_of(user, ctx.modules)
        if act is None or first_input(user) is not bn_node or _uses(user, bn_node) != 1:
            return None  # the first user is not a fusable activation
        if len(users) == 1:
            return ActivationUse(act, user, is_inplace(user, ctx))
        if is_inplace(user, ctx):
            return ActivationUse(act, user, True, tuple(u for u in users if u is not user))
        return None
    return None


def _uses(user: fx.Node, node: fx.Node) -> int:
    """How many times `user` reads `node`."""
    flat: list[fx.Node] = []
    fx.node.map_arg((user.args, user.kwargs), flat.append)
    return sum(1 for n in flat if n is node)
