"""The fusion pipeline behind `fxfuse.optimize`, in the order one call runs it:

    roots (capture, tracing)        the model's tree walked once: each root traced once per
                                    train/eval mode, or why it does not trace
    passes/ (apply.sites)           find sites: a matcher per pattern, one driver that rewrites and
                                    records each site's data (plan.SiteData)
    policy (counts, regions/)       choose from those sites: which sites, recompute regions and links,
                                    as a Plan (plan.py) that also says why
    apply                           the plan applied to a copy of each root's capture
    install                         the class swap, the graph cache, what happens at call time
    report                          the FusionReport, rendered from the final sites and the Plan
    optimize                        optimize / explain: the steps above, in that order

`runtime` and `regions/recompute` are what rewritten graphs call.
Which module may import which: docs/design.md "Layers", checked by `make lint` (import-linter
contracts in pyproject.toml). (`_rebuild` stays importable here: pickles of optimized models
name it `fxfuse.fusion._rebuild`.)
"""

from .optimize import MODES, Options, _rebuild, explain, is_optimized, optimize  # noqa: F401
from .report import FusionReport

__all__ = ["MODES", "FusionReport", "Options", "explain", "is_optimized", "optimize"]
