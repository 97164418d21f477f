"""What to recompute when recomputing costs time: `memory_budget=`, `peak_budget=` and mode="auto".

A site where fxfuse recomputes a convolution or a linear layer in backward (an
*upgrade*) saves bytes and costs FLOPs. Pointwise sites (BN→activation, and the
"fast" form of Conv→BN→activation) recompute only pointwise work, which the fused
kernels do faster than eager does the original, so they are always taken. An upgrade
replaces the pointwise site on the same modules, so it is worth its *marginal* bytes:
what it saves beyond that pointwise site.

Below what per-site fusion reaches, whole *regions* (a residual block, or a run of
nodes between blocks) keep only their inputs and run their forward again in backward,
and *links* chain consecutive regions (fusion/regions/ranking.py). Upgrades, regions and links
are ranked together by estimated recompute time per byte freed (regions/time_model.py: FLOPs
for convs and matmuls, bytes moved for the rest), cheapest first, and every
selection is a prefix of that one ranking, so a tighter budget never saves less:

* `memory_budget=b`: the shortest prefix whose saved activations are at most b × eager's.
  Both sides are counted the way `fxfuse.measure` counts them (unique storages saved
  for backward), on a meta-device copy of the model: shapes, no compute, nothing of the
  user's touched. The per-site and per-region estimates pick the prefix; the meta count
  checks it. Without peak_budget it is lengthened, if need be, until its step peak is no
  higher than the few shorter prefixes' a slightly looser budget would take (_no_higher_peak),
  so a tighter budget does not raise the peak; the report gives the nearest cheaper point, with estimated times.
* `peak_budget=p`: the shortest prefix (at least as long as memory_budget's) whose peak
  during a train step is at most p × eager's, both counted on a meta-device copy
  (`measure.step_peak_bytes_meta`): what decides whether a batch fits. Searched by
  bisection, which assumes the peak does not rise along the ranking; the count checks
  the prefix it ends on. Below the floor no prefix reaches, the shortest prefix at the
  lowest peak found (_lowest), and the report says what that floor consists of. Then
  the slack between that peak and p buys time: each chosen link (largest first region
  first) runs *flat*, both regions in one recompute, when the counted peak stays within p
  (regions/graph.py). Flat or not, a link frees the same bytes, so the saved activations
  do not change; without a peak budget no link is flat.
* mode="auto": the upgrades that cost at most AUTO_MAX_FLOPS_PER_BYTE, e.g. depthwise
  convs and 1×1 convs with few input channels (no regions).
* mode="memory": every upgrade that frees bytes beyond its pointwise form, whatever it
  costs (no regions). An upgrade whose BN→activation output feeds one conv frees
  nothing: the pointwise form already has that conv rebuild it (passes/bn_act_conv.py),
  and recomputing the conv would keep the conv input instead of the BN input, of the
  same size. It is left out, with the reason in the report, so no conv is recomputed
  for nothing (ResNet-50: 21 of its 53 sites recompute their conv).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import torch
from torch import nn

from ..errors import ConfigurationError
from . import wording
from .counts import Counts
from .plan import Choice, Plan, SiteData
from .regions import ranking
from .regions.costs import Profile
from .regions.ranking import Candidate, Entry, RegionCandidate, Selection, estimated_gain, rank, select
from .tracing import first_line

# mode="auto" takes an upgrade when one backward recompute costs at most this many FLOPs
# per byte it frees. 64 FLOP/B in float32 is a 1×1 conv with 128 input channels per group,
# or any depthwise conv; a 3×3 conv with 64 input channels costs 288.
AUTO_MAX_FLOPS_PER_BYTE = 64.0


def device_notes(inputs, rates_measured_there: bool = False) -> list[str]:
    """What the report says when the policy's CPU-measured constants rank sites for another device."""
    devices = sorted({t.device.type for t in torch.utils._pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)})
    return [device_note(device, rates_measured_there) for device in devices if device not in ("cpu", "meta")]


def device_note(device: str, rates_measured_there: bool = False) -> str:
    """`rates_measured_there`: the time model's rates are the device's own (regions/time_model.for_device, or
    pinned), so only auto's limit and the regions' factor are the CPU's."""
    rates = "" if rates_measured_there else "the time model's FLOP and byte rates, "
    return (
        f"on {device}: the ranking's cost constants (auto's {AUTO_MAX_FLOPS_PER_BYTE:.0f} FLOP/B limit, "
        f"{rates}regions' {ranking.REGION_TIME_COST}x and {ranking.REGION_CALL_OPS}-op call) were measured on CPU and "
        f"are not calibrated for {device}; measure the chosen plan with `fxfuse bench --device {device}`"
    )


