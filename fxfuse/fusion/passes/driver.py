"""The loop every fusing pass shares: match a site, refuse or filter it, rewrite it, report it.

A pass is a `FusionPass`: the modes it runs in and a matcher, `node -> Site | None`.
The matcher decides what a site is and how to build its replacement; the driver does
the rest the same way for every pattern: skipped sites with their reasons, the
plan's site selection, `rewrite.replace_chain`, and the site's data (plan.SiteData) for
the policy and the report.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch.fx as fx

from .. import user_checkpoint
from ..plan import SiteData, Skip
from .context import PassContext
from .rewrite import replace_chain

SITE_META = "fxfuse_site"  # node.meta key: the SiteData of a rewritten node (a later pass may merge it)


@dataclass
class Site:
    """One match: either a `problem` (why it is not fused) or what replaces which nodes."""

    names: tuple[str, ...]  # module paths (or scope:function), in forward order: the site's identity
    pattern: tuple[str, ...]  # the kind of each call, e.g. ("conv2d", "batch_norm2d", "relu")
    problem: Optional[str] = None
    chain: Sequence[fx.Node] = ()  # the nodes replaced, producer first
    build: Optional[Callable[[], fx.Node]] = None  # makes the replacement (at the chain's last node)
    also_replace: Sequence[fx.Node] = ()  # other nodes whose uses go to the replacement
    prepare: Optional[Callable[[], None]] = None  # graph edits the rewrite needs first
    activation: str = ""
    op: str = ""
    saved_bytes: Optional[int] = None
    recompute_flops: Optional[int] = None
    reason: str = ""
    recompute_bytes: Optional[int] = None  # bytes the recompute reads and writes (regions/time_model.py)


@dataclass(frozen=True)
class FusionPass:
    match: Callable[[fx.Node, PassContext], Optional[Site]]
    modes: tuple[str, ...] = ("memory", "fast")  # the passes' modes (Options.pass_mode) it runs in
    recomputes: bool = False  # its sites recompute a conv or linear layer in backward (the policy's upgrades)

    def __call__(self, ctx: PassContext) -> int:
        if ctx.mode not in self.modes:
            return 0
        fused = 0
        for node in list(ctx.graph.nodes):
            if node.graph is not ctx.graph or node.op not in ("call_module", "call_function", "call_method"):
                continue  # erased by an earlier rewrite, or no call
            site = self.match(node, ctx)
            if site is None:
                continue
            if site.problem:
                ctx.found.skipped.append(Skip(site.names, site.pattern, site.problem))
                continue
            if not user_checkpoint.one_region((*site.chain, *site.also_replace)):
                ctx.found.skipped.append(Skip(site.names, site.pattern, user_checkpoint.CROSSES))
                continue
            if ctx.allowed is not None and site.names not in ctx.allowed:
                continue
            if site.prepare is not None:
                site.prepare()
            last = site.chain[-1]
            new = replace_chain(ctx.graph, site.chain, site.build, also_replace=site.also_replace)
            if last in ctx.shapes:  # later passes read the rewritten node's shape
                ctx.shapes[new] = ctx.shapes[last]
            data = SiteData(
                site.names,
                site.pattern,
                site.op,
                site.activation,
                self.recomputes,
                site.saved_bytes,
                site.recompute_flops,
                site.reason,
                ctx.mode,
                recompute_bytes=site.recompute_bytes,
            )
            new.meta[SITE_META] = data  # a later pass may merge the node and update its data
            ctx.found.sites.append(data)
            fused += 1
        return fused
