"""BN→activation outputs that ops keep for backward  ⇒  rebuilt there from the BN input (ops/rebuild.py).

Runs last, where the plan asks for it (`Plan.rebuild`, a budget's cheapest entry: fusion/regions/
ranking.py). A `batch_norm_act` site whose every user only reads its output (below) is marked
`rebuild=True`: inside the optimized forward's `rebuild.Scope`, every op that would keep that
output for backward (a conv, a multiply, a concatenation's consumer) keeps the BN input and the
statistics instead, which the BN's backward keeps anyway, and backward rebuilds the output with
one pointwise pass, the same kernel, so the same bits.

The check is an allow-list: every user must be one that only reads the output (a conv, a Linear, a
pooling, `cat`, an out-of-place arithmetic op, a reduction, fxfuse's fused calls, `add_into` as the
added operand). An in-place op, a view, `.data`, the graph's output, a module with hooks or a
forward of its own, or a leaf fxfuse could not trace could change the value or let code outside
the graph reach it, and leaves the site as it was.
"""

from __future__ import annotations

import builtins
import operator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ... import ops
from .. import runtime
from ..hooks import has_hooks
from .context import PassContext
from .driver import SITE_META

# Users that read the output and neither write into it nor return it or a view of it. Anything else (an
# in-place op, a view, `getattr` of `.data` or `.mT`, a module with hooks or a forward of its own, a leaf
# fxfuse could not trace, a constructor of the model's output) stops the rebuild: a recipe rebuilds the
# value the BN computed, so nothing may change that value or reach it outside the graph.
_READING_FUNCTIONS = frozenset(
    {torch.cat, torch.stack, torch.add, torch.sub, torch.mul, torch.div, torch.mean, torch.sum, torch.sigmoid,
     operator.add, operator.sub, operator.mul, operator.truediv, F.conv2d, F.linear, F.avg_pool2d, F.max_pool2d,
     F.adaptive_avg_pool2d, F.adaptive_max_pool2d}
)  # fmt: skip
_READING_METHODS = frozenset({"mean", "sum", "add", "sub", "mul", "div", "sigmoid", "size", "dim"})
_METADATA = frozenset({"shape", "dtype", "device", "ndim"})
_READING_MODULES = (
    nn.Conv2d, nn.Linear, nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d, nn.Sigmoid,
)  # fmt: skip
# fxfuse's run-time calls read their inputs (add_into writes into its first).
_READING_RUNTIME = frozenset(
    getattr(runtime, name)
    for name in ("conv_bn_act_module", "conv_bn_act_bn_module", "conv_bn_act_conv_module", "conv_act_module",
                 "conv2d_module", "linear_act_module", "act_linear_module", "act_linear_scale_module",
                 "layer_norm_linear_module", "batch_norm_act_module", "bn_act_conv_module", "gelu_where_faster")
)  # fmt: skip


def _only_reads(user: fx.Node, node: fx.Node, ctx: PassContext) -> bool:
    if user.kwargs.get("inplace") is True or "out" in user.kwargs:
        return False
    if user.op == "call_module":
        module = ctx.modules.get(user.target)
        cls = type(module)
        return cls in _READING_MODULES and not has_hooks(module) and not getattr(module, "inplace", False)
    if user.op == "call_method":
        return user.target in _READING_METHODS
    if user.op != "call_function":
        return False
    target = user.target
    if target is builtins.getattr:
        return len(user.args) == 2 and user.args[1] in _METADATA
    if target is runtime.add_into:
        return bool(user.args) and user.args[0] is not node
    return target in _READING_FUNCTIONS or target in _READING_RUNTIME or _is_fxfuse_op(target)


def _is_fxfuse_op(target) -> bool:
    """A public fxfuse op function (fxfuse.ops.OPS and the cat_ variants): pure functions of their inputs."""
    name = getattr(target, "__name__", "")
    return getattr(ops, name, None) is target and (name in ops.OPS or name.startswith("cat_"))


def _rebuildable(node: fx.Node, ctx: PassContext) -> bool:
    if node.op != "call_function":
        return False
    if node.target is runtime.batch_norm_act_module:
        if len(node.args) != 4 or node.kwargs:  # pieces given: the pieces are kept, not the output
            return False
    elif node.target is ops.batch_norm_act:
        if node.kwargs.get("pieces") is not None or "rebuildable" in node.kwargs:
            return False
    else:
        return False
    return bool(node.users) and all(_only_reads(u, node, ctx) for u in node.users)


def run(ctx: PassContext) -> int:
    if not ctx.rebuild:
        return 0
    marked = 0
    for node in ctx.graph.nodes:
        if not _rebuildable(node, ctx):
            continue
        if node.target is runtime.batch_norm_act_module:
            node.kwargs = {"rebuild": True}
        else:
            node.kwargs = {**node.kwargs, "rebuildable": True}
        site = node.meta.get(SITE_META)
        if site is not None:
            site.reason += "; its output is not kept by the ops after it: backward rebuilds it from the BN input"
        marked += 1
    return marked