def plan_of(selection: Selection, choice: Optional[Choice] = None) -> Plan:
    """The plan that runs `selection`: every plan the policy counts or returns is built here."""
    return Plan(selection.allowed, selection.groups, selection.flat_links, selection.rebuild is not None, choice)


def _intrinsic_flops_per_byte(model: nn.Module, site: SiteData) -> Optional[float]:
    """Recompute FLOPs per byte of the recomputed output, from the layer's weight alone (no shapes needed)."""
    try:
        layer = model.get_submodule(site.names[0])
    except (AttributeError, ValueError):
        return None  # functional call ("scope:function")
    weight = getattr(layer, "weight", None)
    if weight is None or weight.dim() not in (2, 4):
        return None
    per_output = math.prod(weight.shape[1:])  # in_features, or in_channels/groups × kh × kw
    return 2.0 * per_output / weight.element_size()


def _candidate(model: nn.Module, site: SiteData, pointwise: list[SiteData]) -> Candidate:
    """`site` as an upgrade of the pointwise sites on its layers, with its bytes and cost where known."""
    fallback = [p for p in pointwise if p.layers & site.layers]
    marginal = None
    if site.saved_bytes is not None and all(p.saved_bytes is not None for p in fallback):
        marginal = site.saved_bytes - sum(p.saved_bytes for p in fallback)
    ratio = None
    if site.recompute_flops is not None and marginal:
        ratio = site.recompute_flops / marginal
    if ratio is None:
        ratio = _intrinsic_flops_per_byte(model, site)
    return Candidate(site, fallback, marginal, ratio)


def _upgrades(model: nn.Module, memory: list[SiteData], pointwise: list[SiteData]) -> list[Candidate]:
    """Every site of `memory` that recomputes a layer, as an upgrade of the pointwise sites on its layers."""
    return [_candidate(model, s, pointwise) for s in memory if s.recomputes]


def _rebuilt_by_next_conv(candidate: Candidate, merge_breakers: frozenset = frozenset()) -> bool:
    """Its pointwise form is a BN→activation merged into the next conv (passes/bn_act_conv.py), which
    keeps an input of the same size as the conv input the upgrade would keep: it frees nothing. Not
    where that next conv is in `merge_breakers` (it recomputes as a conv→activation site, which a
    BN→activation cannot merge into)."""
    fallback = candidate.fallback
    return bool(fallback) and all(
        p.op == "fxfuse::bn_act_conv" and p.merged_into not in merge_breakers for p in fallback
    )


def candidates(
    model: nn.Module, memory: list[SiteData], fast: list[SiteData]
) -> tuple[list[Candidate], list[SiteData]]:
    """Upgrades ranked cheapest first, and the pointwise sites (taken in any case), from the sites the
    passes found in mode "memory" and "fast".

    Upgrades that free nothing beyond their pointwise form are not candidates."""
    pointwise = list(fast)
    upgrades = [
        c
        for c in _upgrades(model, memory, pointwise)
        if not _rebuilt_by_next_conv(c) and not (c.marginal_bytes is not None and c.marginal_bytes <= 0)
    ]
    upgrades.sort(key=lambda c: (c.flops_per_byte is None, c.flops_per_byte or 0.0, -(c.marginal_bytes or 0)))
    return upgrades, pointwise


def _pointwise_only(pointwise: list[SiteData]) -> Selection:
    """The selection of the empty prefix: every pointwise site, no upgrade, no region."""
    return select([], pointwise, [])


# --------------------------------------------------------------------------- modes


def choose_auto(model: nn.Module, memory: list[SiteData], fast: list[SiteData]) -> Plan:
    upgrades, pointwise = candidates(model, memory, fast)
    chosen = [c for c in upgrades if c.flops_per_byte is not None and c.flops_per_byte <= AUTO_MAX_FLOPS_PER_BYTE]
    rejected = [c for c in upgrades if c not in chosen]
    selection = select(chosen, pointwise, [])
    return plan_of(selection, Choice("auto", AUTO_MAX_FLOPS_PER_BYTE, selection, chosen, rejected))


