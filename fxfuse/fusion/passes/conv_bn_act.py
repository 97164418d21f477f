"""Conv2d → BatchNorm2d (→ activation)  ⇒  fxfuse::conv_bn_act (recomputes the conv in backward).

Runs in mode="memory". The fused op keeps only the conv input, the weights and the
per-channel statistics; eager keeps the conv output too (and the BN output when the
activation's backward needs its input).
"""

from __future__ import annotations

from typing import Optional

import torch.fx as fx

from ... import ops
from .. import runtime
from . import estimates
from .calls import ActivationUse, LayerCall, as_batch_norm, as_conv, bn_activation, conv_arguments, conv_weight_shape
from .context import PassContext
from .driver import FusionPass, Site
from .matchers import first_input, reads_only_metadata, site_name

REASON = "keeps the conv input; recomputes conv, BN-apply and activation in backward"


def _build(conv: LayerCall, bn: LayerCall, act: Optional[ActivationUse], ctx: PassContext) -> fx.Node:
    act_name, act_param = (act.activation.name, act.activation.param) if act else ("none", 0.0)
    if conv.module is not None and bn.module is not None:
        return ctx.graph.call_function(
            runtime.conv_bn_act_module,
            (conv.input, ctx.get_attr(conv.name), ctx.get_attr(bn.name), act_name, act_param),
        )
    if bn.module is not None:  # a conv traced to F.conv2d, then a BN module
        a = conv.args
        return ctx.graph.call_function(
            runtime.conv_bn_act_bn_module,
            (a["input"], a["weight"], a["bias"], a["stride"], a["padding"], a["dilation"], a["groups"]),
            dict(bn=ctx.get_attr(bn.name), act=act_name, act_param=act_param),
        )
    bn_kwargs = {k: bn.args[k] for k in ("running_mean", "running_var", "training", "momentum", "eps")}
    bn_kwargs.update(bn_weight=bn.args["weight"], bn_bias=bn.args["bias"], act=act_name, act_param=act_param)
    if conv.module is not None:  # a conv module, then F.batch_norm
        return ctx.graph.call_function(
            runtime.conv_bn_act_conv_module, (conv.input, ctx.get_attr(conv.name)), bn_kwargs
        )
    kwargs = conv_arguments(conv, ctx)
    kwargs.update(
        running_mean=bn.args["running_mean"],
        running_var=bn.args["running_var"],
        bn_weight=bn.args["weight"],
        bn_bias=bn.args["bias"],
        training=bn.args["training"],
        momentum=bn.args["momentum"],
        eps=bn.args["eps"],
        act=act_name,
        act_param=act_param,
    )
    return ctx.graph.call_function(ops.conv_bn_act, (), kwargs)


def _metadata_users(conv: LayerCall, bn_node: fx.Node) -> Optional[list[fx.Node]]:
    """The conv output's users other than the BN if they read only its metadata, else None."""
    others = [u for u in conv.node.users if u is not bn_node]
    return others if all(reads_only_metadata(u, conv.node) for u in others) else None


def _redirect_metadata(conv: LayerCall, users: list[fx.Node], ctx: PassContext) -> None:
    """Point `users` (shape/rank/dtype/device reads of the conv output) at a stand-in that has the same
    metadata but no data, so that they run where they ran and raise what they raised."""
    if not users:
        return
    with ctx.graph.inserting_before(conv.node.next):  # after the conv, in creation order
        if conv.module is not None:
            like = ctx.graph.call_function(runtime.conv_module_output_like, (conv.input, ctx.get_attr(conv.name)))
        else:
            like = ctx.graph.call_function(runtime.conv2d_output_like, (), dict(conv.args))
    for user in users:
        user.replace_input_with(conv.node, like)


def _problem(conv: LayerCall, bn: LayerCall) -> Optional[str]:
    if _metadata_users(conv, bn.node) is None:
        return "the conv output has other users, so it must be kept anyway"
    return None


def match(bn_node: fx.Node, ctx: PassContext) -> Optional[Site]:
    bn, bn_problem = as_batch_norm(bn_node, ctx)
    src = first_input(bn_node)
    if (bn is None and bn_problem is None) or src is None:
        return None
    conv, conv_problem = as_conv(src, ctx)
    if conv is None and conv_problem is None:
        return None
    act = bn_activation(bn, ctx) if bn is not None else None
    names = (conv.name if conv else site_name(src), bn.name if bn else site_name(bn_node))
    if act is not None and not act.own:
        names += (site_name(act.node),)
    pattern = ("conv2d", "batch_norm2d", *([act.activation.describe()] if act else []))
    problem = bn_problem or conv_problem or _problem(conv, bn)
    if problem:
        return Site(names, pattern, problem)
    return Site(
        names,
        pattern,
        chain=[conv.node, bn_node, *(act.chain() if act else [])],
        build=lambda: _build(conv, bn, act, ctx),
        also_replace=(bn_node,) if act and act.later_users else (),
        prepare=lambda: _redirect_metadata(conv, _metadata_users(conv, bn_node), ctx),
        activation=act.activation.describe() if act else "none",
        op="fxfuse::conv_bn_act",
        saved_bytes=_saved_bytes(ctx, conv, bn, act),
        recompute_flops=estimates.conv_flops(ctx.shapes, conv.node, conv_weight_shape(conv, ctx), 1),
        recompute_bytes=estimates.layer_moved(ctx.shapes, conv.node),
        reason=REASON,
    )


PASS = FusionPass(match, modes=("memory",), recomputes=True)


def _saved_bytes(ctx: PassContext, conv: LayerCall, bn: LayerCall, act: Optional[ActivationUse]):
    conv_out = estimates.nbytes(ctx.shapes, conv.node)
    if conv_out is None:
        return None
    if act is None:
        return conv_out
    extra = estimates.activation_input_bytes(ctx.shapes, bn.node, act.activation.name, act.inplace)
    return None if extra is None else conv_out + extra
