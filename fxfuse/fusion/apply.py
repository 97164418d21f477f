"""Apply a plan: rewrite a copy of a captured graph.

The passes find the sites on the copy and rewrite those the plan names (all of them
without a plan: that is how the sites are found), the model's own checkpoint calls become
checkpoint regions, and the recompute regions the plan names become one checkpointed call
each. The captured graph itself is never changed, so every plan the policy tries starts
from the same graph, and the sites the plan names by their names match again.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch.fx as fx
from torch import nn

from . import user_checkpoint
from .capture import Capture, is_library_module
from .passes import PassContext, run_passes
from .passes.driver import SITE_META
from .plan import Findings, Options, SiteData
from .regions import graph as regions
from .roots import Root


def copy_of(captured: Capture) -> Capture:
    """A copy to rewrite: a new graph (node meta copied), its shapes keyed on the new nodes."""
    old = captured.traced.graph
    graph = fx.Graph(tracer_cls=old._tracer_cls)
    nodes: dict[fx.Node, fx.Node] = {}
    value, old_output = graph.graph_copy(old, nodes, return_output_node=True)
    graph.set_codegen(copy.deepcopy(old._codegen))
    nodes[old_output] = graph.output(value, type_expr=getattr(old_output, "type", None))
    nodes[old_output].meta = copy.copy(old_output.meta)
    shape_map = {nodes[n]: meta for n, meta in captured.shapes.items() if n in nodes}
    return dataclasses.replace(
        captured, traced=dataclasses.replace(captured.traced, graph=graph), shapes=shape_map, notes=list(captured.notes)
    )


def apply(root: nn.Module, captured: Capture, options: Options) -> tuple[fx.Graph, Findings]:
    """The rewritten graph of `root` (a module shaped as the captured one: itself, or a meta copy of it)
    and what the passes found on it."""
    own = copy_of(captured)
    graph, plan = own.traced.graph, options.plan
    found = Findings(notes=own.notes)
    sites = set(plan.sites) if plan.sites is not None else None
    run_passes(PassContext(graph, root, options.pass_mode, found, own.shapes, sites, plan.rebuild))
    if own.traced.user_checkpoints:
        # module calls whose forward (or children) fxfuse optimizes on its own (roots.inside)
        traced = own.traced
        hooked = [p for p in traced.hooked if not is_library_module(root.get_submodule(p))]
        on_their_own = {*traced.leaf_failures, *hooked}
        found.notes.extend(user_checkpoint.extract(graph, traced.user_checkpoints, SITE_META, on_their_own))
    if plan.regions:
        found.notes.extend(regions.apply(graph, root, plan.regions, plan.flat_links))
    return graph, found


@dataclass
class Applied:
    """A plan applied to a tree of roots (roots.py): each captured root's rewritten graph and what the passes
    found on it (names relative to the root), by the root's path."""

    graphs: dict[str, fx.Graph] = field(default_factory=dict)
    found: dict[str, Findings] = field(default_factory=dict)
    installed: bool = False  # applied only where the graph is installed (roots.walk)

    def findings(self, tree: Sequence[Root], later: Optional[dict] = None, into: Optional[Findings] = None) -> Findings:
        """What the passes found on every root, named from the tree's top, in tree order: a root that does
        not trace is its note; `later` (install's other train/eval mode, by root path: its name and Findings)
        adds that mode's notes after the root's own and those of the roots within it."""
        found = Findings() if into is None else into
        later = later or {}
        for root in tree:
            if self.installed and root.repeat:
                continue
            if root.capture is None:
                found.notes.append(root.note)
            else:
                merged = self.found[root.path].prefixed(root.path)
                found.sites.extend(merged.sites)
                found.skipped.extend(merged.skipped)
                found.notes.extend(merged.notes)
            self.findings(root.inside, later, found)
            if root.path in later:
                mode, other = later[root.path]
                for note in other.prefixed(root.path).notes:
                    if note not in found.notes:
                        found.notes.append(f"in {mode} mode: {note}")
        return found


def apply_roots(
    tree: Sequence[Root], options: Options, installed: bool = False, into: Optional[Applied] = None
) -> Applied:
    """`options`' plan applied to the capture of every root of `tree` (each with the plan scoped to it);
    `installed`: only the roots whose graph is installed (not the repeats)."""
    applied = Applied(installed=installed) if into is None else into
    for root in tree:
        if installed and root.repeat:
            continue
        if root.capture is not None:
            scoped = options.scoped(root.path) if root.path else options
            applied.graphs[root.path], applied.found[root.path] = apply(root.module, root.capture, scoped)
        apply_roots(root.inside, options, installed, applied)
    return applied


def sites(tree: Sequence[Root], mode: str) -> list[SiteData]:
    """Every site the passes of `mode` ("memory" or "fast") rewrite in the tree's roots."""
    return apply_roots(tree, Options(mode)).findings(tree).sites
