"""Apply a plan: rewrite a copy of a captured graph.

The passes find the sites on the copy and rewrite those the plan names (all of them
without a plan: that is how the sites are found), the model's own checkpoint calls become
checkpoint regions, and the recompute regions the plan names become one checkpointed call
each. The captured graph itself is never changed, so every plan the policy tries starts
from the same graph, and the sites the plan names by their names match again.
"""

from __future__ import annotations

import torch.fx as fx
from torch import nn

from . import user_checkpoint
from .capture import Capture, copy_of, is_library_module
from .passes import PassContext, run_passes
from .passes.driver import SITE_META
from .plan import Findings, Options
from .regions import graph as regions


def apply(root: nn.Module, captured: Capture, options: Options) -> tuple[fx.Graph, Findings]:
    """The rewritten graph of `root` (a module shaped as the captured one: itself, or a meta copy of it)
    and what the passes found on it."""
    own = copy_of(captured)
    graph, plan = own.traced.graph, options.plan
    found = Findings(notes=own.notes)
    sites = set(plan.sites) if plan.sites is not None else None
    run_passes(PassContext(graph, root, options.pass_mode, found, own.shapes, sites, plan.rebuild))
    if own.traced.user_checkpoints:
        # module calls whose forward (or children) fxfuse optimizes on its own (install._optimize_inside)
        traced = own.traced
        hooked = [p for p in traced.hooked if not is_library_module(root.get_submodule(p))]
        on_their_own = {*traced.leaf_failures, *hooked}
        found.notes.extend(user_checkpoint.extract(graph, traced.user_checkpoints, SITE_META, on_their_own))
    if plan.regions:
        found.notes.extend(regions.apply(graph, root, plan.regions, plan.flat_links))
    return graph, found
