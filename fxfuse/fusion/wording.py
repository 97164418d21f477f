"""The report's words for what the policy chose (fusion/policy.py decides; this says why): bytes and
FLOPs, the limit that decided, a row per recomputed region, link or rebuild, a row per entry of the
ranking not taken, and the policy's notes. report.render and the policy call these; nothing here
decides anything."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from .plan import Choice


def format_bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def format_flops(n: Optional[float]) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} FLOP"


# --------------------------------------------------------------------------- rows of the report


@dataclass
class RegionChoice:
    """A recompute region (or a link chaining two, or the rebuild) that a budget chose (fusion/regions/ranking.py)."""

    name: str
    kind: str  # a region's kind ("block", "run", "chain"), "link" or "rebuild"
    recompute_flops: int
    saved_bytes: int  # activation bytes it frees, as estimated on the meta device
    reason: str


@dataclass(frozen=True)
class Rejected:
    """An entry of the policy's ranking it did not take: an upgrade (a site's names and pattern), or
    a region or link (its name, and its kind as the pattern)."""

    names: tuple[str, ...]
    pattern: tuple[str, ...]
    flops_per_byte: Optional[float]
    region: bool = False
    recompute_flops: Optional[int] = None  # regions and links
    freed_bytes: Optional[int] = None  # regions and links
    cost: str = ""  # its cost in words, as the ranking describes it (FLOP/B, bytes moved, estimated time)


def limit(choice: Choice) -> str:
    """What decided, e.g. "budget 0.30×"."""
    if choice.policy == "auto":
        return f"auto: ≤ {choice.auto_limit:.0f} FLOP/B"
    if choice.policy == "memory":
        return "memory: frees bytes beyond its pointwise form"
    parts = []
    if choice.budget is not None:
        parts.append(f"budget {choice.budget:.2f}×")
    if choice.peak_budget is not None:
        parts.append(f"peak budget {choice.peak_budget:.2f}×")
    return ", ".join(parts)


def region_rows(choice: Choice) -> list[RegionChoice]:
    """A row per region, link and rebuild that runs."""
    said = limit(choice)
    return [_region_row(entry, said, choice.selection.flat_links) for entry in choice.recomputed]


def _region_row(entry, limit: str, flat_links: frozenset) -> RegionChoice:
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


def rejected_rows(choice: Choice) -> list[Rejected]:
    """A row per entry of the ranking not taken."""
    return [_rejected(entry) for entry in choice.rejected]


def _rejected(entry) -> Rejected:
    if entry.kind == "upgrade":
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


# --------------------------------------------------------------------------- the policy's notes


def failed(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"


def no_regions(exc: Optional[Exception]) -> str:
    """Why no recompute regions are ranked: costing them raised `exc`, or (None) no graph holds the model."""
    if exc is None:
        return "no recompute regions: the model is not traced as one graph"
    return f"no recompute regions: costing them on the meta device raised {failed(exc)}"


def no_rebuild(exc: Exception) -> str:
    return f"no rebuilt activations: counting them on the meta device raised {failed(exc)}"


def not_rebuilt(name: str, within_peak: bool) -> str:
    """Why the rebuild entry `name` was left out of the plan that took it."""
    if within_peak:
        why = "the step peak is within the peak budget without it"
    else:
        why = "the regions and layers recomputed in this plan cover what it would rebuild"
    return f"{name}: not rebuilt, {why}"


def uncounted(exc: Exception) -> str:
    return (
        f"could not count the selection's saved activations on the meta device ({failed(exc)}); "
        "chose by the per-site estimates"
    )


def took_more(extra: int, k: int, peak: float, lowest: float) -> str:
    """`extra` more entries than the `k` the budget needs, whose step peak (× eager's) is above the `lowest`
    a looser budget reaches."""
    return (
        f"took {extra} more of the ranking's entries than the budget needs: with {k} the step peak "
        f"would be {peak:.3f}× of eager's, above the {lowest:.3f}× a looser budget reaches"
    )


def peak_raised(peak: float, lowest: float) -> str:
    return (
        f"the step peak is {peak:.3f}× of eager's, above the {lowest:.3f}× a looser budget reaches: "
        "no plan in the ranking meets this budget without raising it"
    )


def peak_floor(choice: Choice, k: int, entries: int, parts) -> str:
    """The peak budget is not reachable, and what the lowest peak found (with `k` of `entries`) consists of
    (`parts`: measure.PeakParts, or None where they could not be counted)."""
    eager = choice.eager_peak_bytes
    note = (
        f"peak budget {choice.peak_budget:.2f}× is not reachable: the lowest step peak the ranking reaches is "
        f"{choice.selected_peak_bytes / eager:.3f}× of eager's ({format_bytes(choice.selected_peak_bytes)}), "
        f"first reached with {k} of its {entries} entries; more recompute does not lower it, so fxfuse stopped there"
    )
    if parts is None:
        return note
    return (
        f"{note}. At that peak: parameters' gradients {format_bytes(parts.parameter_grads)}, backward transient "
        f"(activation gradients and recomputed tensors) {format_bytes(parts.backward_transient)}, activations "
        f"the forward still holds {format_bytes(parts.forward_kept)}; the inputs ({format_bytes(parts.inputs)}) "
        "are held besides. Recompute lowers only the activations held; the rest is the floor"
    )


def saved_beside(choice: Choice) -> str:
    """The saved activations, reported beside a peak budget."""
    return (
        f"saved activations {format_bytes(choice.selected_bytes)} of eager's "
        f"{format_bytes(choice.eager_bytes)} ({choice.selected_bytes / choice.eager_bytes:.3f}×, "
        "counted on the meta device)"
    )


def unreachable(choice: Choice, k: int, entries: int) -> str:
    return (
        f"memory budget {choice.budget:.2f}× is not reachable: the least the ranking keeps is "
        f"{choice.selected_bytes / choice.eager_bytes:.3f}× of eager's saved activations, first reached "
        f"with {k} of its {entries} entries (more recompute does not lower it), so fxfuse stopped there"
    )


def regions_left_out(problems: dict[str, str], shown: int = 3) -> str:
    """The regions the ranking could not offer, and why: the first `shown` of them."""
    named = "; ".join(f"{name} ({why})" for name, why in list(problems.items())[:shown])
    more = f"; and {len(problems) - shown} more" if len(problems) > shown else ""
    return f"regions that cannot be recomputed: {named}{more}"


def estimated_cost(
    choice: Choice,
    cost: float,
    region_time_cost: float,
    cheaper_bytes: Optional[int],
    cheaper_cost: float,
    region_call_ops: int = 0,
) -> str:
    """The chosen plan's estimated step time (`cost` × eager's), and the nearest cheaper point's saved bytes
    and cost where there is one (`cheaper_bytes` None: there is none). `region_call_ops`: what the model
    prices a region's checkpoint call at, in ops."""
    eager = choice.eager_bytes
    here = f"{choice.selected_bytes / eager:.3f}× costs {cost:.2f}×"
    how = (
        "saved activations and step time × eager's; times are estimates from the ranking's cost model "
        "(time_model.py: recompute FLOPs and bytes moved against eager's step's, "
        f"a region's weighted {region_time_cost}×"
        + (f", plus {region_call_ops} ops for its checkpoint call" if region_call_ops else "")
        + "): "
        "measure with `fxfuse bench`"
    )
    if cheaper_bytes is None:
        return f"estimated cost: {here} ({how})"
    return (
        f"nearest cheaper point: {here}; {cheaper_bytes / eager:.3f}× costs {cheaper_cost:.2f}× "
        f"(memory_budget={math.ceil(cheaper_bytes / eager * 100) / 100:.2f}; {how})"
    )
