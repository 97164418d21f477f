"""What a site saves (activation bytes eager keeps for backward) and what it costs (recompute FLOPs)."""

from __future__ import annotations

import math
from typing import Optional

import torch.fx as fx

from ...ops.activations import REGISTRY

# Activations whose eager backward needs their input (so eager keeps the BN output alive).
SAVES_INPUT = frozenset(name for name, spec in REGISTRY.items() if spec.saves_input)


def nbytes(shapes: dict, node: fx.Node) -> Optional[int]:
    meta = shapes.get(node)
    if meta is None:
        return None
    return math.prod(meta.shape) * meta.dtype.itemsize


def numel(shapes: dict, node: fx.Node) -> Optional[int]:
    meta = shapes.get(node)
    return None if meta is None else math.prod(meta.shape)


def activation_input_bytes(shapes: dict, bn_node: fx.Node, act: str, inplace: bool) -> Optional[int]:
    if act not in SAVES_INPUT or inplace:
        return 0
    return nbytes(shapes, bn_node)


def conv_flops(shapes: dict, conv_node: fx.Node, weight_shape, groups: int) -> Optional[int]:
    out = numel(shapes, conv_node)
    if out is None or weight_shape is None:
        return None
    _, cin_per_group, kh, kw = weight_shape
    return 2 * out * cin_per_group * kh * kw


def layer_moved(shapes: dict, node: fx.Node) -> Optional[int]:
    """Bytes a conv or linear layer's recompute reads and writes: its input and its output (the weight
    is small beside them)."""
    source = node.args[0] if node.args else None
    sizes = [nbytes(shapes, source) if isinstance(source, fx.Node) else None, nbytes(shapes, node)]
    return None if None in sizes else sum(sizes)
