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
depthwise convs left over fxfuse's conv backward (time, not memory); `inplace_add`
rewrites through `replace_chain` too, but reports no sites (it saves an allocation,
not memory).
"""

from __future__ import annotations

from . import (
    act_linear,
    batch_norm_act,
    bn_act_conv,
    conv_bn_act,
    conv_layer_norm_linear,
    depthwise_conv,
    gelu,
    inplace_add,
    layer_norm_linear,
    layer_scale,
    linear_conv_act,
)
from .context import PassContext

PASSES = (
    conv_bn_act.PASS,
    batch_norm_act.PASS,
    act_linear.PASS,
    linear_conv_act.PASS,
    conv_layer_norm_linear.PASS,
    layer_norm_linear.PASS,
    layer_scale.PASS,
    gelu.PASS,
    bn_act_conv.run,
    depthwise_conv.PASS,
    inplace_add.run,
)


def run_passes(ctx: PassContext) -> int:
    total = sum(p(ctx) for p in PASSES)
    ctx.graph.lint()
    return total


__all__ = ["PASSES", "PassContext", "run_passes"]
