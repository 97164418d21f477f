"""Conv2d → permute(0, 2, 3, 1) → LayerNorm → Linear  ⇒  fxfuse::conv_layer_norm_linear.

Runs in mode="memory", before layer_norm_linear: ConvNeXt's depthwise conv → LayerNorm → fc1. Eager
keeps the conv's input, its output (the layer norm's input) and the layer norm's output;
layer_norm_linear's op drops the last, this one the conv output too and runs the conv again in
backward (ops/conv_layer_norm_linear.py). For a depthwise conv that costs about what a pointwise
pass does (98 FLOPs per element of a 7×7 conv); the policy ranks it as an upgrade of the
layer_norm_linear and depthwise_conv sites on the same layers, by recompute FLOPs per byte
freed, so a budget takes the cheap ones first. The conv output and the permute must have no
other user (else the conv output is kept anyway).
"""

from __future__ import annotations

from typing import Optional

import torch.fx as fx

from ... import ops
from ..known_modules import is_conv2d_same
from . import estimates
from .calls import as_conv, conv_arguments, conv_weight_shape
from .context import PassContext
from .driver import FusionPass, Site
from .layer_norm_linear import norm_linear_at, redirect_shape_reads
from .matchers import permute_of, site_name

_CHANNELS_LAST = (0, 2, 3, 1)


def match(node: fx.Node, ctx: PassContext) -> Optional[Site]:
    found = norm_linear_at(node, ctx)
    if found is None or found.problem:
        return None  # layer_norm_linear reports the problem
    permuted = permute_of(found.source)
    if permuted is None or permuted[1] != _CHANNELS_LAST or len(found.source.users) != 1:
        return None
    conv_node = permuted[0]
    if not isinstance(conv_node, fx.Node) or len(conv_node.users) != 1:
        return None
    conv, problem = as_conv(conv_node, ctx)
    if conv is None or problem:
        return None
    m = conv.module
    if m is not None and (is_conv2d_same(m) or m.padding_mode != "zeros" or isinstance(m.padding, str)):
        return None  # padding the conv module applies itself: left to the other passes
    names = (site_name(conv_node), *found.names)

    def build():
        kwargs = conv_arguments(conv, ctx)
        norm_linear = found.kwargs(ctx)
        return ctx.graph.call_function(
            ops.conv_layer_norm_linear,
            (kwargs.pop("input"),),
            dict(
                conv_weight=kwargs["weight"],
                conv_bias=kwargs["bias"],
                stride=kwargs["stride"],
                padding=kwargs["padding"],
                dilation=kwargs["dilation"],
                groups=kwargs["groups"],
                **norm_linear,
            ),
        )

    saved = [estimates.nbytes(ctx.shapes, n) for n in (conv_node, found.norm)]
    return Site(
        names,
        ("conv2d", "layer_norm", "linear"),
        chain=[conv_node, found.source, found.norm, found.linear],
        build=build,
        prepare=lambda: redirect_shape_reads(found),
        op="fxfuse::conv_layer_norm_linear",
        saved_bytes=None if None in saved else sum(saved),
        recompute_flops=_flops(ctx, conv_node, conv),
        recompute_bytes=estimates.layer_moved(ctx.shapes, conv_node),
        reason="keeps the conv's input; runs the conv and the layer norm again in backward",
    )


PASS = FusionPass(match, modes=("memory",), recomputes=True)


def _flops(ctx: PassContext, node: fx.Node, conv) -> Optional[int]:
    """One more conv forward."""
    out, shape = estimates.numel(ctx.shapes, node), conv_weight_shape(conv, ctx)
    if out is None or shape is None:
        return None
    return 2 * out * shape[1] * shape[2] * shape[3]
