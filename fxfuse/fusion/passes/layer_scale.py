"""Linear → [Identity / Dropout(p=0)] → [permute] → × scale  ⇒  fxfuse::act_linear_scale.

Runs in every mode, after act_linear and layer_norm_linear. A Linear (a module, or the
act_linear call an activation was merged into) whose output is multiplied by a
parameter that scales each output feature (a LayerScale: torchvision's ConvNeXt
`layer_scale * permute(fc2(...))`, timm's `x.mul(gamma.reshape(1, -1, 1, 1))` and
`x * gamma`) becomes one call. Eager's multiply keeps the Linear's output for the
scale's gradient; the fused op gets that gradient from the product the weight gradient
computes anyway, so it keeps nothing more than the Linear's input. No matmul runs twice.
The scale's shape, the permutation and the modules in between are checked again at call
time (runtime.act_linear_scale_module); where they do not fit, the modules run eagerly.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx
from torch import nn

from .. import runtime
from . import estimates
from .act_linear import passes_through
from .calls import as_linear
from .context import PassContext
from .driver import SITE_META, FusionPass, Site
from .matchers import permute_of

_RESHAPES = ("reshape", "view")


def _mul_operands(node: fx.Node) -> Optional[tuple]:
    if node.kwargs or len(node.args) != 2:
        return None
    if node.op == "call_function" and node.target in (operator.mul, torch.mul):
        return node.args
    if node.op == "call_method" and node.target == "mul":
        return node.args
    return None


def _is_scale(node, ctx: PassContext) -> bool:
    """A parameter (get_attr), or a reshape / view of one to constant sizes."""
    if not isinstance(node, fx.Node) or len(node.users) != 1:
        return False
    if node.op == "call_method" and node.target in _RESHAPES and not node.kwargs:
        sizes = node.args[1:]
        if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)):
            sizes = sizes[0]
        return all(type(s) is int for s in sizes) and _is_scale(node.args[0], ctx)
    if node.op != "get_attr":
        return False
    try:
        return isinstance(ctx.root.get_parameter(node.target), nn.Parameter)
    except AttributeError:
        return False


def _layer(node: fx.Node, ctx: PassContext) -> Optional[tuple]:
    """(source, act, act_param, linear get_attr or target, modules between act and linear) of a
    Linear module call or an act_linear_module call; None for anything else."""
    if node.op == "call_function" and node.target is runtime.act_linear_module:
        source, act, param, linear, *pre = node.args
        return source, act, param, linear, tuple(pre)
    if node.op == "call_module":
        args, problem = as_linear(node, ctx)
        if args is not None and problem is None:
            return node.args[0], "none", 0.0, node.target, ()
    return None


def match(node: fx.Node, ctx: PassContext) -> Optional[Site]:
    operands = _mul_operands(node)
    if operands is None:
        return None
    scales = [o for o in operands if _is_scale(o, ctx)]
    if len(scales) != 1:
        return None
    (scale,) = scales
    y = operands[1] if operands[0] is scale else operands[0]
    if not isinstance(y, fx.Node) or len(y.users) != 1:
        return None
    chain, dims = [node], ()
    permuted = permute_of(y)
    if permuted is not None:
        chain.append(y)
        y, dims = permuted
    post = []
    while isinstance(y, fx.Node) and len(y.users) == 1 and passes_through(y, ctx):
        chain.append(y)
        post.append(y)
        y = y.args[0]
    if not isinstance(y, fx.Node) or len(y.users) != 1:
        return None
    layer = _layer(y, ctx)
    if layer is None:
        return None
    chain.append(y)
    source, act, act_param, linear, pre = layer
    post_targets = [p.target for p in reversed(post)]
    linear_name = linear if isinstance(linear, str) else linear.target
    scale_meta, layer_meta = ctx.shapes.get(scale), ctx.shapes.get(y)
    features = getattr(ctx.modules.get(linear_name), "out_features", None)
    if scale_meta is not None and layer_meta is not None and features is not None:
        if not runtime.scales_features(tuple(scale_meta.shape), len(layer_meta.shape), dims, features):
            return None  # a broadcast that is not one scale per feature: eager's multiply
    parameter = scale
    while parameter.op != "get_attr":
        parameter = parameter.args[0]
    merged = y.meta.get(SITE_META) if y.op == "call_function" else None  # the act_linear site's data

    def build():
        if merged is not None:
            merged.merged_into = parameter.target
            merged.reason += (
                f"; runs as one fxfuse::act_linear_scale call with the layer scale {parameter.target} after it"
            )
        linear_node = ctx.get_attr(linear) if isinstance(linear, str) else linear
        post_nodes = tuple(ctx.get_attr(t) for t in post_targets)
        return ctx.graph.call_function(
            runtime.act_linear_scale_module, (source, act, act_param, linear_node, pre, post_nodes, dims, scale)
        )

    return Site(
        (linear_name, parameter.target),
        ("linear", "layer_scale"),
        chain=chain[::-1],
        build=build,
        op="fxfuse::act_linear_scale",
        saved_bytes=estimates.nbytes(ctx.shapes, node),
        recompute_flops=0 if ctx.shapes else None,
        reason="keeps the linear's input; the scale's gradient comes from the weight gradient's product",
    )


PASS = FusionPass(match)
