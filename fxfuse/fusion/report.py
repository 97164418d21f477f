"""FusionReport: what fxfuse fused, what it skipped and why, rendered from the sites the passes
found and the policy's Plan (`render`), and printed with tabulate. Nothing reads a report back."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

from tabulate import tabulate

from .plan import Choice, Findings, Plan, SiteData, Skip, site_in_region
from .wording import RegionChoice, format_bytes, format_flops, limit, region_rows, rejected_rows

__all__ = ["FusedSite", "FusionReport", "RegionChoice", "SkippedSite", "format_bytes", "format_flops", "render"]


@dataclass
class FusedSite:
    modules: tuple[str, ...]  # module paths (or scope:function for functional calls), in forward order
    pattern: str  # e.g. "conv2d→batch_norm2d→relu"
    activation: str
    op: str  # the fxfuse op it runs
    saved_bytes: Optional[int] = None  # activation bytes eager keeps for backward that this site does not
    recompute_flops: Optional[int] = None  # extra work in backward
    reason: str = ""  # why the policy chose it: what is kept and what is recomputed (or why it is faster)
    mode: str = ""  # the mode that chose this site: "memory", "fast" or "auto"
    # fxfuse::bn_act_conv: the conv whose input this site's output is (passes/bn_act_conv.py); a cat: the
    # fused op it is the input of (passes/cat_input.py); an
    # act_linear site: the layer-scale parameter its call was merged with (passes/layer_scale.py)
    merged_into: str = ""
    recompute_bytes: Optional[int] = None  # bytes a rebuild moves in backward (a copy, no FLOPs: passes/cat_input.py)
    recomputes: bool = False  # recomputes a conv or linear layer in backward

    @property
    def name(self) -> str:
        return " + ".join(self.modules)


@dataclass
class SkippedSite:
    modules: tuple[str, ...]
    pattern: str
    reason: str

    @property
    def name(self) -> str:
        return " + ".join(self.modules)


@dataclass
class FusionReport:
    mode: str
    fused: list[FusedSite] = field(default_factory=list)
    skipped: list[SkippedSite] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # Set when a memory budget chose the sites (fxfuse.policy); bytes as counted on the meta device.
    budget: Optional[float] = None
    eager_saved_bytes: Optional[int] = None
    selected_saved_bytes: Optional[int] = None
    budget_met: Optional[bool] = None
    # Set when a budget chose; the step peak (forward + backward) as counted on the meta device.
    peak_budget: Optional[float] = None
    eager_peak_bytes: Optional[int] = None
    selected_peak_bytes: Optional[int] = None
    peak_budget_met: Optional[bool] = None
    regions: list[RegionChoice] = field(default_factory=list)  # recompute regions and links chosen
    layout: str = ""  # the memory format the optimized model runs in, and why (fusion.layout)

    @property
    def saved_bytes(self) -> Optional[int]:
        values = [s.saved_bytes for s in self.fused]
        return None if not values or any(v is None for v in values) else sum(values)

    def to_dict(self) -> dict:
        return {
            "mode": self.mode,
            "fused": [asdict(s) for s in self.fused],
            "skipped": [asdict(s) for s in self.skipped],
            "notes": list(self.notes),
            "saved_bytes": self.saved_bytes,
            "budget": self.budget,
            "eager_saved_bytes": self.eager_saved_bytes,
            "selected_saved_bytes": self.selected_saved_bytes,
            "budget_met": self.budget_met,
            "peak_budget": self.peak_budget,
            "eager_peak_bytes": self.eager_peak_bytes,
            "selected_peak_bytes": self.selected_peak_bytes,
            "peak_budget_met": self.peak_budget_met,
            "regions": [asdict(r) for r in self.regions],
            "layout": self.layout,
        }

    def __str__(self) -> str:
        lines = [f"fxfuse fusion report (mode={self.mode}): {len(self.fused)} fused, {len(self.skipped)} skipped"]
        if self.fused:
            rows = [
                (
                    s.name,
                    s.pattern,
                    s.op,
                    s.mode,
                    format_bytes(s.saved_bytes),
                    format_flops(s.recompute_flops),
                    s.reason,
                )
                for s in self.fused
            ]
            lines.append(tabulate(rows, headers=["fused", "pattern", "op", "mode", "saves", "recompute", "why"]))
            if self.saved_bytes is not None:
                lines.append(f"total activation memory saved: {format_bytes(self.saved_bytes)}")
        if self.regions:
            rows = [
                (r.name, r.kind, format_bytes(r.saved_bytes), format_flops(r.recompute_flops), r.reason)
                for r in self.regions
            ]
            lines.append(tabulate(rows, headers=["recomputed region", "kind", "saves", "recompute", "why"]))
        if self.skipped:
            rows = [(s.name, s.pattern, s.reason) for s in self.skipped]
            lines.append(tabulate(rows, headers=["skipped", "pattern", "reason"]))
        lines.extend(f"note: {note}" for note in self.notes)
        if self.layout:
            lines.append(f"layout: {self.layout}")
        return "\n".join(lines)

    __repr__ = __str__


def pattern_text(pattern: tuple[str, ...]) -> str:
    return "→".join(pattern)


def skipped_site(skip: Skip) -> SkippedSite:
    return SkippedSite(skip.names, pattern_text(skip.pattern), skip.reason)


def render(
    mode: str, found: Findings, plan: Plan = Plan(), layout: str = "", notes: tuple[str, ...] = ()
) -> FusionReport:
    """The user's report: the sites `found` (the final walk's), and, where a policy chose the plan,
    what it chose and why; then `notes`."""
    choice = plan.choice
    report = FusionReport(mode, notes=list(found.notes), layout=layout)
    report.fused = [_fused(site, mode, choice) for site in found.sites]
    report.skipped = [skipped_site(s) for s in found.skipped]
    if choice is not None:
        _say_choice(report, choice)
    report.notes.extend(notes)
    return report


def _fused(site: SiteData, mode: str, choice: Optional[Choice]) -> FusedSite:
    fused = FusedSite(
        site.names,
        pattern_text(site.pattern),
        site.activation,
        site.op,
        site.saved_bytes,
        site.recompute_flops,
        site.reason,
        site.mode,
        site.merged_into,
        site.recompute_bytes,
        site.recomputes,
    )
    if choice is None:
        return fused
    fused.mode = mode
    said = limit(choice)
    why = None
    region = next((r for r in choice.recomputed_regions if site_in_region(site.names, r)), None)
    if site.names in choice.upgrades:
        why = f"{said}: {choice.upgrades[site.names]}"
    elif region is not None:
        why = (
            f"{said}: inside recomputed region {region.name}, pointwise form "
            "(its conv is recomputed once, by the region)"
        )
    elif site.names in choice.pointwise_only:
        why = f"{said}: pointwise recompute only"
    if why:
        fused.reason = f"{why}; {fused.reason}" if fused.reason else why
    return fused


def _per_byte(flops_per_byte: Optional[float]) -> str:
    return "recompute cost unknown" if flops_per_byte is None else f"{flops_per_byte:.0f} FLOP/B"


def _say_choice(report: FusionReport, choice: Choice) -> None:
    report.regions.extend(region_rows(choice))
    for site in choice.idle:
        report.skipped.append(
            SkippedSite(
                site.names,
                pattern_text(site.pattern),
                "layer not recomputed: it would free nothing beyond its pointwise form (a BN→activation output "
                "the next conv rebuilds anyway: recomputing the conv keeps its input instead, of the same size)",
            )
        )
    if choice.policy == "budget":
        why = "the budget is met without it"
    else:
        why = f"above the auto limit of {choice.auto_limit:.0f} FLOP/B"
    for c in rejected_rows(choice):
        cost = c.cost or _per_byte(c.flops_per_byte)
        if not c.region:
            reason = f"recompute not chosen: {cost}, {why}"
        elif c.pattern[0] == "rebuild":
            reason = f"not rebuilt in backward: {cost} (frees {format_bytes(c.freed_bytes)}), {why}"
        else:
            kind = c.pattern[0]
            reason = (
                f"{kind} not recomputed: {cost} ({format_flops(c.recompute_flops)} for "
                f"{format_bytes(c.freed_bytes)}), {why}"
            )
        report.skipped.append(SkippedSite(c.names, pattern_text(c.pattern), reason))
    report.budget = choice.budget
    report.eager_saved_bytes = choice.eager_bytes
    report.selected_saved_bytes = choice.selected_bytes
    report.budget_met = choice.met
    report.peak_budget = choice.peak_budget
    report.eager_peak_bytes = choice.eager_peak_bytes
    report.selected_peak_bytes = choice.selected_peak_bytes
    report.peak_budget_met = choice.peak_met
    report.notes.extend(choice.notes)
    if choice.met is not None:
        report.notes.append(
            f"memory budget {choice.budget:.2f}× {'met' if choice.met else 'NOT met'}: saved activations "
            f"{format_bytes(choice.selected_bytes)} of eager's {format_bytes(choice.eager_bytes)} "
            f"({choice.selected_bytes / choice.eager_bytes:.3f}×, counted on the meta device)"
        )
    if choice.eager_peak_bytes and choice.selected_peak_bytes is not None:
        verdict = ""
        if choice.peak_met is not None:
            verdict = f"peak budget {choice.peak_budget:.2f}× {'met' if choice.peak_met else 'NOT met'}: "
        report.notes.append(
            f"{verdict}step peak {format_bytes(choice.selected_peak_bytes)} of eager's "
            f"{format_bytes(choice.eager_peak_bytes)} "
            f"({choice.selected_peak_bytes / choice.eager_peak_bytes:.3f}×, counted on the meta device)"
        )
