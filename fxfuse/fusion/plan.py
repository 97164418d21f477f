"""The data the pipeline passes down: the sites the passes find (`SiteData`, `Findings`), the
policy's choice (a `Plan`, with the decision behind it: `Choice`) and the user's `Options`.

A site's identity is its names: module paths (or `scope:function` for functional calls), as in
the report. A Plan names what to rewrite rather than pointing at graph nodes, so the same plan
applies to every graph built from the model: the captured one, the other train/eval mode's, and
those a call traces later (hooks or training flags changed). Applying it runs the passes again on
a copy of the captured graph and rewrites the sites it names (apply.py): the same graph, so the
same sites match, and no trace. report.render turns these into the user's FusionReport; nothing
reads a FusionReport back.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Optional

# What users pass as mode=: the passes see "memory" or "fast" (Options.pass_mode).
MODES = ("memory", "fast", "auto")

# The kinds in a site's pattern that are layers (not activations).
LAYER_KINDS = frozenset({"conv2d", "batch_norm2d", "linear", "layer_norm"})


@dataclass
class SiteData:
    """A site the passes rewrote: what the policy chooses from and the report renders. A later pass
    that merges the site's node updates it (passes/bn_act_conv.py, passes/layer_scale.py)."""

    names: tuple[str, ...]  # module paths (or scope:function), in forward order: the site's identity
    pattern: tuple[str, ...]  # the kind of each call, e.g. ("conv2d", "batch_norm2d", "relu")
    op: str  # the fxfuse op it runs
    activation: str = ""
    recomputes: bool = False  # recomputes a conv or linear layer in backward (its pass says so): an upgrade
    saved_bytes: Optional[int] = None  # activation bytes eager keeps for backward that this site does not
    recompute_flops: Optional[int] = None  # extra work in backward
    reason: str = ""  # what is kept and what is recomputed (or why it is faster)
    mode: str = ""  # the passes' mode that found it
    # fxfuse::bn_act_conv: the conv whose input this site's output is (passes/bn_act_conv.py); a cat: the
    # fused op it is the input of (passes/cat_input.py); an act_linear site: the layer-scale parameter
    # its call was merged with (passes/layer_scale.py)
    merged_into: str = ""
    recompute_bytes: Optional[int] = None  # bytes a rebuild moves in backward (a copy, no FLOPs: passes/cat_input.py)

    @property
    def layers(self) -> frozenset:
        """Its conv, BN and linear names: what two sites on the same nodes share. Not its activation's,
        since one activation module may serve several sites (LeNet's one nn.GELU). Where the activation
        has no name of its own (it runs inside the BN module), every name is a layer."""
        if len(self.pattern) != len(self.names):
            return frozenset(self.names)
        return frozenset(n for n, kind in zip(self.names, self.pattern) if kind in LAYER_KINDS)


def site_in_region(names: tuple[str, ...], region) -> bool:
    """Whether a site (its names: module paths, or 'scope:function') runs inside `region` (a
    regions.costs.RegionCost: its name, kind, and the modules it calls)."""
    for name in names:
        scope = name.split(":", 1)[0] if ":" in name else name
        if scope in region.modules:
            return True
        if region.kind == "block" and (scope == region.name or scope.startswith(region.name + ".")):
            return True
    return False


@dataclass(frozen=True)
class Skip:
    """A site the passes matched and did not rewrite, and why."""

    names: tuple[str, ...]
    pattern: tuple[str, ...]
    reason: str


@dataclass
class Findings:
    """What one walk over a model found: the sites rewritten, those skipped, notes on the trace."""

    sites: list[SiteData] = field(default_factory=list)
    skipped: list[Skip] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def prefixed(self, prefix: str) -> Findings:
        """These findings of the submodule at `prefix`, named from the model's top."""
        if not prefix:
            return self

        def names(ms):
            return tuple(f"{prefix}.{m}" if m and not m.startswith(":") else f"{prefix}{m}" for m in ms)

        return Findings(
            [dataclasses.replace(s, names=names(s.names)) for s in self.sites],
            [dataclasses.replace(s, names=names(s.names)) for s in self.skipped],
            [f"{prefix}.{n}" if not n.startswith(prefix) else n for n in self.notes],
        )


