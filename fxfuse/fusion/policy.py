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
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn

from ..errors import ConfigurationError
from .counts import Counts
from .plan import Choice, Plan, RegionChoice, Rejected, SiteData
from .regions import ranking
from .regions.costs import Profile
from .regions.ranking import Candidate, Entry, RegionCandidate, Selection, estimated_gain, rank, select
from .report import format_bytes
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
        f"{rates}regions' {ranking.REGION_TIME_COST}x) were measured on CPU and "
        f"are not calibrated for {device}; measure the chosen plan with `fxfuse bench --device {device}`"
    )


@dataclass
class Decision:
    """The policy's choice, and what it measured on the way."""

    allowed: frozenset  # site names the passes may rewrite
    policy: str  # "auto", "memory" or "budget"
    chosen: list[Entry]  # the prefix of the ranking taken
    rejected: list[Entry]  # the rest of the ranking
    fallback_names: set = field(default_factory=set)  # pointwise sites kept in place of a rejected upgrade
    budget: Optional[float] = None
    eager_bytes: Optional[int] = None
    selected_bytes: Optional[int] = None  # saved for backward with this selection (meta-device count)
    notes: list[str] = field(default_factory=list)
    groups: tuple = ()  # region groups to recompute (ranking.Selection.groups)
    flat_links: frozenset = frozenset()  # links of those groups run flat (ranking.Selection.flat_links)
    idle: list[SiteData] = field(default_factory=list)  # mode="memory": upgrades left out as freeing nothing
    selection: Optional[Selection] = None
    peak_budget: Optional[float] = None
    eager_peak_bytes: Optional[int] = None
    selected_peak_bytes: Optional[int] = None  # peak during a train step with this selection (meta device)

    @property
    def plan(self) -> Plan:
        rebuild = self.selection is not None and self.selection.rebuild is not None
        return Plan(self.allowed, self.groups, self.flat_links, rebuild, choice_of(self))

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


def plan_of(selection: Selection) -> Plan:
    return Plan(selection.allowed, selection.groups, selection.flat_links, selection.rebuild is not None)


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


def allowed_names(chosen: list[Candidate], pointwise: list[SiteData]) -> tuple[frozenset, set]:
    taken = {name for c in chosen for name in c.site.layers}
    fallback = {p.names for p in pointwise if not p.layers & taken}
    return frozenset({c.site.names for c in chosen} | fallback), fallback


def choose_auto(model: nn.Module, memory: list[SiteData], fast: list[SiteData]) -> Decision:
    upgrades, pointwise = candidates(model, memory, fast)
    chosen = [c for c in upgrades if c.flops_per_byte is not None and c.flops_per_byte <= AUTO_MAX_FLOPS_PER_BYTE]
    rejected = [c for c in upgrades if c not in chosen]
    allowed, fallback = allowed_names(chosen, pointwise)
    return Decision(allowed, "auto", chosen, rejected, fallback)


def choose_memory(model: nn.Module, memory: list[SiteData], fast: list[SiteData]) -> Decision:
    """Every upgrade but the idle ones, whose BN→activation output the next conv rebuilds anyway."""
    pointwise = list(fast)
    merge_breakers = frozenset(s.names[0] for s in memory if s.op == "fxfuse::conv_act")
    upgrades, idle = [], []
    for candidate in _upgrades(model, memory, pointwise):
        if _rebuilt_by_next_conv(candidate, merge_breakers):
            idle.append(candidate.site)
        else:
            upgrades.append(candidate)
    allowed, fallback_names = allowed_names(upgrades, pointwise)
    return Decision(allowed, "memory", upgrades, [], fallback_names, idle=idle)


def _eager_count(model: nn.Module, what: str, budget_name: str, budget: float, count: Callable[[], int]) -> int:
    try:
        return count()
    except Exception as exc:  # noqa: BLE001 - arbitrary models on the meta device; re-raised as one line
        raise ConfigurationError(
            f"{budget_name}={budget} cannot be applied to {type(model).__name__}: counting eager's {what} "
            f"needs a run on the meta device, which raises {type(exc).__name__}: "
            f"{first_line(exc)} (optimize without {budget_name}, or with mode='auto')"
        ) from exc


def _region_profile(counts: Counts, pointwise: list[SiteData], notes: list[str]) -> Optional[Profile]:
    try:
        profile = counts.profile(allowed_names([], pointwise)[0])
    except Exception as exc:  # noqa: BLE001 - regions are optional: per-site fusion still applies
        notes.append(f"no recompute regions: costing them on the meta device raised {type(exc).__name__}: {exc}")
        return None
    if profile is None:
        notes.append("no recompute regions: the model is not traced as one graph")
    return profile


