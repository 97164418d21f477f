"""Standalone GELU  ⇒  runtime.gelu_where_faster (fxfuse::gelu where measured faster, else F.gelu).

Runs in every mode, after the fusing passes: GELUs after a Linear, Conv2d or BatchNorm2d are taken
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
from .context import PassContext
from .driver import FusionPass, Site
from .matchers import activation_of, first_input, has_hooks, hooks_problem, site_name


def _approximate(node: fx.Node, ctx: PassContext) -> tuple[Optional[str], Optional[str]]:
    """(approximate, problem) for a GELU node; (None, None) for anything else."""
    if (
        node.op == "call_module"
        and type(ctx.modules.get(node.target)) is nn.GELU
        and has_hooks(ctx.modules[node.target])
    ):
        return None, hooks_problem(ctx.modules[node.target], "GELU")
    act = activation_of(node, ctx.modules)
    if act is None or act.name not in ("gelu", "gelu_tanh"):
        return None, None
    if node.op == "call_module" and (len(node.args) != 1 or node.kwargs):
        return None, "unexpected GELU call arguments"
    return ("tanh" if act.name == "gelu_tanh" else "none"), None


def _device_type(root) -> str:
    """The device type of the model's first parameter or buffer ("cpu" for a model without any)."""
    for t in (*root.parameters(), *root.buffers()):
        return t.device.type
    return "cpu"


def _decision(x: fx.Node, approximate: str, ctx: PassContext) -> tuple[bool, str]:
    """(rewrite?, why) for a GELU of `x`, by runtime.gelu_rule on the example input's metadata."""
    meta = ctx.shapes.get(x)
    device = _device_type(ctx.root)
    if meta is None:
        return runtime.gelu_rule(approximate, device=device)
    rewrite, why = runtime.gelu_rule(
        approximate, meta.dtype, tuple(meta.shape), meta.memory_format == torch.channels_last, device
    )
    return rewrite, f"{why} (at the example input)"


def match(node: fx.Node, ctx: PassContext) -> Optional[Site]:
    approximate, problem = _approximate(node, ctx)
    if approximate is None and problem is None:
        return None
    names = (site_name(node),)
    x = first_input(node)
    if problem is None and x is None:
        problem = "GELU input is not a traced tensor"
    if problem:
        return Site(names, ("gelu",), problem)
    kind = "gelu" if approximate != "tanh" else "gelu_tanh"
    rewrite, why = _decision(x, approximate, ctx)
    if not rewrite:
        return Site(names, (kind,), why)
    return Site(
        names,
        (kind,),
        chain=[node],
        build=lambda: ctx.graph.call_function(runtime.gelu_where_faster, (x,), {"approximate": approximate}),
        activation=kind,
        op="fxfuse::gelu",
        saved_bytes=0 if ctx.shapes else None,
        recompute_flops=0 if ctx.shapes else None,
        reason=why,
    )


PASS = FusionPass(match)
