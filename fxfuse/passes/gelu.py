"""Standalone GELU  ⇒  runtime.gelu_where_faster (fxfuse::gelu where measured faster, else F.gelu).

Runs in every mode, last: GELUs after a Linear, Conv2d or BatchNorm2d have been taken
by the fusing passes by then. It saves no memory (both keep the GELU input); it is
only about time, and fxfuse::gelu is faster than eager only for some calls (see
runtime.GELU_FAST_MIN_NUMEL). With example inputs, the site's layout, dtype and size
decide here and the report says which way; without them, the rewritten call decides
per call. Both paths compute F.gelu exactly, so either choice is exact.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx
from torch import nn

from .. import runtime
from ..report import FusedSite, SkippedSite
from .context import PassContext
from .matchers import activation_of, first_input, has_hooks, site_name
from .rewrite import replace_chain

_FAST = "fxfuse::gelu measured faster than eager for channels_last float32 CPU inputs"


def _approximate(node: fx.Node, ctx: PassContext) -> tuple[Optional[str], Optional[str]]:
    """(approximate, problem) for a GELU node; (None, None) for anything else."""
    if node.op == "call_module" and type(ctx.modules.get(node.target)) is nn.GELU and has_hooks(
            ctx.modules[node.target]):
        return None, "the GELU module has hooks, which the rewritten call would not run"
    act = activation_of(node, ctx.modules)
    if act is None or act.name not in ("gelu", "gelu_tanh"):
        return None, None
    if node.op == "call_module" and (len(node.args) != 1 or node.kwargs):
        return None, "unexpected GELU call arguments"
    return ("tanh" if act.name == "gelu_tanh" else "none"), None


def _decision(x: fx.Node, approximate: str, ctx: PassContext) -> tuple[bool, str]:
    """(rewrite?, why) for a GELU of `x`."""
    if approximate != "none":
        return False, "approximate='tanh': fxfuse::gelu measured no faster than eager"
    meta = ctx.shapes.get(x)
    if meta is None:
        return True, f"layout known only at run time: dispatches per call ({_FAST}; F.gelu otherwise)"
    numel = 1
    for size in meta.shape:
        numel *= size
    if meta.dtype != torch.float32:
        return False, f"{meta.dtype}: fxfuse::gelu measured no faster than eager"
    if len(meta.shape) != 4 or meta.memory_format != torch.channels_last:
        return False, "input not channels_last at the example input: fxfuse::gelu measured no faster than eager"
    if numel < runtime.GELU_FAST_MIN_NUMEL:
        return False, f"{numel} elements at the example input: too few for fxfuse::gelu to be faster"
    return True, f"channels_last float32 input at the example input; {_FAST}"


def run(ctx: PassContext) -> int:
    fused = 0
    for node in list(ctx.graph.nodes):
        if node.graph is not ctx.graph or node.op not in ("call_module", "call_function"):
            continue
        approximate, problem = _approximate(node, ctx)
        if approximate is None and problem is None:
            continue
        names = (site_name(node),)
        pattern = "gelu" if approximate != "tanh" else "gelu_tanh"
        x = first_input(node)
        if problem is None and x is None:
            problem = "GELU input is not a traced tensor"
        if problem:
            ctx.report.skipped.append(SkippedSite(names, "gelu", problem))
            continue
        rewrite, why = _decision(x, approximate, ctx)
        if not rewrite:
            ctx.report.skipped.append(SkippedSite(names, pattern, why))
            continue
        if ctx.allowed is not None and names not in ctx.allowed:
            continue
        replace_chain(ctx.graph, [node], lambda: ctx.graph.call_function(
            runtime.gelu_where_faster, (x,), {"approximate": approximate}))
        ctx.report.fused.append(FusedSite(names, pattern, pattern, "fxfuse::gelu", 0 if ctx.shapes else None,
                                          0 if ctx.shapes else None, why, ctx.mode))
        fused += 1
    return fused