def choose_memory(model: nn.Module, memory: list[SiteData], fast: list[SiteData]) -> Plan:
    """Every upgrade but the idle ones, whose BN→activation output the next conv rebuilds anyway."""
    pointwise = list(fast)
    merge_breakers = frozenset(s.names[0] for s in memory if s.op == "fxfuse::conv_act")
    upgrades, idle = [], []
    for candidate in _upgrades(model, memory, pointwise):
        if _rebuilt_by_next_conv(candidate, merge_breakers):
            idle.append(candidate.site)
        else:
            upgrades.append(candidate)
    selection = select(upgrades, pointwise, [])
    return plan_of(selection, Choice("memory", AUTO_MAX_FLOPS_PER_BYTE, selection, upgrades, idle=idle))


# --------------------------------------------------------------------------- budgets


def choose_budget(
    model: nn.Module,
    memory: list[SiteData],
    fast: list[SiteData],
    budget: Optional[float],
    counts: Counts,
    peak_budget: Optional[float] = None,
) -> Plan:
    """The shortest prefix of the ranking that meets `budget` and `peak_budget`; where one cannot be met, the
    shortest prefix that reaches the lowest value found (and say so, and what that floor is made of).

    Three phases, each on the prefixes counted so far: the saved bytes (`_meet_memory`), the step peak
    (`_meet_peak`: within it, spare peak runs links flat), the rebuild as it frees in the prefix taken
    (`_settle_rebuild`)."""
    upgrades, pointwise = candidates(model, memory, fast)
    choice = Choice("budget", AUTO_MAX_FLOPS_PER_BYTE, budget=budget, peak_budget=peak_budget)
    _count_eager(model, counts, choice)
    prefixes = _Prefixes.ranked(upgrades, pointwise, counts, choice.notes)
    k = _meet_memory(prefixes, choice, pointwise) if budget is not None else 0
    k = _meet_peak(prefixes, choice, k)
    _settle_rebuild(prefixes, choice, k)
    _take(prefixes, choice, k)
    return plan_of(choice.selection, choice)


def _count_eager(model: nn.Module, counts: Counts, choice: Choice) -> None:
    """Eager's saved bytes and step peak, which the budgets are fractions of."""
    budget, peak_budget = choice.budget, choice.peak_budget
    if budget is not None:
        choice.eager_bytes = _eager_count(model, "saved activations", "memory_budget", budget, counts.eager_bytes)
    if peak_budget is not None:
        choice.eager_peak_bytes = _eager_count(model, "step peak", "peak_budget", peak_budget, counts.eager_peak)
    else:  # reported beside the saved bytes
        choice.eager_peak_bytes = _optional(counts.eager_peak)


def _eager_count(model: nn.Module, what: str, budget_name: str, budget: float, count: Callable[[], int]) -> int:
    try:
        return count()
    except Exception as exc:  # noqa: BLE001 - arbitrary models on the meta device; re-raised as one line
        raise ConfigurationError(
            f"{budget_name}={budget} cannot be applied to {type(model).__name__}: counting eager's {what} "
            f"needs a run on the meta device, which raises {type(exc).__name__}: "
            f"{first_line(exc)} (optimize without {budget_name}, or with mode='auto')"
        ) from exc