def _rebuild_entry(
    counts: Counts, pointwise: list[SiteData], notes: list[str]
) -> tuple[Optional[RegionCandidate], Optional[int]]:
    """The ranking's rebuild entry (passes/rebuild.py), from two meta-device counts of the pointwise-only
    selection (None where rebuilding frees nothing), and that selection's saved bytes, which the budget
    search starts from. Each rebuild reads the BN input and writes the output."""
    base = Plan(allowed_names([], pointwise)[0])
    try:
        rebuilt, moved, count = counts.rebuild_counts(base)
        base_bytes = counts.plan_bytes(base)
    except Exception as exc:  # noqa: BLE001 - the rebuild is optional: the rest of the ranking still applies
        notes.append(f"no rebuilt activations: counting them on the meta device raised {type(exc).__name__}: {exc}")
        return None, None
    freed = base_bytes - rebuilt
    return (ranking.rebuild_candidate(freed, 2 * moved, count) if freed > 0 else None), base_bytes


def _settle_rebuild(
    selection: Selection,
    counts: Counts,
    with_it: Optional[int],
    notes: list[str],
    peak_target: Optional[float] = None,
) -> Selection:
    """`selection` with its rebuild entry as it frees in that selection: counted once more without it, since
    the regions and upgrades chosen after it may cover the sites it rebuilds (its ranking estimate is the
    pointwise-only selection's). Left out where it frees nothing there, or, under a peak budget alone, where
    the step peak is within `peak_target` without it."""
    if selection.rebuild is None:
        return selection
    without = dataclasses.replace(selection, rebuild=None)
    try:
        if with_it is None:
            with_it = counts.plan_bytes(plan_of(selection))
        freed = counts.plan_bytes(plan_of(without)) - with_it
        unneeded = peak_target is not None and counts.plan_peak(plan_of(without)) <= peak_target
    except Exception:  # noqa: BLE001 - the estimate stands where the selection cannot be counted again
        return selection
    if freed <= 0 or unneeded:
        if unneeded:
            why = "the step peak is within the peak budget without it"
        else:
            why = "the regions and layers recomputed in this plan cover what it would rebuild"
        notes.append(f"{ranking.REBUILD_NAME}: not rebuilt, {why}")
        return without
    entry = selection.rebuild
    return dataclasses.replace(selection, rebuild=ranking.rebuild_candidate(freed, entry.cost.moved, entry.cost.ops))


