"""fxfuse's graph passes, run in forward order over one traced graph.

Each pass is a callable `(ctx: PassContext) -> int` (number of sites rewritten). The
fusing passes are `driver.FusionPass`es: a matcher per pattern, one driver that
records skipped sites with their reasons, applies the policy's selection, rewrites
through `rewrite.replace_chain` and reports. `act_linear` runs before `linear_conv_act`, so
that an MLP's activation is merged into the Linear after it (no matmul recomputed) rather
than recomputed with the Linear before it (same bytes kept); `norm_linear` merges a
LayerNorm into the Linear after it (in mode="memory" `conv_norm_linear` first takes a conv
→ LayerNorm → Linear, recomputing the conv), `layer_scale` a per-feature scale (LayerScale) into the
Linear before it. `bn_act_conv` merges a rewritten BN→activation
site into the conv after it (crediting the BN site's report entry); `depthwise_conv` then gives the large-kernel
depthwise convs left over fxfuse's conv backward (time, not memory); `cat_input` then has a fused op
whose input is a concatenation keep its pieces instead, where those are kept anyway (it needs every
fused op in place to know what is kept); `inplace_add`
rewrites through `replace_chain` too, but reports no sites (it saves an allocation,
not memory).
"""

from __future__ import annotations

from . import (
    act_linear,
    bn_act,
    bn_act_conv,
    cat_input,
    conv_bn_act,
    conv_norm_linear,
    depthwise_conv,
    gelu,
    inplace_add,
    layer_scale,
    linear_conv_act,
    norm_linear,
)
from .context import PassContext

PASSES = (
    conv_bn_act.PASS,
    bn_act.PASS,
    act_linear.PASS,
    linear_conv_act.PASS,
    conv_norm_linear.PASS,
    norm_linear.PASS,
    layer_scale.PASS,
    gelu.PASS,
    bn_act_conv.run,
    depthwise_conv.PASS,
    cat_input.run,
    inplace_add.run,
)


def run_passes(ctx: PassContext) -> int:
    total = sum(p(ctx) for p in PASSES)
    ctx.graph.lint()
    return total


__all__ = ["PASSES", "PassContext", "run_passes"]
