"""MaxPool2d / F.max_pool2d  ⇒  fxfuse::max_pool2d (keeps one byte per output element for backward).

Runs in every mode: the op's forward is ATen's, and its backward needs only where each maximum
lies in its window, which it keeps in one byte per output element (ops/max_pool2d.py). Eager keeps
the pooled input and int64 indices (8 bytes per output element). The rewrite frees the indices
always, and the input wherever nothing else keeps it: ResNet's stem activation (the stem's
Conv→BN→ReLU keeps only its conv input), a VoVNet or DLA stage's output pooled by the next one.
A hooked MaxPool2d, `return_indices=True` and windows over 256 elements stay as they are.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ... import ops
from ...ops.max_pool2d import MAX_WINDOW
from .context import PassContext
from .driver import FusionPass, Site
from .estimates import nbytes, numel
from .matchers import first_input, pool_module_call, site_name

_FUNCTIONS = (F.max_pool2d, torch.max_pool2d)
_MODULE_ARGS = ("kernel_size", "stride", "padding", "dilation", "ceil_mode")
_INDEX_BYTES = 8 - 1  # eager's int64 index per output element, less the op's one byte


def _window(kernel_size) -> Optional[int]:
    if isinstance(kernel_size, int):
        return kernel_size * kernel_size
    pair = isinstance(kernel_size, (list, tuple)) and len(kernel_size) in (1, 2)
    if pair and all(isinstance(k, int) for k in kernel_size):
        return math.prod(kernel_size) if len(kernel_size) == 2 else kernel_size[0] ** 2
    return None


def _call(node: fx.Node, ctx: PassContext) -> tuple[Optional[tuple], Optional[str]]:
    """(args, kwargs) of the F.max_pool2d call `node` makes, or why it cannot be rewritten; (None, None) if none."""
    if node.op == "call_module":
        m = ctx.modules.get(node.target)
        if type(m) is not nn.MaxPool2d:
            return None, None
        call, problem = pool_module_call(node, ctx.modules, nn.MaxPool2d, _MODULE_ARGS)
        if problem or m.return_indices:
            return None, problem or "return_indices=True: the indices are the module's output"
    elif node.op == "call_function" and node.target in _FUNCTIONS:
        if node.kwargs.get("return_indices", False) is not False or len(node.args) > 6:
            return None, "return_indices=True: the indices are an output"
        call = (node.args, {k: v for k, v in node.kwargs.items() if k != "return_indices"})
    else:
        return None, None
    kernel_size = call[0][1] if len(call[0]) > 1 else call[1].get("kernel_size")
    window = _window(kernel_size)
    if window is None or window > MAX_WINDOW:
        return None, f"a window of over {MAX_WINDOW} elements (or not given as ints): eager's max pooling kept"
    return (call, None) if first_input(node) is not None else (None, "the pooled input is not a traced tensor")


def match(node: fx.Node, ctx: PassContext) -> Optional[Site]:
    call, problem = _call(node, ctx)
    if call is None and problem is None:
        return None
    names = (site_name(node),)
    if problem:
        return Site(names, ("max_pool2d",), problem)
    x = first_input(node)
    frees = None
    if ctx.shapes:
        out = numel(ctx.shapes, node)
        # An upper bound where the pool is the input's only reader: its producer may keep it.
        frees = (0 if len(x.users) > 1 else nbytes(ctx.shapes, x) or 0) + _INDEX_BYTES * (out or 0)
    return Site(
        names,
        ("max_pool2d",),
        chain=[node],
        build=lambda: ctx.graph.call_function(ops.max_pool2d, *call),
        op="fxfuse::max_pool2d",
        saved_bytes=frees,
        recompute_flops=0 if ctx.shapes else None,
        reason=(
            "its backward needs only where each maximum lies in its window: keeps one byte per output "
            "element, where eager keeps the input and int64 indices (the input's bytes are freed unless "
            "another op keeps it too)"
        ),
    )


PASS = FusionPass(match)