def choose_budget(
    model: nn.Module,
    memory: list[SiteData],
    fast: list[SiteData],
    budget: Optional[float],
    counts: Counts,
    peak_budget: Optional[float] = None,
) -> Decision:
    """The shortest prefix of the ranking that meets `budget` and `peak_budget`; where one cannot be met, the
    shortest prefix that reaches the lowest value found (and say so, and what that floor is made of)."""
    upgrades, pointwise = candidates(model, memory, fast)
    decision = Decision(frozenset(), "budget", [], [], budget=budget, peak_budget=peak_budget)
    if budget is not None:
        decision.eager_bytes = _eager_count(model, "saved activations", "memory_budget", budget, counts.eager_bytes)
    if peak_budget is not None:
        decision.eager_peak_bytes = _eager_count(model, "step peak", "peak_budget", peak_budget, counts.eager_peak)
    else:  # reported beside the saved bytes
        decision.eager_peak_bytes = _optional(counts.eager_peak)
    profile = _region_profile(counts, pointwise, decision.notes)
    rebuild_entry, base_bytes = _rebuild_entry(counts, pointwise, decision.notes)
    ranking = rank(upgrades, profile, rebuild_entry)
    order = [r.name for r in profile.regions] if profile else []
    selections = [select(ranking[:k], pointwise, order) for k in range(len(ranking) + 1)]
    gains = [estimated_gain(s) for s in selections]
    # The empty prefix is the pointwise-only selection _rebuild_entry counted: counted once.
    measured_bytes: dict[int, Optional[int]] = {} if base_bytes is None else {0: base_bytes}
    peaks: dict[int, int] = {}

    def saved(k: int) -> Optional[int]:
        if k not in measured_bytes:
            try:
                measured_bytes[k] = counts.plan_bytes(plan_of(selections[k]))
            except Exception as exc:  # noqa: BLE001
                decision.notes.append(
                    f"could not count the selection's saved activations on the meta device "
                    f"({type(exc).__name__}: {exc}); chose by the per-site estimates"
                )
                measured_bytes[k] = None
        return measured_bytes[k]

    def peak(k: int) -> int:
        if k not in peaks:
            peaks[k] = counts.plan_peak(plan_of(selections[k]))
        return peaks[k]

    def first_gaining(start: int, needed: float) -> int:
        k = start
        while k < len(ranking) and gains[k] - gains[start] < needed:
            k += 1
        return k

    k = 0
    if budget is not None:
        target = budget * decision.eager_bytes
        # Start from the measured pointwise-only selection: per-site estimates of pointwise sites
        # miss what in-place activations save, and overshooting here would recompute for nothing.
        baseline = saved(0)
        if baseline is None:
            baseline = decision.eager_bytes - sum(p.saved_bytes or 0 for p in pointwise)
        k = first_gaining(0, baseline - target)
        while True:
            measured = saved(k)
            if measured is None or measured <= target or k == len(ranking):
                break
            # The estimates were optimistic (e.g. shared storages): take more, cheapest first.
            k = max(k + 1, first_gaining(k, measured - target))
        if measured is not None and measured > target:
            k = _lowest(0, len(ranking), saved)
        elif measured is not None and peak_budget is None:
            k = _no_higher_peak(k, len(ranking), target, saved, _optional_peak(peak), decision)
    if peak_budget is not None:
        target = peak_budget * decision.eager_peak_bytes
        k = _shortest_within_peak(k, len(ranking), target, peak)
        decision.selected_peak_bytes = peak(k)
        if decision.peak_met:
            selections[k] = _flatten_within_peak(selections[k], target, counts, decision)
            if selections[k].flat_links:
                measured_bytes.pop(k, None)  # counted again below, in the form that runs
        else:
            _say_peak_floor(decision, counts, plan_of(selections[k]), k, len(ranking))
    else:
        decision.selected_peak_bytes = _optional(lambda: peak(k))
    peak_target = peak_budget * decision.eager_peak_bytes if peak_budget is not None and budget is None else None
    settled = _settle_rebuild(
        selections[k], counts, saved(k) if budget is not None else None, decision.notes, peak_target
    )
    dropped = settled.rebuild is None and selections[k].rebuild is not None
    selections[k] = settled
    if dropped:  # the plan changed: count it again
        measured_bytes.pop(k, None)
        peaks.pop(k, None)
        decision.selected_peak_bytes = peak(k) if peak_budget is not None else _optional(lambda: peak(k))
    chosen = selections[k]
    decision.selection = chosen
    decision.allowed, decision.fallback_names, decision.groups = chosen.allowed, chosen.fallback, chosen.groups
    decision.flat_links = chosen.flat_links
    decision.chosen, decision.rejected = ranking[:k], ranking[k:]
    if budget is not None:
        decision.selected_bytes = saved(k)
    else:  # reported beside the peak
        decision.eager_bytes = _optional(counts.eager_bytes)
        decision.selected_bytes = _optional(lambda: saved(k))
        if decision.eager_bytes and decision.selected_bytes is not None:
            decision.notes.append(
                f"saved activations {format_bytes(decision.selected_bytes)} of eager's "
                f"{format_bytes(decision.eager_bytes)} ({decision.selected_bytes / decision.eager_bytes:.3f}×, "
                "counted on the meta device)"
            )
    if decision.met is False:
        decision.notes.append(
            f"memory budget {budget:.2f}× is not reachable: the least the ranking keeps is "
            f"{decision.selected_bytes / decision.eager_bytes:.3f}× of eager's saved activations, first reached "
            f"with {k} of its {len(ranking)} entries (more recompute does not lower it), so fxfuse stopped there"
        )
    if budget is not None and peak_budget is None and decision.met:  # a shorter prefix may break a peak budget
        _say_nearest_cheaper(decision, counts, selections, k, saved)
    return decision


def _optional(count: Callable[[], int]) -> Optional[int]:
    try:
        return count()
    except Exception:  # noqa: BLE001 - the peak is reported when it can be counted
        return None


def _optional_peak(peak: Callable[[int], int]) -> Callable[[int], Optional[int]]:
    return lambda k: _optional(lambda: peak(k))


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