class _Prefixes:
    """The ranking's prefixes and what each selects, each counted on the meta device at most once."""

    def __init__(
        self,
        ranking: list[Entry],
        selections: list[Selection],
        counts: Counts,
        notes: list[str],
        base_bytes,
        left_out: Optional[dict[str, str]] = None,
    ) -> None:
        self.ranking, self.selections, self.counts, self.notes = ranking, selections, counts, notes
        self.gains = [estimated_gain(s) for s in selections]
        # The empty prefix is the pointwise-only selection _rebuild_entry counted: counted once.
        self._saved: dict[int, Optional[int]] = {} if base_bytes is None else {0: base_bytes}
        self._peaks: dict[int, int] = {}
        self.left_out = left_out or {}  # region name -> why it cannot be one

    @classmethod
    def ranked(cls, upgrades: list[Candidate], pointwise: list[SiteData], counts: Counts, notes: list[str]):
        """The one ranking of upgrades, regions, links and the rebuild, cheapest per byte first."""
        profile = _region_profile(counts, pointwise, notes)
        rebuild_entry, base_bytes = _rebuild_entry(counts, pointwise, notes)
        entries = rank(upgrades, profile, rebuild_entry)
        order = [r.name for r in profile.regions] if profile else []
        selections = [select(entries[:k], pointwise, order) for k in range(len(entries) + 1)]
        return cls(entries, selections, counts, notes, base_bytes, profile.problems if profile else None)

    @property
    def last(self) -> int:
        return len(self.ranking)

    def saved(self, k: int) -> Optional[int]:
        """Bytes saved for backward with prefix `k` (None, and a note, where it cannot be counted)."""
        if k not in self._saved:
            try:
                self._saved[k] = self.counts.plan_bytes(plan_of(self.selections[k]))
            except Exception as exc:  # noqa: BLE001
                self.notes.append(wording.uncounted(exc))
                self._saved[k] = None
        return self._saved[k]

    def peak(self, k: int) -> int:
        """The step peak with prefix `k`."""
        if k not in self._peaks:
            self._peaks[k] = self.counts.plan_peak(plan_of(self.selections[k]))
        return self._peaks[k]

    def optional_peak(self, k: int) -> Optional[int]:
        return _optional(lambda: self.peak(k))

    def replace(self, k: int, selection: Selection) -> None:
        """Prefix `k` now selects `selection` (links run flat, the rebuild settled): counted again when asked."""
        self.selections[k] = selection
        self._saved.pop(k, None)
        self._peaks.pop(k, None)

    def first_gaining(self, start: int, needed: float) -> int:
        """The first prefix from `start` estimated to free `needed` bytes more than `start`."""
        k = start
        while k < self.last and self.gains[k] - self.gains[start] < needed:
            k += 1
        return k


def _region_profile(counts: Counts, pointwise: list[SiteData], notes: list[str]) -> Optional[Profile]:
    try:
        profile = counts.profile(_pointwise_only(pointwise).allowed)
    except Exception as exc:  # noqa: BLE001 - regions are optional: per-site fusion still applies
        notes.append(wording.no_regions(exc))
        return None
    if profile is None:
        notes.append(wording.no_regions(None))
    return profile


def _rebuild_entry(
    counts: Counts, pointwise: list[SiteData], notes: list[str]
) -> tuple[Optional[RegionCandidate], Optional[int]]:
    """The ranking's rebuild entry (passes/rebuild.py), from two meta-device counts of the pointwise-only
    selection (None where rebuilding frees nothing), and that selection's saved bytes, which the budget
    search starts from. Each rebuild reads the BN input and writes the output."""
    base = plan_of(_pointwise_only(pointwise))
    try:
        rebuilt, moved, count = counts.rebuild_counts(base)
        base_bytes = counts.plan_bytes(base)
    except Exception as exc:  # noqa: BLE001 - the rebuild is optional: the rest of the ranking still applies
        notes.append(wording.no_rebuild(exc))
        return None, None
    freed = base_bytes - rebuilt
    return (ranking.rebuild_candidate(freed, 2 * moved, count) if freed > 0 else None), base_bytes


def _meet_memory(prefixes: _Prefixes, choice: Choice, pointwise: list[SiteData]) -> int:
    """The shortest prefix whose counted saved bytes meet the memory budget: from the per-site and per-region
    estimates, lengthened while the count says more is needed; where none does, the shortest at the lowest
    count (_lowest). Without a peak budget, lengthened so as not to raise the step peak (_no_higher_peak)."""
    target = choice.budget * choice.eager_bytes
    # Start from the measured pointwise-only selection: per-site estimates of pointwise sites
    # miss what in-place activations save, and overshooting here would recompute for nothing.
    baseline = prefixes.saved(0)
    if baseline is None:
        baseline = choice.eager_bytes - sum(p.saved_bytes or 0 for p in pointwise)
    k = prefixes.first_gaining(0, baseline - target)
    while True:
        measured = prefixes.saved(k)
        if measured is None or measured <= target or k == prefixes.last:
            break
        # The estimates were optimistic (e.g. shared storages): take more, cheapest first.
        k = max(k + 1, prefixes.first_gaining(k, measured - target))
    if measured is not None and measured > target:
        return _lowest(0, prefixes.last, prefixes.saved)
    if measured is not None and choice.peak_budget is None:
        return _no_higher_peak(k, target, prefixes, choice)
    return k


