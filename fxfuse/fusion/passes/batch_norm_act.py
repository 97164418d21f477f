"""BatchNorm2d → activation  ⇒  fxfuse::batch_norm_act (recomputes the normalized value in backward).

Runs in every mode, after conv_bn_act has taken the BNs it could. In mode="fast" it
also takes Conv→BN→act, keeping the conv output (no conv recompute) but not the BN
output. Needs an activation: a BN alone already keeps only its input.
"""

from __future__ import annotations

from typing import Optional

import torch.fx as fx

from ... import ops
from .. import runtime
from . import estimates
from .calls import ActivationUse, LayerCall, activation_after, as_batch_norm, as_conv, bn_activation
from .context import PassContext
from .driver import FusionPass, Site
from .matchers import first_input, site_name


def _build(bn: LayerCall, act: ActivationUse, ctx: PassContext) -> fx.Node:
    name, param = act.activation.name, act.activation.param
    if bn.module is not None:
        return ctx.graph.call_function(runtime.batch_norm_act_module, (bn.input, ctx.get_attr(bn.name), name, param))
    kwargs = {
        k: bn.args[k] for k in ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")
    }
    return ctx.graph.call_function(ops.batch_norm_act, (), dict(kwargs, act=name, act_param=param))


def _reason(bn_node: fx.Node, ctx: PassContext) -> str:
    reason = "keeps the BN input and statistics; recomputes BN-apply and activation in backward"
    src = first_input(bn_node)
    if src is not None and as_conv(src, ctx)[0] is not None:
        # conv_bn_act (mode="memory") would have taken it; only pointwise work is recomputed here.
        reason += " (conv output kept: no conv recompute)"
    return reason


def match(bn_node: fx.Node, ctx: PassContext) -> Optional[Site]:
    bn, problem = as_batch_norm(bn_node, ctx)
    if bn is None and problem is None:
        return None
    act = bn_activation(bn, ctx) if bn is not None else activation_after(bn_node, ctx)
    if act is None or act.activation.name == "none":
        return None
    names = (bn.name if bn else site_name(bn_node),) + (() if act.own else (site_name(act.node),))
    pattern = ("batch_norm2d", act.activation.describe())
    if problem:
        return Site(names, pattern, problem)
    saved = estimates.activation_input_bytes(ctx.shapes, bn_node, act.activation.name, act.inplace)
    return Site(
        names,
        pattern,
        chain=[bn_node, *act.chain()],
        build=lambda: _build(bn, act, ctx),
        also_replace=(bn_node,) if act.later_users else (),
        activation=act.activation.describe(),
        op="fxfuse::batch_norm_act",
        saved_bytes=saved if ctx.shapes else None,
        recompute_flops=0 if ctx.shapes else None,
        reason=_reason(bn_node, ctx),
    )


PASS = FusionPass(match)