def _no_higher_peak(
    k: int,
    last: int,
    target: float,
    saved: Callable[[int], Optional[int]],
    peak: Callable[[int], Optional[int]],
    decision: Decision,
) -> int:
    """From prefix `k` (which meets the saved-bytes `target`) up to `last`, the first that meets it with a
    step peak no higher than the last `_PEAK_WINDOW` shorter prefixes': a slightly looser budget takes one
    of those, or one at or below their lowest peak, so a tighter budget does not raise the peak. `k`
    itself where no prefix does (and say so).

    Only a window is counted because each count is a meta-device train step: counting every shorter
    prefix made optimize(resnet50, memory_budget=0.2) about 3× slower (8.5 s against 2.9 s at 8×224²).
    Much looser budgets keep much more, and their peaks lie well above (tests/test_budget_floor.py sweeps
    it)."""
    if decision.eager_peak_bytes is None:
        return k
    counted = {j: peak(j) for j in range(max(0, k - _PEAK_WINDOW), k + 1)}
    if any(p is None for p in counted.values()):
        return k
    lowest = min(counted.values())
    for j in range(k, last + 1):
        p, b = peak(j), saved(j)
        if p is None or b is None:
            break
        if p <= lowest and b <= target:
            if j > k:
                decision.notes.append(
                    f"took {j - k} more of the ranking's entries than the budget needs: with {k} the step peak "
                    f"would be {counted[k] / decision.eager_peak_bytes:.3f}× of eager's, above the "
                    f"{lowest / decision.eager_peak_bytes:.3f}× a looser budget reaches"
                )
            return j
    decision.notes.append(
        f"the step peak is {counted[k] / decision.eager_peak_bytes:.3f}× of eager's, above the "
        f"{lowest / decision.eager_peak_bytes:.3f}× a looser budget reaches: no plan in the ranking meets this "
        "budget without raising it"
    )
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


def _say_peak_floor(decision: Decision, counts: Counts, plan: Plan, k: int, entries: int) -> None:
    """Note that the peak budget is not reachable, and what the lowest peak found consists of."""
    eager = decision.eager_peak_bytes
    note = (
        f"peak budget {decision.peak_budget:.2f}× is not reachable: the lowest step peak the ranking reaches is "
        f"{decision.selected_peak_bytes / eager:.3f}× of eager's ({format_bytes(decision.selected_peak_bytes)}), "
        f"first reached with {k} of its {entries} entries; more recompute does not lower it, so fxfuse stopped there"
    )
    try:
        parts = counts.plan_peak_parts(plan)
    except Exception:  # noqa: BLE001 - the note stands without the breakdown
        decision.notes.append(note)
        return
    decision.notes.append(
        f"{note}. At that peak: parameters' gradients {format_bytes(parts.parameter_grads)}, backward transient "
        f"(activation gradients and recomputed tensors) {format_bytes(parts.backward_transient)}, activations "
        f"the forward still holds {format_bytes(parts.forward_kept)}; the inputs ({format_bytes(parts.inputs)}) "
        "are held besides. Recompute lowers only the activations held; the rest is the floor"
    )


# The nearest cheaper point is a shorter prefix estimated at least this much faster (× eager's step).
CHEAPER_BY = 0.05


def _say_nearest_cheaper(
    decision: Decision, counts: Counts, selections: list[Selection], k: int, saved: Callable[[int], Optional[int]]
) -> None:
    """Note the chosen plan's estimated cost and the longest shorter prefix estimated CHEAPER_BY faster."""
    try:
        step_seconds = counts.eager_step_seconds()
    except Exception:  # noqa: BLE001 - an estimate: left out where eager's step cannot be counted
        return
    if not step_seconds:
        return
    costs = [ranking.estimated_time(s, step_seconds) for s in selections[: k + 1]]
    eager = decision.eager_bytes
    here = f"{decision.selected_bytes / eager:.3f}× costs {costs[k]:.2f}×"
    how = (
        "saved activations and step time × eager's; times are estimates from the ranking's cost model "
        "(time_model.py: recompute FLOPs and bytes moved against eager's step's, "
        f"a region's weighted {ranking.REGION_TIME_COST}×): "
        "measure with `fxfuse bench`"
    )
    cheaper = next((j for j in range(k - 1, -1, -1) if costs[j] <= costs[k] - CHEAPER_BY), None)
    there = saved(cheaper) if cheaper is not None else None
    if there is None:
        decision.notes.append(f"estimated cost: {here} ({how})")
        return
    decision.notes.append(
        f"nearest cheaper point: {here}; {there / eager:.3f}× costs {costs[cheaper]:.2f}× "
        f"(memory_budget={math.ceil(there / eager * 100) / 100:.2f}; {how})"
    )