def _lowest(low: int, high: int, value: Callable[[int], Optional[int]]) -> int:
    """The shortest prefix in [low, high] whose value is the lowest found, by bisection: `high` holds the
    lowest value so far, and a prefix between at or below it takes its place. Like _shortest_within_peak it
    assumes the value does not rise along the ranking before it stops falling, so the prefix found is
    where more recompute stops lowering it."""
    best = value(high)
    if best is None:
        return high
    while high - low > 1:
        mid = (low + high) // 2
        v = value(mid)
        if v is not None and v <= best:
            high, best = mid, v
        else:
            low = mid
    v = value(low)
    return low if v is not None and v <= best else high


_PEAK_WINDOW = 4


def _no_higher_peak(k: int, target: float, prefixes: _Prefixes, choice: Choice) -> int:
    """From prefix `k` (which meets the saved-bytes `target`) on, the first that meets it with a step peak no
    higher than the last `_PEAK_WINDOW` shorter prefixes': a slightly looser budget takes one of those, or
    one at or below their lowest peak, so a tighter budget does not raise the peak. `k` itself where no
    prefix does (and say so).

    Only a window is counted because each count is a meta-device train step: counting every shorter
    prefix made optimize(resnet50, memory_budget=0.2) about 3× slower (8.5 s against 2.9 s at 8×224²).
    Much looser budgets keep much more, and their peaks lie well above (tests/test_budget_floor.py sweeps
    it)."""
    eager = choice.eager_peak_bytes
    if eager is None:
        return k
    counted = {j: prefixes.optional_peak(j) for j in range(max(0, k - _PEAK_WINDOW), k + 1)}
    if any(p is None for p in counted.values()):
        return k
    lowest = min(counted.values())
    for j in range(k, prefixes.last + 1):
        p, b = prefixes.optional_peak(j), prefixes.saved(j)
        if p is None or b is None:
            break
        if p <= lowest and b <= target:
            if j > k:
                choice.notes.append(wording.took_more(j - k, k, counted[k] / eager, lowest / eager))
            return j
    choice.notes.append(wording.peak_raised(counted[k] / eager, lowest / eager))
    return k


def _meet_peak(prefixes: _Prefixes, choice: Choice, k: int) -> int:
    """Under a peak budget, the shortest prefix from `k` whose step peak is within it, with its links run flat
    while the peak stays within it; where none is, the shortest at the lowest peak (and what that floor is
    made of). Without one, `k`, its peak counted to be reported where it can be."""
    if choice.peak_budget is None:
        choice.selected_peak_bytes = prefixes.optional_peak(k)
        return k
    target = choice.peak_budget * choice.eager_peak_bytes
    k = _shortest_within_peak(k, prefixes.last, target, prefixes.peak)
    choice.selected_peak_bytes = prefixes.peak(k)
    if choice.peak_met:
        flat = _flatten_within_peak(prefixes.selections[k], target, prefixes.counts, choice)
        if flat.flat_links:
            prefixes.replace(k, flat)  # counted again below, in the form that runs
    else:
        choice.notes.append(wording.peak_floor(choice, k, prefixes.last, _peak_parts(prefixes, k)))
    return k


def _shortest_within_peak(low: int, high: int, target: float, peak: Callable[[int], int]) -> int:
    """The shortest prefix in [low, high] whose counted step peak is at most `target`, by bisection
    (which assumes the peak does not rise along the ranking); if none is, the shortest that reaches the
    lowest peak found (_lowest): more recompute would not lower it."""
    if peak(low) <= target:
        return low
    if peak(high) > target:
        return _lowest(low, high, peak)
    while high - low > 1:
        mid = (low + high) // 2
        if peak(mid) <= target:
            high = mid
        else:
            low = mid
    return high


def _peak_parts(prefixes: _Prefixes, k: int):
    """What the step peak of prefix `k` consists of (measure.PeakParts), or None where it cannot be counted."""
    try:
        return prefixes.counts.plan_peak_parts(plan_of(prefixes.selections[k]))
    except Exception:  # noqa: BLE001 - the note stands without the breakdown
        return None


def _flatten_within_peak(selection: Selection, target: float, counts: Counts, choice: Choice) -> Selection:
    """`selection` with each of its links run flat, largest first region first, while the counted step
    peak stays at most `target` (each try one count on the meta device)."""
    for link in sorted(selection.links, key=lambda e: -e.cost.flops):
        trial = dataclasses.replace(selection, flat_links=selection.flat_links | {(link.cost.first, link.cost.second)})
        try:
            peak = counts.plan_peak(plan_of(trial))
        except Exception:  # noqa: BLE001 - a link stays nested when its flat form cannot be counted
            continue
        if peak <= target:
            selection, choice.selected_peak_bytes = trial, peak
    return selection


