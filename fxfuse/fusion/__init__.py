"""The fusion pipeline behind `fxfuse.optimize`, in the order one call runs it:

    tracing (+ state_guard)  trace the model with torch.fx, never changing it
    shapes                   tensor metadata of the graph from example inputs (meta device)
    passes/                  patterns: a matcher per pattern, one driver that rewrites and reports
    policy                   which sites to fuse (mode="memory"/"auto", memory_budget)
    runtime                  what rewritten graphs call: the user's modules read at call time
    report                   FusionReport
    optimize                 optimize / explain: trace → passes → install on the user's module

Which module may import which: docs/design.md "Layers", checked by `make lint` (import-linter
contracts in pyproject.toml). (`_rebuild` stays importable here: pickles of optimized models
name it `fxfuse.fusion._rebuild`.)
"""

from .optimize import MODES, Options, _rebuild, explain, is_optimized, optimize  # noqa: F401
from .report import FusionReport

__all__ = ["MODES", "FusionReport", "Options", "explain", "is_optimized", "optimize"]
