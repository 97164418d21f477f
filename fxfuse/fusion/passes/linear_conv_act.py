"""Linear → activation and Conv2d → activation  ⇒  fxfuse::linear_act / fxfuse::conv_act.

Runs in mode="memory", after conv_bn_act (which takes convs followed by a BN). Only
activations whose eager backward keeps their input (GELU, SiLU, Hardswish, LeakyReLU,
ReLU6, out of place) are rewritten: that input is the widest buffer of a transformer
MLP (4x the model width) and a pure function of the Linear/Conv input, which is kept
anyway. The fused op recomputes it in backward.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ... import ops
from .. import runtime
from . import estimates
from .calls import activation_after, as_conv, as_linear
from .context import PassContext
from .driver import FusionPass, Site
from .matchers import site_name


def _kind(node: fx.Node, ctx: PassContext) -> Optional[str]:
    target = ctx.modules.get(node.target) if node.op == "call_module" else node.target
    if isinstance(target, nn.Conv2d) or target in (F.conv2d, torch.conv2d):
        return "conv2d"
    if isinstance(target, nn.Linear) or target in (F.linear, torch._C._nn.linear):
        return "linear"
    return None


def match(node: fx.Node, ctx: PassContext) -> Optional[Site]:
    kind = _kind(node, ctx)
    act = activation_after(node, ctx) if kind else None
    if act is None or act.activation.name not in estimates.SAVES_INPUT or act.inplace or act.later_users:
        return None
    if kind == "linear":
        args, problem = as_linear(node, ctx)
        module_fn, fn = runtime.linear_act_module, ops.linear_act
    else:
        conv, problem = as_conv(node, ctx)
        args = None if conv is None else conv.args
        module_fn, fn = runtime.conv_act_module, ops.conv_act
    if args is None and problem is None:
        return None
    names = (site_name(node), site_name(act.node))
    pattern = (kind, act.activation.describe())
    if problem:
        return Site(names, pattern, problem)
    name, param = act.activation.name, act.activation.param
    if node.op == "call_module":

        def build():
            return ctx.graph.call_function(module_fn, (node.args[0], ctx.get_attr(node.target), name, param))
    else:

        def build():
            return ctx.graph.call_function(fn, (), dict(args, act=name, act_param=param))

    return Site(
        names,
        pattern,
        chain=[node, act.node],
        build=build,
        activation=act.activation.describe(),
        op=f"fxfuse::{'conv' if kind == 'conv2d' else 'linear'}_act",
        saved_bytes=estimates.nbytes(ctx.shapes, node),
        recompute_flops=_flops(ctx, node, kind),
        recompute_bytes=estimates.layer_moved(ctx.shapes, node),
        reason=f"keeps the {kind} input; recomputes the {kind} and activation in backward",
    )


PASS = FusionPass(match, modes=("memory",), recomputes=True)


def _flops(ctx: PassContext, node: fx.Node, kind: str) -> Optional[int]:
    """Recompute cost: one more Linear/Conv forward."""
    out = estimates.numel(ctx.shapes, node)
    if out is None:
        return None
    if node.op == "call_module":
        shape = tuple(ctx.modules[node.target].weight.shape)
    else:
        weight = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
        meta = ctx.shapes.get(weight) if isinstance(weight, fx.Node) else None
        if meta is None:
            return None
        shape = tuple(meta.shape)
    per_output = shape[1] if kind == "linear" else shape[1] * shape[2] * shape[3]
    return 2 * out * per_output