def _settle_rebuild(prefixes: _Prefixes, choice: Choice, k: int) -> None:
    """Prefix `k`'s rebuild entry as it frees in that selection: counted once more without it, since the
    regions and upgrades chosen after it may cover the sites it rebuilds (its ranking estimate is the
    pointwise-only selection's). Left out where it frees nothing there, or, under a peak budget alone, where
    the step peak is within the budget without it; then the plan is counted again."""
    with_it = prefixes.saved(k) if choice.budget is not None else None
    selection = prefixes.selections[k]
    if selection.rebuild is None:
        return
    peak_target = None
    if choice.peak_budget is not None and choice.budget is None:
        peak_target = choice.peak_budget * choice.eager_peak_bytes
    without = dataclasses.replace(selection, rebuild=None)
    counts = prefixes.counts
    try:
        if with_it is None:
            with_it = counts.plan_bytes(plan_of(selection))
        freed = counts.plan_bytes(plan_of(without)) - with_it
        unneeded = peak_target is not None and counts.plan_peak(plan_of(without)) <= peak_target
    except Exception:  # noqa: BLE001 - the estimate stands where the selection cannot be counted again
        return
    if freed <= 0 or unneeded:
        choice.notes.append(wording.not_rebuilt(ranking.REBUILD_NAME, unneeded))
        prefixes.replace(k, without)
        choice.selected_peak_bytes = prefixes.peak(k) if choice.peak_budget is not None else prefixes.optional_peak(k)
        return
    entry = selection.rebuild
    settled = ranking.rebuild_candidate(freed, entry.cost.moved, entry.cost.ops)
    prefixes.selections[k] = dataclasses.replace(selection, rebuild=settled)  # the same plan: its counts stand


def _take(prefixes: _Prefixes, choice: Choice, k: int) -> None:
    """Record prefix `k` as the choice: what it selects, its saved bytes, and the notes on both budgets."""
    choice.selection = prefixes.selections[k]
    choice.chosen, choice.rejected = prefixes.ranking[:k], prefixes.ranking[k:]
    if choice.budget is not None:
        choice.selected_bytes = prefixes.saved(k)
    else:  # reported beside the peak
        choice.eager_bytes = _optional(prefixes.counts.eager_bytes)
        choice.selected_bytes = prefixes.saved(k)
        if choice.eager_bytes and choice.selected_bytes is not None:
            choice.notes.append(wording.saved_beside(choice))
    if choice.met is False:
        choice.notes.append(wording.unreachable(choice, k, prefixes.last))
        if prefixes.left_out:
            choice.notes.append(wording.regions_left_out(prefixes.left_out))
    if choice.budget is not None and choice.peak_budget is None and choice.met:  # a shorter prefix may break a peak
        _say_cost(prefixes, choice, k)


# The nearest cheaper point is a shorter prefix estimated at least this much faster (× eager's step).
CHEAPER_BY = 0.05


def _say_cost(prefixes: _Prefixes, choice: Choice, k: int) -> None:
    """Note the chosen plan's estimated cost and the longest shorter prefix estimated CHEAPER_BY faster."""
    try:
        step_seconds = prefixes.counts.eager_step_seconds()
    except Exception:  # noqa: BLE001 - an estimate: left out where eager's step cannot be counted
        return
    if not step_seconds:
        return
    costs = [ranking.estimated_time(s, step_seconds) for s in prefixes.selections[: k + 1]]
    cheaper = next((j for j in range(k - 1, -1, -1) if costs[j] <= costs[k] - CHEAPER_BY), None)
    there = prefixes.saved(cheaper) if cheaper is not None else None
    cost_there = costs[cheaper] if there is not None else 0.0
    choice.notes.append(
        wording.estimated_cost(choice, costs[k], ranking.REGION_TIME_COST, there, cost_there, ranking.REGION_CALL_OPS)
    )


def _optional(count: Callable[[], int]) -> Optional[int]:
    try:
        return count()
    except Exception:  # noqa: BLE001 - the peak is reported when it can be counted
        return None
