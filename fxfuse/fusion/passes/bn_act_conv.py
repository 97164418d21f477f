"""BatchNorm2d → activation → Conv2d  ⇒  fxfuse::bn_act_conv (the activation output is not kept).

Runs after the fusing passes, in every mode, over what they left: a rewritten
BN→activation site (runtime.batch_norm_act_module) whose output feeds one conv and nothing
else, where that conv is a plain Conv2d module call or the conv of a rewritten
Conv→BN→activation site (runtime.conv_bn_act_module). The two become one
runtime.bn_act_conv_module call. Eager's conv keeps its input, the activation output,
for its weight gradient; the merged op keeps only the BN input (which the BN site
keeps anyway) and rebuilds the activation output in backward with one pointwise pass.
No convolution runs more often than before.

The BN site's data takes the credit: its op becomes fxfuse::bn_act_conv and
its saved bytes include the activation output.
"""

from __future__ import annotations

from typing import Optional

import torch.fx as fx
from torch import nn

from .. import runtime, user_checkpoint
from ..graphs import provenance
from ..known_modules import is_conv2d_same
from . import estimates
from .context import PassContext
from .driver import SITE_META as SITE
from .matchers import conv_module_problem


def _plain_conv(module) -> bool:
    """A Conv2d the fused op convolves exactly: zero padding given as numbers, no subclass forward, no hooks."""
    return (
        isinstance(module, nn.Conv2d)
        and conv_module_problem(module) is None
        and not is_conv2d_same(module)
        and module.padding_mode == "zeros"
        and not isinstance(module.padding, str)
    )


def _attr(ctx: PassContext, node) -> Optional[nn.Module]:
    if isinstance(node, fx.Node) and node.op == "get_attr":
        return ctx.modules.get(node.target)
    return None


def _merge(ctx: PassContext, bn_site: fx.Node, user: fx.Node) -> Optional[fx.Node]:
    """The merged call replacing `bn_site` → `user`, or None where they cannot merge."""
    y, bn, act, act_param = bn_site.args
    if user.op == "call_module" and user.args == (bn_site,) and not user.kwargs:
        conv = ctx.modules.get(user.target)
        if not _plain_conv(conv):
            return None
        with ctx.graph.inserting_before(user):
            return ctx.graph.call_function(
                runtime.bn_act_conv_module, (y, bn, act, act_param, ctx.get_attr(user.target))
            )
    if user.op == "call_function" and user.target is runtime.conv_bn_act_module and user.args[0] is bn_site:
        _, conv_attr, out_bn, out_act, out_act_param = user.args
        if not _plain_conv(_attr(ctx, conv_attr)) or user.kwargs:
            return None
        with ctx.graph.inserting_before(user):
            return ctx.graph.call_function(
                runtime.bn_act_conv_module, (y, bn, act, act_param, conv_attr, out_bn, out_act, out_act_param)
            )
    return None


def run(ctx: PassContext) -> int:
    merged = 0
    for node in list(ctx.graph.nodes):
        if node.op != "call_function" or node.target is not runtime.batch_norm_act_module or len(node.args) != 4:
            continue
        if len(node.users) != 1 or node.kwargs:
            continue
        user = next(iter(node.users))
        if not user_checkpoint.one_region((node, user)):
            continue
        new = _merge(ctx, node, user)
        if new is None:
            continue
        new.meta.update(provenance(user, user_checkpoint.KEY))
        if user in ctx.shapes:
            ctx.shapes[new] = ctx.shapes[user]
        if SITE in user.meta:
            new.meta[SITE] = user.meta[SITE]
        _credit(ctx, node, user)
        user.replace_all_uses_with(new)
        ctx.graph.erase_node(user)
        ctx.graph.erase_node(node)
        merged += 1
    return merged


def _credit(ctx: PassContext, bn_site: fx.Node, user: fx.Node) -> None:
    site = bn_site.meta.get(SITE)
    if site is None:
        return
    conv = user.target if user.op == "call_module" else user.args[1].target
    site.op = "fxfuse::bn_act_conv"
    site.merged_into = conv
    site.reason += f"; its output feeds only {conv} and is not kept: rebuilt in {conv}'s backward"
    output = estimates.nbytes(ctx.shapes, bn_site)
    if site.saved_bytes is not None:
        site.saved_bytes = None if output is None else site.saved_bytes + output
