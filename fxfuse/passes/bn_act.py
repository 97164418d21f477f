"""BatchNorm2d → activation  ⇒  fxfuse::batch_norm_act (recomputes the normalized value in backward).

Runs in every mode, after conv_bn_act has taken the BNs it could. In mode="fast" it
also takes Conv→BN→act, keeping the conv output (no conv recompute) but not the BN
output. Needs an activation: a BN alone already keeps only its input.
"""
from __future__ import annotations

import torch.fx as fx

from .. import runtime
from ..ops import functional
from ..report import FusedSite, SkippedSite
from . import estimates
from .calls import ActivationUse, BNCall, activation_after, as_batch_norm, as_conv, bn_activation, pattern_name
from .context import PassContext
from .matchers import first_input, site_name
from .rewrite import replace_chain


def _build(bn: BNCall, act: ActivationUse, ctx: PassContext) -> fx.Node:
    name, param = act.activation.name, act.activation.param
    if bn.module is not None:
        return ctx.graph.call_function(runtime.bn_act_module, (bn.input, ctx.get_attr(bn.name), name, param))
    kwargs = {k: bn.args[k] for k in ("input", "running_mean", "running_var", "weight", "bias", "training",
                                      "momentum", "eps")}
    return ctx.graph.call_function(functional.batch_norm_act, (), dict(kwargs, act=name, act_param=param))


def _reason(bn_node: fx.Node, ctx: PassContext) -> str:
    reason = "keeps the BN input and statistics; recomputes BN-apply and activation in backward"
    src = first_input(bn_node)
    if src is not None and as_conv(src, ctx)[0] is not None:
        # conv_bn_act (mode="memory") would have taken it; only pointwise work is recomputed here.
        reason += " (conv output kept: no conv recompute)"
    return reason


def run(ctx: PassContext) -> int:
    fused = 0
    for bn_node in list(ctx.graph.nodes):
        if bn_node.graph is not ctx.graph or bn_node.op not in ("call_module", "call_function"):
            continue
        bn, problem = as_batch_norm(bn_node, ctx)
        if bn is None and problem is None:
            continue
        act = bn_activation(bn, ctx) if bn is not None else activation_after(bn_node, ctx)
        if act is None or act.activation.name == "none":
            continue
        names = (bn.name if bn else site_name(bn_node),) + (() if act.own else (site_name(act.node),))
        pattern = pattern_name("batch_norm2d", act.activation.describe())
        if problem:
            ctx.report.skipped.append(SkippedSite(names, pattern, problem))
            continue
        if ctx.allowed is not None and names not in ctx.allowed:
            continue
        saved = estimates.activation_input_bytes(ctx.shapes, bn_node, act.activation.name, act.inplace)
        reason = _reason(bn_node, ctx)
        replace_chain(ctx.graph, [bn_node, *act.chain()], lambda: _build(bn, act, ctx),
                      also_replace=(bn_node,) if act.later_users else ())
        ctx.report.fused.append(FusedSite(names, pattern, act.activation.describe(), "fxfuse::batch_norm_act",
                                          saved if ctx.shapes else None, 0 if ctx.shapes else None,
                                          reason, ctx.mode))
        fused += 1
    return fused

