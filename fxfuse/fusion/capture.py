"""Capture: trace a module once, with what the report says about the trace and the tensor
metadata of its graph. Later steps rewrite copies of the captured graph (apply.copy_of), so one
`optimize` call traces each module once per train/eval mode (`tracing.trace_count` counts the
traces)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx
from torch import nn

from .. import measure
from . import shapes, tracing
from .tracing import CallPattern, TraceResult


@dataclass
class Capture:
    traced: TraceResult
    shapes: dict[fx.Node, Any] = field(default_factory=dict)  # tensor metadata from the example inputs
    notes: list[str] = field(default_factory=list)  # what the report says about the trace
    pattern: Optional[CallPattern] = None  # the call it was traced for


def is_library_module(m: nn.Module) -> bool:
    return type(m).__module__.startswith(("torch.nn", "torch.ao.nn")) and not isinstance(
        m, (nn.Sequential, nn.ModuleList, nn.ModuleDict)
    )


def call_pattern(
    root: nn.Module, example_inputs: Optional[Sequence[Any]], pattern: Optional[CallPattern] = None
) -> CallPattern:
    """The call a graph of `root` is built for: `pattern`, else the example inputs', else `root(x)` (the
    forward's required arguments alone)."""
    if pattern is not None:
        return pattern
    return CallPattern.for_call(getattr(type(root), "_fxfuse_original_class", type(root)).forward, example_inputs)


def capture(
    root: nn.Module,
    example_inputs: Optional[Sequence[Any]],
    pattern: Optional[CallPattern] = None,
    autocast: Optional[measure.Autocast] = None,
) -> Capture:
    """Trace `root` (its original class's forward if it is optimized) for calls of `pattern`; raises what
    tracing raises."""
    traced = tracing.trace(
        root,
        forward_class=getattr(type(root), "_fxfuse_original_class", None),
        example_inputs=example_inputs,
        pattern=pattern,
    )
    modules = dict(root.named_modules())
    notes = []
    for path, reason in traced.leaf_failures.items():
        notes.append(f"{path or type(root).__name__}: not traceable ({reason}); kept as a leaf")
    if traced.specialized:
        shapes_seen = ", ".join(str(tuple(t.shape)) for t in example_inputs if isinstance(t, torch.Tensor))
        notes.append(
            f"{type(root).__name__}: its forward computes Python values from tensor shapes, so it was traced "
            f"for inputs of shape {shapes_seen}; an input of another shape traces it again"
        )
    for path, hooks in traced.hooked.items():
        own = "" if is_library_module(modules[path]) else "; its own forward is optimized on its own"
        notes.append(f"{path}: has {hooks}; kept as a module call so that its hooks fire as in eager{own}")
    shape_map = {}
    if example_inputs is not None:
        try:
            shape_map = shapes.propagate(root, traced.graph, example_inputs, autocast)
        except Exception as exc:  # noqa: BLE001 - estimates are optional
            notes.append(f"could not propagate shapes from the example inputs: {type(exc).__name__}: {exc}")
    return Capture(traced, shape_map, notes, pattern)


class Captures:
    """The captures of one `optimize` call, by module path and training flags: every walk over the
    model (finding sites, the policy's meta-device trials, the final install) rewrites the same
    captured graphs. A module that cannot be traced is remembered as the exception it raised."""

    def __init__(self, autocast: Optional[measure.Autocast] = None) -> None:
        self._by_key: dict[tuple, Any] = {}
        self.autocast = autocast  # what the graphs' tensor metadata is propagated under

    def get(
        self,
        root: nn.Module,
        path: str,
        example_inputs: Optional[Sequence[Any]],
        pattern: Optional[CallPattern] = None,
    ) -> Capture:
        pattern = call_pattern(root, example_inputs, pattern)
        key = (path, tuple(m.training for m in root.modules()), pattern)
        if key not in self._by_key:
            try:
                self._by_key[key] = capture(root, example_inputs, pattern, self.autocast)
            except Exception as exc:
                self._by_key[key] = exc
                raise
        found = self._by_key[key]
        if isinstance(found, Exception):
            raise found
        return found
