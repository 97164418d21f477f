"""fxfuse's graph passes, run in the order of PASSES over one captured graph (a copy: fusion/apply.py).

Each entry of PASSES is a `Pass`: a callable `(ctx: PassContext) -> int` (number of sites
rewritten) and why it runs where it does. The fusing passes are `driver.FusionPass`es: a
matcher per pattern, one driver that records skipped sites with their reasons, applies the
plan's site selection, rewrites through `rewrite.replace_chain` and records each site's data. `bn_act_conv`
merges sites the others rewrote, crediting the BN site's data; `inplace_add` rewrites
through `replace_chain` too, but reports no sites (it saves an allocation, not memory).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import (
    act_linear,
    avg_pool2d,
    batch_norm_act,
    bn_act_conv,
    cat_input,
    conv_bn_act,
    conv_layer_norm_linear,
    depthwise_conv,
    gelu,
    inplace_add,
    layer_norm_linear,
    layer_scale,
    linear_conv_act,
    max_pool2d,
    rebuild,
)
from .context import PassContext


@dataclass(frozen=True)
class Pass:
    """One pass in PASSES: `run(ctx) -> sites rewritten` (a driver.FusionPass or a function of the
    same signature) and why it runs where it does."""

    run: Callable[[PassContext], int]
    why: str


PASSES = (
    Pass(conv_bn_act.PASS, "first (mode memory): takes Conv→BN→act whole, recomputing the conv, before batch_norm_act"),
    Pass(batch_norm_act.PASS, "then BN→act (mode fast: Conv→BN→act too, conv output kept) where conv_bn_act did not"),
    Pass(act_linear.PASS, "before linear_conv_act: an activation merges into the next Linear, no matmul recomputed"),
    Pass(linear_conv_act.PASS, "then Linear/Conv→act (mode memory) whose output act_linear did not merge"),
    Pass(conv_layer_norm_linear.PASS, "before layer_norm_linear (mode memory): conv→LayerNorm→Linear whole"),
    Pass(layer_norm_linear.PASS, "after the Linear→act passes: a LayerNorm merges into the Linear after it"),
    Pass(layer_scale.PASS, "once the Linear sites exist: a per-feature scale merges into the Linear before it"),
    Pass(gelu.PASS, "a standalone GELU: what the passes above left"),
    Pass(bn_act_conv.run, "after the fusing passes: merges a rewritten BN→act site into the conv after it"),
    Pass(depthwise_conv.PASS, "last to fuse: large-kernel depthwise convs no site took get fxfuse's conv backward"),
    Pass(avg_pool2d.PASS, "reads no other pass's nodes; before cat_input, which must not count a pooled input as kept"),
    Pass(max_pool2d.PASS, "likewise: reads no other pass's nodes, and keeps none of its input"),
    Pass(cat_input.run, "after every fused op exists: a concatenated input is kept as its pieces where those are kept"),
    Pass(inplace_add.run, "adds into fused outputs, which exist once every site is rewritten"),
    Pass(rebuild.run, "last (where the plan asks): marks BN→act outputs no later node writes into or aliases"),
)


def run_passes(ctx: PassContext) -> int:
    total = sum(p.run(ctx) for p in PASSES)
    ctx.graph.lint()
    return total


__all__ = ["PASSES", "Pass", "PassContext", "run_passes"]