def _flatten_within_peak(selection: Selection, target: float, counts: Counts, decision: Decision) -> Selection:
    """`selection` with each of its links run flat, largest first region first, while the counted step
    peak stays at most `target` (each try one count on the meta device)."""
    for link in sorted(selection.links, key=lambda e: -e.cost.flops):
        trial = dataclasses.replace(selection, flat_links=selection.flat_links | {(link.cost.first, link.cost.second)})
        try:
            peak = counts.plan_peak(plan_of(trial))
        except Exception:  # noqa: BLE001 - a link stays nested when its flat form cannot be counted
            continue
        if peak <= target:
            selection, decision.selected_peak_bytes = trial, peak
    return selection


def _region_choice(entry: RegionCandidate, limit: str, flat_links: frozenset = frozenset()) -> RegionChoice:
    cost = entry.cost
    if entry.kind == "rebuild":
        what = (
            "the ops that keep a BatchNorm→activation output for backward keep its BN input and statistics "
            "instead (kept anyway); backward rebuilds the output with one pointwise pass per op"
        )
        return RegionChoice(cost.name, "rebuild", 0, cost.freed_bytes, f"{limit}: {entry.describe()}; {what}")
    if entry.kind == "region":
        what = f"{cost.kind} keeps only its inputs; backward runs its forward again (sites inside: pointwise form)"
        return RegionChoice(cost.name, cost.kind, cost.flops, cost.freed_bytes, f"{limit}: {entry.describe()}; {what}")
    if (cost.first, cost.second) in flat_links:
        what = (
            f"chains {cost.first} and {cost.second}, flat: one recompute runs both, holding {cost.first}'s "
            f"recomputed tensors while {cost.second}'s backward runs (within the peak budget), so {cost.first} "
            "does not run a third time"
        )
        return RegionChoice(entry.name, entry.kind, 0, cost.freed_bytes, f"{limit}: {what}")
    what = f"chains {cost.first} and {cost.second}: backward runs {cost.first} again to rebuild {cost.second}'s input"
    return RegionChoice(entry.name, entry.kind, cost.flops, cost.freed_bytes, f"{limit}: {entry.describe()}; {what}")


def _limit(decision: Decision) -> str:
    if decision.policy == "auto":
        return f"auto: ≤ {AUTO_MAX_FLOPS_PER_BYTE:.0f} FLOP/B"
    if decision.policy == "memory":
        return "memory: frees bytes beyond its pointwise form"
    parts = []
    if decision.budget is not None:
        parts.append(f"budget {decision.budget:.2f}×")
    if decision.peak_budget is not None:
        parts.append(f"peak budget {decision.peak_budget:.2f}×")
    return ", ".join(parts)


def choice_of(decision: Decision) -> Choice:
    """What the report says about `decision`, as data (report.render words it)."""
    limit = _limit(decision)
    in_effect = decision.selection.upgrades if decision.selection else decision.chosen
    # An inner region a region around it replaced (ranking.select) is not recomputed on its own.
    recomputed = [e for e in decision.chosen if isinstance(e, RegionCandidate)]
    if decision.selection is not None:
        kept = [*decision.selection.regions, *decision.selection.links]
        rebuild = decision.selection.rebuild  # as counted in the selection (_settle_rebuild), or left out
        recomputed = [rebuild if e.kind == "rebuild" else e for e in recomputed]
        recomputed = [e for e in recomputed if e is not None and (e is rebuild or any(e is k for k in kept))]
    regions = [e.cost for e in recomputed if e.kind == "region"]
    shares_layers = {p.names for c in decision.rejected if isinstance(c, Candidate) for p in c.fallback}
    return Choice(
        decision.policy,
        limit,
        AUTO_MAX_FLOPS_PER_BYTE,
        upgrades={c.site.names: c.describe() for c in in_effect if isinstance(c, Candidate)},
        recomputed_regions=regions,
        pointwise_only=frozenset(shares_layers & set(decision.fallback_names)),
        regions=[_region_choice(e, limit, decision.flat_links) for e in recomputed],
        idle=list(decision.idle),
        rejected=[_rejected(e) for e in decision.rejected],
        budget=decision.budget,
        eager_bytes=decision.eager_bytes,
        selected_bytes=decision.selected_bytes,
        met=decision.met,
        peak_budget=decision.peak_budget,
        eager_peak_bytes=decision.eager_peak_bytes,
        selected_peak_bytes=decision.selected_peak_bytes,
        peak_met=decision.peak_met,
        notes=list(decision.notes),
    )


def _rejected(entry: Entry) -> Rejected:
    if isinstance(entry, Candidate):
        return Rejected(entry.site.names, entry.site.pattern, entry.flops_per_byte, cost=entry.describe())
    return Rejected(
        (entry.name,),
        (entry.kind,),
        entry.flops_per_byte,
        True,
        entry.cost.flops,
        entry.marginal_bytes,
        entry.describe(),
    )
