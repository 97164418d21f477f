"""Tensor shapes of a traced graph from example inputs, without real compute (meta device, else FakeTensor)."""

from __future__ import annotations

import contextlib
import io
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.shape_prop import ShapeProp

from .. import measure
from . import tracing


def propagate(
    root: nn.Module, graph: fx.Graph, example_inputs: Sequence[Any], autocast: Optional[measure.Autocast] = None
) -> dict[fx.Node, Any]:
    """node -> TensorMetadata for every node that produced a single tensor, under `autocast` if given
    (the dtypes the model trains in: measure.counting_under).

    Runs the graph on a meta-device copy of the model (no data is copied; nothing the
    user owns changes), or where some op has no meta kernel, on fake tensors; raises
    the fake run's error where both fail. ShapeProp prints the traceback of a failing
    node before raising it; the caller reports the error, so that print is dropped.
    """
    try:
        with _quiet(), measure.counting_under(autocast):
            with tracing.copied_plain(root):
                copied = measure.meta_copy(root)
            gm = fx.GraphModule(copied, graph)
            with measure.counted_run():
                ShapeProp(gm).propagate(*measure.to_meta(example_inputs))
    except Exception:  # noqa: BLE001 - an op without a meta kernel: FakeTensor covers more
        _clear(graph)
        gm = fx.GraphModule(root, graph)
        fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
        fake_inputs = [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs]
        cast = contextlib.nullcontext() if autocast is None else torch.autocast(autocast.device_type, autocast.dtype)
        with _quiet(), cast:
            ShapeProp(gm, fake_mode=fake_mode).propagate(*fake_inputs)
    shapes = {}
    for node in graph.nodes:
        meta = node.meta.pop("tensor_meta", None)
        if meta is not None and hasattr(meta, "shape"):
            shapes[node] = meta
    return shapes


def _quiet():
    """Swallow what ShapeProp.run_node writes to stderr (traceback.print_exc) while it runs."""
    return contextlib.redirect_stderr(io.StringIO())


def _clear(graph: fx.Graph) -> None:
    for node in graph.nodes:
        node.meta.pop("tensor_meta", None)
