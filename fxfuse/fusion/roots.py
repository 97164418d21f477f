"""Roots: the parts of a model fxfuse captures as one graph each, and what a capture needs.

The model itself is the first root, and the only one example inputs reach: where its own forward
does not trace, its largest traceable submodules are the roots (install.walk), captured without
inputs. So example inputs change what is fused only through the model's own capture: a forward
that computes Python values from tensor shapes (TF-style padding, `for y in x.chunk(2, 1)`) traces
as one graph only with concrete shapes (tracing.py). Without example inputs such a model is captured
at its first call instead, with that call's inputs on meta copies, as torch.compile captures at the
first call (optimize.py, install.defer), and then fuses what it fuses with example inputs.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from . import tracing
from .capture import Captures


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
