"""`fused + other`  ⇒  runtime.add_into(fused, other) when nothing else uses `fused`.

FX traces `out += identity` (ResNet's residual add) as an out-of-place add, so the
traced graph allocates and fills a new activation where eager wrote over `out`. The
output of a Conv→BN site rewritten without an activation is a fresh tensor that no
backward keeps (the fused op saves only its input; its eager fallback, batch norm,
saves its input too), so when the add is its only use, adding into it gives the
same tensor as the out-of-place add. The output of a plain BatchNorm2d module (the
Conv→BN sites mode="fast" leaves to eager) is such a tensor too: batch norm's
backward keeps its input and statistics, never its output. `runtime.add_into` checks
the rest at run time.
"""

from __future__ import annotations

import operator

import torch.fx as fx
from torch import nn

from ... import ops
from .. import runtime, user_checkpoint
from ..hooks import has_hooks
from .context import PassContext
from .rewrite import replace_chain

_ADDS = (operator.add, operator.iadd)


def plain_batch_norm(module) -> bool:
    return (
        isinstance(module, nn.BatchNorm2d) and type(module).forward is nn.BatchNorm2d.forward and not has_hooks(module)
    )


def _fresh(node, modules: dict) -> bool:
    """A Conv→BN (no activation) site output, or a plain BatchNorm2d module's output, used only once."""
    if not isinstance(node, fx.Node) or len(node.users) != 1:
        return False
    if node.op == "call_module":
        return plain_batch_norm(modules.get(node.target))
    if node.op != "call_function":
        return False
    if node.target is runtime.conv_bn_act_module:
        return len(node.args) >= 4 and node.args[3] == "none"
    if node.target is runtime.bn_act_conv_module:
        return len(node.args) == 8 and node.args[6] == "none"
    if node.target is ops.conv_bn_act:
        return not node.args and node.kwargs.get("act") == "none"
    return False


def run(ctx: PassContext) -> int:
    rewritten = 0
    for node in list(ctx.graph.nodes):
        if node.op != "call_function" or node.target not in _ADDS or len(node.args) != 2 or node.kwargs:
            continue
        a, b = node.args
        if _fresh(a, ctx.modules):
            fresh, other = a, b
        elif _fresh(b, ctx.modules):  # IEEE addition commutes: other + fresh == fresh + other
            fresh, other = b, a
        else:
            continue
        if not user_checkpoint.one_region((fresh, node)):
            continue  # a region's output is not written in place outside it
        replace_chain(
            ctx.graph,
            [node],
            lambda fresh=fresh, other=other: ctx.graph.call_function(runtime.add_into, (fresh, other)),
        )
        rewritten += 1
    return rewritten