@dataclass
class Choice:
    """The policy's decision and what it counted on the way, as data: report.render says it in words
    (fusion/wording.py). The entries are the ranking's (fusion/regions/ranking.py): upgrades (`kind`
    "upgrade": a site and the pointwise sites it replaces), regions, links and the rebuild. The policy
    fills it in as it searches; what is derived from the selection is read once it is done (cached)."""

    policy: str  # "auto", "memory" or "budget"
    auto_limit: Optional[float] = None  # mode="auto": the FLOP/B an upgrade may cost at most
    # What the taken prefix selects (regions.ranking.Selection): the upgrades, regions, links and rebuild in
    # effect, the links run flat, the pointwise sites kept in place of an upgrade. None: nothing chosen yet.
    selection: Any = None
    chosen: list = field(default_factory=list)  # the prefix of the ranking taken, in ranking order
    rejected: list = field(default_factory=list)  # the rest of the ranking
    idle: list[SiteData] = field(default_factory=list)  # mode="memory": upgrades left out as freeing nothing
    budget: Optional[float] = None
    eager_bytes: Optional[int] = None
    selected_bytes: Optional[int] = None  # saved for backward with this selection (meta-device count)
    peak_budget: Optional[float] = None
    eager_peak_bytes: Optional[int] = None
    selected_peak_bytes: Optional[int] = None  # peak during a train step with this selection (meta device)
    notes: list[str] = field(default_factory=list)

    @property
    def met(self) -> Optional[bool]:
        if self.budget is None or self.eager_bytes is None or self.selected_bytes is None:
            return None
        return self.selected_bytes <= self.budget * self.eager_bytes

    @property
    def peak_met(self) -> Optional[bool]:
        if self.peak_budget is None or self.eager_peak_bytes is None or self.selected_peak_bytes is None:
            return None
        return self.selected_peak_bytes <= self.peak_budget * self.eager_peak_bytes

    @functools.cached_property
    def recomputed(self) -> list:
        """The regions, links and rebuild that run, in ranking order: an inner region a region around it
        replaced (ranking.select) is not recomputed on its own; the rebuild as the selection counted it."""
        selection = self.selection
        kept = [*selection.regions, *selection.links]
        rebuild = selection.rebuild
        entries = [rebuild if e.kind == "rebuild" else e for e in self.chosen if e.kind != "upgrade"]
        return [e for e in entries if e is not None and (e is rebuild or any(e is k for k in kept))]

    @functools.cached_property
    def recomputed_regions(self) -> list:
        """The regions recomputed (regions.costs.RegionCost: name, kind, modules), in ranking order: a site
        inside one (site_in_region) runs in its pointwise form there."""
        return [e.cost for e in self.recomputed if e.kind == "region"]

    @functools.cached_property
    def upgrades(self) -> dict:
        """Names of each upgrade in effect -> its cost, in words."""
        return {c.site.names: c.describe() for c in self.selection.upgrades}

    @functools.cached_property
    def pointwise_only(self) -> frozenset:
        """Names of the pointwise sites kept in place of an upgrade not taken."""
        replaced = {p.names for c in self.rejected if c.kind == "upgrade" for p in c.fallback}
        return frozenset(replaced & set(self.selection.fallback))


@dataclass(frozen=True)
class Plan:
    sites: Optional[frozenset] = None  # names of the sites the passes may rewrite (None: every site)
    regions: tuple = ()  # groups of region names (fusion/regions/graph.py) to recompute, in graph order
    flat_links: frozenset = frozenset()  # (first, second) links of those groups run as one region
    rebuild: bool = False  # BN→activation outputs rebuilt in backward for the ops that keep them (passes/rebuild.py)
    choice: Optional[Choice] = field(default=None, compare=False)  # why the policy chose it (None: no policy ran)

    def scoped(self, path: str) -> Plan:
        """This plan for the submodule at `path`: what lies under it, with names relative to it."""
        if self.sites is None or not path:
            return self
        return Plan(
            None if self.sites is None else frozenset(_scoped_names(self.sites, path)),
            tuple(_scoped_names(self.regions, path)),
            frozenset(_scoped_names(self.flat_links, path)),
            self.rebuild,
        )


@dataclass
class Options:
    mode: str = "memory"  # what the user asked for: "memory", "fast" or "auto"
    plan: Plan = field(default_factory=Plan)
    memory_budget: Optional[float] = None
    channels_last: bool = False  # the forward converts 4-D floating inputs to channels_last (fusion.layout)

    @property
    def pass_mode(self) -> str:
        """The passes' mode: auto and budgets pick among the sites of mode="memory"."""
        return "fast" if self.mode == "fast" else "memory"

    def scoped(self, path: str) -> Options:
        """These options for the submodule at `path` (names relative to it)."""
        plan = self.plan.scoped(path)
        if plan is self.plan:
            return self
        return Options(self.mode, plan, self.memory_budget, self.channels_last)


def _scoped_names(name_tuples, path: str) -> list[tuple[str, ...]]:
    """The tuples of `name_tuples` whose names all lie under `path`, relative to it, in order."""
    inner = (tuple(_unprefix(n, path) for n in names) for names in name_tuples)
    return [names for names in inner if all(n is not None for n in names)]


def _unprefix(name: str, path: str) -> Optional[str]:
    if name.startswith(path + "."):
        return name[len(path) + 1 :]
    if name.startswith(path + ":"):
        return name[len(path) :]
    return None
