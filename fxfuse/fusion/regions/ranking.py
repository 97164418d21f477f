"""One ranking of everything that trades recompute for memory, and what a prefix of it selects.

Three kinds of entries, all costed in recompute time per byte freed (time_model.py: FLOPs for
convs and matmuls, bytes moved for the rest):

* an *upgrade*: a site recomputes its conv/linear (mode="memory" form) instead of only
  pointwise work; worth the bytes it saves beyond the pointwise form;
* a *region*: a block or run (regions/graph.py) keeps only its inputs and runs its
  forward again in backward, its sites in pointwise form inside (a conv is recomputed
  once, by the region, never again by its site); worth what its nodes keep beyond that;
* an *inner region* (a module inside a block: DenseNet's layer inside a dense block) is a
  region too; a region around it, where chosen later in the ranking, replaces it;
* a *link*: two consecutive chosen regions become one chain, so the second no longer
  keeps its input; costs running the first again;
* the *rebuild* (one entry, where the model has rebuildable sites): every BN→activation output
  that other ops keep is rebuilt for them in backward from the BN input (passes/rebuild.py);
  costs one pointwise pass per op that keeps one, counted on the meta device.

Entries are sorted by estimated seconds per byte, cheapest first (a region's or link's time weighted
by REGION_TIME_COST, its measured extra cost, plus its checkpoint call's, REGION_CALL_OPS ops); a
link never comes before its two regions. A region is preceded by what it encloses (inner regions,
chains, site upgrades) even where those cost more per byte: a whole CSP stage frees more per FLOP
than any of its bottlenecks, but a budget that needs a tenth of its bytes is met by one bottleneck,
at a fraction of its FLOPs; one that needs them all takes the stage, which replaces them. So a
prefix never recomputes more than the plain sort would. A selection is a prefix of this one list: a
tighter budget takes a longer prefix, so it never saves less.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from ..plan import SiteData, site_in_region
from . import time_model
from .costs import LinkCost, Profile, RegionCost


@dataclass
class Candidate:
    """An upgrade: `site` as mode="memory" fuses it, replacing the pointwise sites in `fallback`."""

    site: SiteData
    fallback: list[SiteData]
    marginal_bytes: Optional[int]
    flops_per_byte: Optional[float]
    kind: str = "upgrade"

    @property
    def name(self) -> str:
        return " + ".join(self.site.names)

    @property
    def seconds(self) -> Optional[float]:
        """Its recompute's estimated time: the layer's FLOPs, and the bytes its recompute reads and writes (inside
        the fused op's backward: no op of its own to dispatch)."""
        if self.flops_per_byte is None:
            return None
        return time_model.seconds(self.flops_per_byte * (self.marginal_bytes or 0), self.site.recompute_bytes or 0)

    @property
    def seconds_per_byte(self) -> Optional[float]:
        if self.flops_per_byte is None:
            return None
        if not self.marginal_bytes:  # sized from the layer's weight alone (policy._intrinsic_flops_per_byte)
            return self.flops_per_byte * time_model.seconds_per_flop()
        return self.seconds / self.marginal_bytes

    def describe(self) -> str:
        if self.flops_per_byte is None:
            return "recompute cost unknown"
        return _described(self.flops_per_byte, self.site.recompute_bytes, self.marginal_bytes, self.seconds)


def _described(flops_per_byte: float, moved: Optional[int], freed: Optional[int], seconds: Optional[float]) -> str:
    parts = [f"{flops_per_byte:.0f} FLOP/B"]
    if moved and freed:
        parts.append(f"{moved / freed:.1f} B moved/B")
    if seconds and freed:
        parts.append(f"est. {seconds * 1e3:.2f} ms")
    return ", ".join(parts)


@dataclass
class RegionCandidate:
    """A region or a link, from the meta-device profile."""

    cost: Union[RegionCost, LinkCost]
    kind: str  # "region" or "link"
    flops_per_byte: float
    sort_key: float = 0.0  # weighted seconds per byte freed; a link sorts after its two regions

    @property
    def name(self) -> str:
        return f"{self.cost.first}→{self.cost.second}" if self.kind == "link" else self.cost.name

    @property
    def marginal_bytes(self) -> int:
        return self.cost.freed_bytes

    @property
    def seconds(self) -> float:
        """Its recompute's estimated time, weighted by REGION_TIME_COST, and the checkpointed call it adds
        (REGION_CALL_OPS). A rebuild runs one kernel per tensor inside the fused ops, no forward again and
        no call of its own: neither applies."""
        if self.kind == "rebuild":
            return time_model.seconds(self.cost.flops, self.cost.moved, self.cost.ops)
        recompute = REGION_TIME_COST * time_model.seconds(self.cost.flops, self.cost.moved, self.cost.ops)
        return recompute + time_model.seconds(0, 0, REGION_CALL_OPS)

    def describe(self) -> str:
        return _described(self.flops_per_byte, self.cost.moved, self.cost.freed_bytes, self.seconds)


Entry = Union[Candidate, RegionCandidate]


def encloses(outer: RegionCost, inner: RegionCost) -> bool:
    """Whether `inner` lies inside `outer` (an inner region or a chain, at any depth)."""
    return inner.nodes < outer.nodes


def _overlaps(a: RegionCost, b: RegionCost) -> bool:
    """Whether `a` and `b` share nodes and neither contains the other: the two cannot both be recomputed."""
    return bool(a.nodes & b.nodes) and not (a.nodes <= b.nodes or b.nodes <= a.nodes)


# What a region's recompute costs against the time model's price of its forward: it runs again op by op
# under checkpoint, recording autograd's graph and writing every intermediate into fresh memory.
# Measured with benchmarks/time_model.py (docs/memory_budgets.md#the-time-model): a checkpointed train
# step of a block costs 0.7-1.9x its priced forward beyond the plain step on ResNet-50's and DLA-34's
# blocks, 2.0-6.5x on EfficientNet-B0's (depthwise convs, squeeze-excite); the geometric mean of the
# twelve is 1.5. Under the FLOP-only cost this replaced it was 2.6, pointwise work included.
REGION_TIME_COST = 1.5

# What one checkpointed call costs beyond the ops it runs, in ops (the time model's cost of one op): a region
# runs as one call of fxfuse's lean checkpoint (checkpointed.py), and a link is charged one too: a nested chain
# runs under one more call, whose recompute runs its members' calls again, so that call costs more the longer
# the chain (timed with torch.utils.checkpoint on chains of 2-6 tiny members: about one call per link).
# `benchmarks/region_overhead.py --pairs 1,3,6,12`: a call adds ~160 µs of host time to a region's forward
# and backward on the 2-core machines here, plus ~30 µs per conv + ReLU pair it runs again (which the model
# prices as their recompute), where OP_SECONDS is 3.4 µs. Under torch.utils.checkpoint the call was 250-370 µs
# (priced at 80 ops). Nothing beside a block's recompute at 224² (milliseconds), but most of a region's cost on tiny
# inputs: without it, ResNet-50's budget at 2×3×16×16 took two 0-FLOP chains that free 16 and 32 KiB, a
# checkpoint call each.
REGION_CALL_OPS = 45


REBUILD_NAME = "BN→activation outputs"


def rebuild_candidate(freed_bytes: int, moved: int, ops: int) -> RegionCandidate:
    """The rebuild entry: what it frees beyond the pointwise-only selection, the bytes its rebuilds read and
    write, and how many run (fusion/counts.py counts them)."""
    cost = RegionCost(REBUILD_NAME, "rebuild", (), 0, freed_bytes, moved=moved, ops=ops)
    return RegionCandidate(cost, "rebuild", 0.0)


def rank(
    upgrades: list[Candidate], profile: Optional[Profile], rebuild: Optional[RegionCandidate] = None
) -> list[Entry]:
    """Upgrades (already sorted by policy.candidates), regions, links and the rebuild in one list, cheapest per
    byte first."""
    entries: list[Entry] = list(upgrades)
    if rebuild is not None and rebuild.marginal_bytes > 0:
        rebuild.sort_key = rebuild.seconds / rebuild.marginal_bytes
        entries.append(rebuild)
    region_keys = {}
    if profile is not None:
        for cost in profile.regions:
            if cost.freed_bytes > 0:
                region = RegionCandidate(cost, "region", cost.flops / cost.freed_bytes)
                region.sort_key = region.seconds / cost.freed_bytes
                entries.append(region)
                region_keys[cost.name] = region.sort_key
        for link in profile.links:
            if link.freed_bytes > 0 and link.first in region_keys and link.second in region_keys:
                candidate = RegionCandidate(link, "link", link.flops / link.freed_bytes)
                own = candidate.seconds / link.freed_bytes
                candidate.sort_key = max(own, region_keys[link.first], region_keys[link.second])
                entries.append(candidate)

    def key(e: Entry):
        if isinstance(e, Candidate):
            unknown = e.seconds_per_byte is None
            return (unknown, e.seconds_per_byte or 0.0, 0, -(e.marginal_bytes or 0))
        return (False, e.sort_key, 1 if e.kind == "link" else 0, -e.marginal_bytes)

    entries.sort(key=key)
    ranked: list[Entry] = []
    regions_so_far: list[RegionCost] = []
    done: set[int] = set()

    def comes_first(e: Entry, outer: RegionCandidate) -> bool:
        """Whether `e` lies inside `outer` and costs less in all: what a budget may take instead of it."""
        if isinstance(e, Candidate):
            within = site_in_region(e.site.names, outer.cost)
        else:
            within = e.kind == "region" and encloses(outer.cost, e.cost)
        return within and e.seconds is not None and e.seconds < outer.seconds

    def emit(i: int) -> None:
        e = entries[i]
        done.add(i)
        if isinstance(e, Candidate) and any(site_in_region(e.site.names, r) for r in regions_so_far):
            return
        if isinstance(e, RegionCandidate) and e.kind == "region":
            if any(encloses(r, e.cost) or _overlaps(r, e.cost) for r in regions_so_far):
                return  # inside a region before it (which recomputes it already), or across one's edge
            # What it encloses, ranks after it and costs less in all comes first: a budget that needs
            # part of its bytes stops there, and where it needs them all, this region replaces them (select).
            for j in range(i + 1, len(entries)):
                if j not in done and comes_first(entries[j], e):
                    emit(j)
            regions_so_far.append(e.cost)
        ranked.append(e)

    for i in range(len(entries)):
        if i not in done:
            emit(i)
    return ranked


@dataclass
class Selection:
    """What a prefix of the ranking selects: the sites the passes may rewrite and the region groups."""

    allowed: frozenset
    fallback: set  # pointwise sites kept in place of an upgrade that was not taken (or is inside a region)
    groups: tuple  # tuples of region names: one region, or a chain joined by links
    upgrades: list[Candidate] = field(default_factory=list)  # the upgrades in effect
    regions: list[RegionCandidate] = field(default_factory=list)
    links: list[RegionCandidate] = field(default_factory=list)
    flat_links: frozenset = frozenset()  # (first, second) of links run flat (regions/graph.py); see policy
    rebuild: Optional[RegionCandidate] = None  # the rebuild entry, where taken


def _groups(regions: list[RegionCandidate], links: list[RegionCandidate], order: list[str]) -> tuple:
    joined = {(link.cost.first, link.cost.second) for link in links}
    names = [n for n in order if n in {r.cost.name for r in regions}]
    groups: list[list[str]] = []
    for name in names:
        if groups and (groups[-1][-1], name) in joined:
            groups[-1].append(name)
        else:
            groups.append([name])
    return tuple(tuple(g) for g in groups)


def select(prefix: list[Entry], pointwise: list[SiteData], region_order: list[str]) -> Selection:
    regions = [e for e in prefix if isinstance(e, RegionCandidate) and e.kind == "region"]
    regions = [r for r in regions if not any(encloses(o.cost, r.cost) for o in regions)]  # the outermost ones
    links = [e for e in prefix if isinstance(e, RegionCandidate) and e.kind == "link"]
    upgrades = [
        e for e in prefix if isinstance(e, Candidate) and not any(site_in_region(e.site.names, r.cost) for r in regions)
    ]
    taken = {name for c in upgrades for name in c.site.layers}
    fallback = {p.names for p in pointwise if not p.layers & taken}
    allowed = frozenset({c.site.names for c in upgrades} | fallback)
    rebuild = next((e for e in prefix if isinstance(e, RegionCandidate) and e.kind == "rebuild"), None)
    return Selection(
        allowed, fallback, _groups(regions, links, region_order), upgrades, regions, links, rebuild=rebuild
    )


def estimated_gain(selection: Selection) -> int:
    """Bytes the selection frees beyond the pointwise-only form, by the per-site and per-region estimates."""
    return (
        sum(c.marginal_bytes or 0 for c in selection.upgrades)
        + sum(r.marginal_bytes for r in selection.regions)
        + sum(link.marginal_bytes for link in selection.links)
        + (selection.rebuild.marginal_bytes if selection.rebuild else 0)
    )


def recompute_cost(selection: Selection) -> float:
    """The selection's estimated recompute seconds, a region's (and a nested link's) weighted by REGION_TIME_COST
    and with its checkpoint call (REGION_CALL_OPS)."""
    nested = [link for link in selection.links if (link.cost.first, link.cost.second) not in selection.flat_links]
    rebuild = [selection.rebuild] if selection.rebuild else []
    return sum(e.seconds or 0.0 for e in [*selection.upgrades, *selection.regions, *nested, *rebuild])


def estimated_time(selection: Selection, step_seconds: float) -> float:
    """Estimated step time of the selection, as a multiple of eager's, whose step the time model puts at
    `step_seconds` (counts.Counts.eager_step_seconds)."""
    return 1.0 + recompute_cost(selection) / step_seconds
