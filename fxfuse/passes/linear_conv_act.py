"""Linear → activation and Conv2d → activation  ⇒  fxfuse::linear_act / fxfuse::conv_act.

Runs in mode="memory", after conv_bn_act (which takes convs followed by a BN). Only
activations whose eager backward keeps their input (GELU, SiLU, Hardswish, LeakyReLU,
ReLU6, out of place) are rewritten: that input is the widest buffer of a transformer
MLP (4x the model width) and a pure function of the Linear/Conv input, which is kept
anyway. The fused op recomputes it in backward.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ..ops import act_functional
from ..report import FusedSite, SkippedSite
from . import estimates
from .calls import activation_after, as_conv, pattern_name
from .known_modules import is_conv2d_same
from .context import PassContext
from .matchers import has_hooks, site_name
from .rewrite import replace_chain

MODES = ("memory",)
_LINEAR_ARGS = ("input", "weight", "bias")


def _linear_problem(m: nn.Module) -> Optional[str]:
    if type(m).forward is not nn.Linear.forward:
        return f"{type(m).__name__} overrides Linear.forward"
    if isinstance(m.weight, nn.parameter.UninitializedParameter):
        return "LazyLinear is not initialized yet (run one forward first)"
    if has_hooks(m):
        return "the Linear module has hooks, which the fused op would not run"
    return None


def _as_linear(node: fx.Node, ctx: PassContext) -> tuple[Optional[Callable[[], dict]], Optional[str]]:
    """A maker of F.linear arguments (nodes or constants) for a Linear call, or why it can't be fused.

    Makers create get_attr nodes, so they run at the insertion point of the rewrite.
    """
    if node.op == "call_module":
        m = ctx.modules.get(node.target)
        if not isinstance(m, nn.Linear):
            return None, None
        problem = _linear_problem(m) or (None if len(node.args) == 1 and not node.kwargs
                                         else "unexpected Linear call arguments")
        if problem:
            return None, problem
        return lambda: {"input": node.args[0], "weight": ctx.get_attr(f"{node.target}.weight"),
                        "bias": ctx.get_attr(f"{node.target}.bias") if m.bias is not None else None}, None
    if node.op == "call_function" and node.target in (F.linear, torch._C._nn.linear):
        if len(node.args) > 3 or set(node.kwargs) - set(_LINEAR_ARGS):
            return None, "unrecognised F.linear arguments"
        args = {"bias": None, **dict(zip(_LINEAR_ARGS, node.args)), **node.kwargs}
        return lambda: args, None
    return None, None


def _conv_args(conv, ctx: PassContext) -> tuple[Optional[Callable[[], dict]], Optional[str]]:
    if conv.module is None:
        return lambda: dict(conv.args), None
    m = conv.module
    if is_conv2d_same(m):
        return None, "timm Conv2dSame (padding computed per call) followed by an activation is not fused"
    if m.padding_mode != "zeros":
        return None, f"padding_mode={m.padding_mode!r} conv→activation is not fused"
    return lambda: {"input": conv.input, "weight": ctx.get_attr(f"{conv.name}.weight"),
                    "bias": ctx.get_attr(f"{conv.name}.bias") if m.bias is not None else None,
                    "stride": m.stride, "padding": m.padding, "dilation": m.dilation, "groups": m.groups}, None


def run(ctx: PassContext) -> int:
    if ctx.mode not in MODES:
        return 0
    fused = 0
    for node in list(ctx.graph.nodes):
        if node.graph is not ctx.graph or node.op not in ("call_module", "call_function"):
            continue
        target = ctx.modules.get(node.target) if node.op == "call_module" else node.target
        if isinstance(target, nn.Conv2d) or target in (F.conv2d, torch.conv2d):
            kind, op, fn = "conv2d", "fxfuse::conv_act", act_functional.conv_act
        elif isinstance(target, nn.Linear) or target in (F.linear, torch._C._nn.linear):
            kind, op, fn = "linear", "fxfuse::linear_act", act_functional.linear_act
        else:
            continue
        act = activation_after(node, ctx)
        if act is None or act.activation.name not in estimates.SAVES_INPUT or act.inplace or act.later_users:
            continue
        names = (site_name(node), site_name(act.node))
        pattern = pattern_name(kind, act.activation.describe())
        if kind == "linear":
            args, problem = _as_linear(node, ctx)
        else:
            conv, problem = as_conv(node, ctx)
            args, problem = (None, problem) if conv is None else _conv_args(conv, ctx)
        if args is None and problem is None:
            continue
        if problem:
            ctx.report.skipped.append(SkippedSite(names, pattern, problem))
            continue
        if ctx.allowed is not None and names not in ctx.allowed:
            continue
        saved = estimates.nbytes(ctx.shapes, node)
        flops = _flops(ctx, node, kind)
        replace_chain(ctx.graph, [node, act.node], lambda: ctx.graph.call_function(
            fn, (), dict(args(), act=act.activation.name, act_param=act.activation.param)))
        ctx.report.fused.append(FusedSite(names, pattern, act.activation.describe(), op, saved, flops,
                                          f"keeps the {kind} input; recomputes the {kind} and activation in backward",
                                          ctx.mode))
        fused += 1
    return fused


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
