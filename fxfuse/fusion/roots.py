"""Roots: the model's tree walked once, each part fxfuse captures as one graph with its capture, or why
it has none.

The model itself is the first root. Where its forward does not trace, each child that is not a library
module is a root in its place (and so on down); inside a root that traces, the children of a submodule
kept as a leaf because it did not trace, and a submodule kept as a leaf for its hooks, are roots of their
own. One `optimize` call walks the model once (`find`); finding the sites, the policy's meta-device
counts and the final rewrite all apply plans to these roots' captures (apply.py), and install.py swaps
their classes. At call time, a graph built anew (hooks or training flags changed) walks what it keeps
as leaves the same way (`inside`, `children`), without `Captures`.

Example inputs reach the model's own capture only (its submodules' roots are captured for the calls
`root(x)`), so they change what is fused through it alone: a forward that computes Python values from
tensor shapes (TF-style padding, `for y in x.chunk(2, 1)`) traces as one graph only with concrete shapes
(tracing.py). Without example inputs such a model is captured at its first call instead, with that
call's inputs on meta copies, as torch.compile captures at the first call (`needs_shapes`; optimize.py,
install.defer), and then fuses what it fuses with example inputs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from torch import nn

from . import tracing
from .capture import Capture, Captures, call_pattern, capture, is_library_module


@dataclass
class Root:
    path: str  # in the model ("" for the model itself)
    module: nn.Module
    capture: Optional[Capture] = None  # None: its forward does not trace (`note`), its children are roots
    note: str = ""  # why it has no capture, for the report
    inside: list[Root] = field(default_factory=list)  # the roots within it, in forward order
    # Its module is a root at an earlier path too (one module object at two paths): its sites are found at
    # both, its graph is installed once, at the first.
    repeat: bool = False


def find(model: nn.Module, example_inputs: Optional[Sequence[Any]], captures: Captures) -> Root:
    """`model`'s tree of roots, its captures kept in `captures`."""
    return _root(model, "", example_inputs, captures, set())


# A module that is no root (at call time: one optimized already, install.is_optimized).
Skip = Optional[Callable[[nn.Module], bool]]


def children(
    module: nn.Module, path: str, captures: Optional[Captures] = None, seen=None, skip: Skip = None
) -> list[Root]:
    """The roots in place of `module` (at `path`) where its forward does not trace: its children that are
    not library modules (nor `skip`ped). Without `captures`, each is captured now."""
    seen = set() if seen is None else seen
    return [
        _root(child, _joined(path, name), None, captures, seen, skip)
        for name, child in module.named_children()
        if not is_library_module(child) and not (skip is not None and skip(child))
    ]


def inside(
    module: nn.Module,
    path: str,
    traced: tracing.TraceResult,
    captures: Optional[Captures] = None,
    seen=None,
    skip: Skip = None,
) -> list[Root]:
    """The roots within a capture of `module`: the children of the leaves that could not be traced through,
    and the hooked leaves that are not library modules (their hooks need a module call; their forward can
    still be fused)."""
    seen = set() if seen is None else seen
    found = []
    for leaf_path in traced.leaf_failures:
        found += children(module.get_submodule(leaf_path), _joined(path, leaf_path), captures, seen, skip)
    for leaf_path in traced.hooked:
        leaf = module.get_submodule(leaf_path)
        if not is_library_module(leaf) and not (skip is not None and skip(leaf)):
            found.append(_root(leaf, _joined(path, leaf_path), None, captures, seen, skip))
    return found


def _root(
    module: nn.Module, path: str, example_inputs, captures: Optional[Captures], seen: set, skip: Skip = None
) -> Root:
    repeat = id(module) in seen
    seen.add(id(module))
    try:
        if captures is None:
            captured = capture(module, example_inputs, call_pattern(module, example_inputs))
        else:
            captured = captures.get(module, path, example_inputs)
    except Exception as exc:  # noqa: BLE001 - tracing failures of arbitrary user code
        has_children = any(not is_library_module(child) for child in module.children())
        note = (
            f"{path or type(module).__name__}: forward is not traceable ({type(exc).__name__}: "
            f"{tracing.first_line(exc)}); optimizing its submodules instead"
            + ("" if has_children else " (it has none that fxfuse could trace)")
        )
        return Root(path, module, None, note, children(module, path, captures, seen, skip), repeat)
    return Root(path, module, captured, "", inside(module, path, captured.traced, captures, seen, skip), repeat)


def walk(roots: Sequence[Root], installed: bool = False) -> list[Root]:
    """Every root of `roots` and within them, in tree order; `installed`: those whose graph is installed
    (repeats and what lies within them left out)."""
    found: list[Root] = []
    for root in roots:
        if not (installed and root.repeat):
            found.append(root)
            found += walk(root.inside, installed)
    return found


def on(roots: Sequence[Root], model: nn.Module) -> list[Root]:
    """The same roots on `model`'s modules at the same paths (a meta-device copy of the model)."""
    return [
        dataclasses.replace(root, module=model.get_submodule(root.path), inside=on(root.inside, model))
        for root in roots
    ]


def captured(roots: Sequence[Root]) -> int:
    """How many roots have a capture."""
    return sum(root.capture is not None for root in walk(roots))


def _joined(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def needs_shapes(model: nn.Module, captures: Captures) -> Optional[str]:
    """Why `model`'s capture without example inputs is not the one its inputs' shapes would give (None: it is
    the same), in words for the report. Captures it (into `captures`) if it is not already."""
    try:
        captured = captures.get(model, "", None)
    except Exception as exc:  # noqa: BLE001 - tracing failures of arbitrary user code
        if not tracing.needs_shapes(exc):
            return None
        return f"its forward does not trace without them ({type(exc).__name__}: {tracing.first_line(exc)})"
    paths = tracing.needs_shapes(captured.traced)
    if not paths:
        return None
    first = paths[0]
    which = f"{first} and {len(paths) - 1} more submodules do" if len(paths) > 1 else f"{first} does"
    return f"{which} not trace without them ({captured.traced.leaf_failures[first]})"
