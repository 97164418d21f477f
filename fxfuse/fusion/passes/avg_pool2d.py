"""AvgPool2d / F.avg_pool2d  ⇒  fxfuse::avg_pool2d (keeps none of its input for backward).

Runs in every mode: the op's forward is ATen's and its backward reads only the input's shape
(ops/avg_pool2d.py), so the rewrite costs nothing and frees the pooled input wherever nothing
else keeps it: a DenseNet transition's conv output (21 MiB of DenseNet-121's 235 MiB at
batch 8, 224², once the concatenations are rebuilt), ResNet-D's average-pooled shortcut, an
Inception branch. Where another op keeps the input anyway (an activation that saves its output)
the rewrite frees nothing and changes nothing. A hooked AvgPool2d stays a module call.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ... import ops
from .context import PassContext
from .driver import FusionPass, Site
from .estimates import nbytes
from .matchers import first_input, pool_module_call, site_name

_FUNCTIONS = (F.avg_pool2d, torch._C._nn.avg_pool2d)
_MODULE_ARGS = ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad", "divisor_override")


def _call(node: fx.Node, ctx: PassContext) -> tuple[Optional[tuple], Optional[str]]:
    """(args, kwargs) of the F.avg_pool2d call `node` makes, or why it cannot be rewritten; (None, None) if none."""
    if node.op == "call_module":
        m = ctx.modules.get(node.target)
        if type(m) is not nn.AvgPool2d:
            return None, None
        call, problem = pool_module_call(node, ctx.modules, nn.AvgPool2d, _MODULE_ARGS)
        if problem:
            return None, problem
    elif node.op == "call_function" and node.target in _FUNCTIONS:
        call = (node.args, dict(node.kwargs))
    else:
        return None, None
    return (call, None) if first_input(node) is not None else (None, "the pooled input is not a traced tensor")


def match(node: fx.Node, ctx: PassContext) -> Optional[Site]:
    call, problem = _call(node, ctx)
    if call is None and problem is None:
        return None
    names = (site_name(node),)
    if problem:
        return Site(names, ("avg_pool2d",), problem)
    x = first_input(node)
    # An upper bound where the pool is the input's only reader: its producer may keep it (exp, ...).
    frees = 0 if len(x.users) > 1 else nbytes(ctx.shapes, x)
    return Site(
        names,
        ("avg_pool2d",),
        chain=[node],
        build=lambda: ctx.graph.call_function(ops.avg_pool2d, *call),
        op="fxfuse::avg_pool2d",
        saved_bytes=frees if ctx.shapes else None,
        recompute_flops=0 if ctx.shapes else None,
        reason=(
            "its backward needs only the input's shape: keeps none of the input, which eager keeps "
            "(the bytes are freed unless another op keeps the input too)"
        ),
    )


PASS = FusionPass(match)
