"""BN→activation outputs that ops keep for backward  ⇒  rebuilt there from the BN input (ops/rebuild.py).

Runs last, where the plan asks for it (`Plan.rebuild`, a budget's cheapest entry: fusion/regions/
ranking.py). A `batch_norm_act` site whose output the graph neither returns nor changes in place
(nor through a view) is marked `rebuild=True`: inside the optimized forward's `rebuild.Scope`,
every op that would keep that output for backward (a conv, a multiply, a concatenation's
consumer) keeps the BN input and the statistics instead, which the BN keeps anyway, and backward
rebuilds the output with one pointwise pass, the same kernel, so the same bits.

Only the graph can change an intermediate, so a static check suffices: any user that may write
into the output or alias it (an in-place op or module, `add_into`, a view, the graph's output)
leaves the site as it was.
"""

from __future__ import annotations

import operator

import torch.fx as fx
from torch import nn

from ... import ops
from .. import runtime
from .context import PassContext
from .driver import SITE_META

_INPLACE_OPERATORS = frozenset(
    {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.ipow,
     operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift, operator.imatmul}
)  # fmt: skip
_VIEWS = frozenset(
    {"view", "view_as", "reshape", "reshape_as", "permute", "transpose", "t", "flatten", "unflatten", "squeeze",
     "unsqueeze", "expand", "expand_as", "narrow", "select", "split", "chunk", "unbind", "as_strided", "contiguous",
     "movedim", "swapaxes", "swapdims", "detach", "__getitem__", "getitem", "real", "imag", "diagonal", "unfold",
     "tensor_split", "split_with_sizes", "hsplit", "vsplit", "dsplit", "alias", "to", "type", "type_as", "data"}
)  # fmt: skip
_ALIASING_MODULES = (nn.Identity, nn.Flatten, nn.Unflatten)


def _name(target) -> str:
    return getattr(target, "__name__", str(target)).split(".")[-1]


def _may_alias_or_write(user: fx.Node, node: fx.Node, ctx: PassContext) -> bool:
    if user.op == "output":
        return True
    if user.kwargs.get("inplace") is True:
        return True
    if user.op == "call_module":
        module = ctx.modules.get(user.target)
        return isinstance(module, _ALIASING_MODULES) or getattr(module, "inplace", False) is True
    if user.op in ("call_function", "call_method"):
        target = user.target
        if (target is runtime.add_into or target in _INPLACE_OPERATORS) and user.args and user.args[0] is node:
            return True
        name = target if isinstance(target, str) else _name(target)
        return name in _VIEWS or (name.endswith("_") and not name.endswith("__"))
    return True


def _rebuildable(node: fx.Node, ctx: PassContext) -> bool:
    if node.op != "call_function":
        return False
    if node.target is runtime.bn_act_module:
        if len(node.args) != 4 or node.kwargs:  # pieces given: the pieces are kept, not the output
            return False
    elif node.target is ops.batch_norm_act:
        if node.kwargs.get("pieces") is not None or "rebuildable" in node.kwargs:
            return False
    else:
        return False
    return bool(node.users) and not any(_may_alias_or_write(u, node, ctx) for u in node.users)


def run(ctx: PassContext) -> int:
    if not ctx.rebuild:
        return 0
    marked = 0
    for node in ctx.graph.nodes:
        if not _rebuildable(node, ctx):
            continue
        if node.target is runtime.bn_act_module:
            node.kwargs = {"rebuild": True}
        else:
            node.kwargs = {**node.kwargs, "rebuildable": True}
        site = node.meta.get(SITE_META)
        if site is not None:
            site.reason += "; its output is not kept by the ops after it: backward rebuilds it from the BN input"
        marked += 1
    return marked
