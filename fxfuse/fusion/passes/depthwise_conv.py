"""Depthwise Conv2d with a kernel of 5×5 or more  ⇒  fxfuse::conv2d (fxfuse's weight gradient).

Runs in every mode, after the fusing passes (bn_act_conv included): a depthwise conv they
merged with a BN or an activation already runs fxfuse's conv backward inside the fused op. What is left (ConvNeXt's
7×7 convs, followed by a LayerNorm) is rewritten to `fxfuse::conv2d`: the same forward, the
same tensors kept for backward, and on CPU a weight gradient computed by fxfuse's depthwise
kernel, several times faster than oneDNN's (ops/conv2d.py). It saves no memory; the report
lists it for the time. 3×3 depthwise convs are left alone: there oneDNN's weight gradient is
as fast as fxfuse's (measured), so the rewrite would change nothing but rounding.
"""

from __future__ import annotations

from typing import Optional

import torch.fx as fx

from ... import ops
from .. import runtime
from .calls import as_conv, conv_weight_shape
from .context import PassContext
from .driver import FusionPass, Site
from .matchers import site_name

MIN_KERNEL_AREA = 25  # 5×5: where fxfuse's depthwise weight gradient measured faster than oneDNN's


def _depthwise_large(conv, ctx: PassContext) -> bool:
    shape = conv_weight_shape(conv, ctx)
    groups = conv.module.groups if conv.module is not None else conv.args["groups"]
    return (
        shape is not None
        and len(shape) == 4
        and isinstance(groups, int)
        and shape[0] == groups
        and shape[1] == 1
        and shape[2] * shape[3] >= MIN_KERNEL_AREA
    )


def match(node: fx.Node, ctx: PassContext) -> Optional[Site]:
    conv, problem = as_conv(node, ctx)
    if conv is None:
        return None  # not a conv, or one the fusing passes have reported on already
    if not _depthwise_large(conv, ctx):
        return None
    if node.op == "call_module":

        def build():
            return ctx.graph.call_function(runtime.conv2d_module, (node.args[0], ctx.get_attr(node.target)))
    else:

        def build():
            return ctx.graph.call_function(ops.conv2d, (), dict(conv.args))

    return Site(
        (site_name(node),),
        ("depthwise_conv",),
        chain=[node],
        build=build,
        op="fxfuse::conv2d",
        saved_bytes=0 if ctx.shapes else None,
        recompute_flops=0 if ctx.shapes else None,
        reason="same forward and saved tensors; on CPU the weight gradient comes from fxfuse's depthwise kernel",
    )


PASS = FusionPass(match)
