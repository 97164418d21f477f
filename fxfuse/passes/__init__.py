"""fxfuse's graph passes, run in forward order over one traced graph.

Each pass is `run(ctx: PassContext) -> int` (number of sites rewritten); it refuses
unsafe matches first (recording why in ctx.report.skipped), then rewrites through
`rewrite.replace_chain`.
"""
from __future__ import annotations

from . import bn_act, conv_bn_act, gelu, inplace_add, linear_conv_act
from .context import MODES, PassContext

PASSES = (conv_bn_act.run, bn_act.run, linear_conv_act.run, gelu.run, inplace_add.run)


def run_passes(ctx: PassContext) -> int:
    total = sum(p(ctx) for p in PASSES)
    ctx.graph.lint()
    return total


__all__ = ["MODES", "PASSES", "PassContext", "run_passes"]
