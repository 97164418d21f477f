"""FusionReport: what fxfuse fused, what it skipped and why, rendered from the sites the passes
found and the policy's Plan (`render`). `str(report)` fits 100 columns: a summary, then one row
per site with a short reason; `report.explain(name)` gives a site's full reason. Nothing reads a
report back."""

from __future__ import annotations

import re
import textwrap
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import torch
from tabulate import tabulate

from .plan import Choice, Findings, Plan, SiteData, Skip, site_in_region
from .wording import RegionChoice, format_bytes, format_flops, limit, region_rows, rejected_rows

__all__ = [
    "CoveredSite",
    "FusedSite",
    "FusionReport",
    "RegionChoice",
    "SkippedSite",
    "format_bytes",
    "format_flops",
    "render",
]

WIDTH = 100  # the columns str(report) fits in
NAME_WIDTH = 34  # a site's column: longer names are shortened (report.explain takes the full one)


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
    # What the site does under torch.autocast where that differs from float32 (each call decides, at run
    # time: fxfuse/ops); empty where it serves autocast with eager's casts and saves what it saves in float32.
    under_autocast: str = ""
    short: str = ""  # the reason in a few words, for the table (the full one: report.explain)

    @property
    def name(self) -> str:
        return " + ".join(self.modules)


@dataclass
class SkippedSite:
    modules: tuple[str, ...]
    pattern: str
    reason: str
    # "skipped": the pattern could not be fused exactly; "not chosen": a recompute that a policy (budget,
    # auto) ranked and left out, the site running in its cheaper form
    kind: str = "skipped"
    short: str = ""  # the reason in a few words, for the table (the full one: report.explain)

    @property
    def name(self) -> str:
        return " + ".join(self.modules)


@dataclass
class CoveredSite:
    """A site that is not fused as found because another fused site runs its part: e.g. a Conv→BN→act
    whose BN→act merges into the next conv (bn_act_conv) while its conv stays ATen's."""

    modules: tuple[str, ...]
    pattern: str
    by: str  # the name of the fused site that covers it
    op: str  # that site's op
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
    precision: str = ""  # the dtypes (autocast or not) the counts and estimates were made in
    time_model: Optional[Any] = None  # the rates a budget's ranking priced recomputes with (regions/time_model.Rates)
    covered: list[CoveredSite] = field(default_factory=list)  # sites another fused site runs the part of

    @property
    def saved_bytes(self) -> Optional[int]:
        values = [s.saved_bytes for s in self.fused]
        return None if not values or any(v is None for v in values) else sum(values)

    def to_dict(self) -> dict:
        return {
            "mode": self.mode,
            "fused": [asdict(s) for s in self.fused],
            "skipped": [asdict(s) for s in self.skipped],
            "covered": [asdict(s) for s in self.covered],
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
            "precision": self.precision,
            "time_model": None if self.time_model is None else self.time_model.to_dict(),
        }

    def explain(self, name: str) -> str:
        """The full entry of every site, region or link called `name` (as in the report's tables,
        shortened or not) or holding the module `name`: what it is, its op, bytes, FLOPs and reason."""
        entries = [text for modules, full, text in self._entries() if _is(name, modules, full)]
        if not entries:
            raise KeyError(f"no site, region or link {name!r} in this report")
        return "\n".join(entries)

    def details(self) -> str:
        """Every entry in full (`fxfuse optimize --verbose`)."""
        return "\n".join(text for _, _, text in self._entries())

    def _entries(self):
        """(modules, name, full text wrapped at WIDTH) of each fused, covered, region and skipped entry."""
        for s in self.fused:
            merged = f", merged into {s.merged_into}" if s.merged_into else ""
            text = (
                f"fused {s.name} ({s.pattern}) as {s.op}{merged}, mode {s.mode or self.mode}: saves "
                f"{format_bytes(s.saved_bytes)}, recomputes {_recompute(s)} in backward. {s.reason}"
            )
            yield s.modules, s.name, _wrap(text.strip())
        for r in self.regions:
            text = (
                f"recomputed {r.kind} {r.name}: saves {format_bytes(r.saved_bytes)}, recomputes "
                f"{format_flops(r.recompute_flops)} in backward. {r.reason}"
            )
            yield (r.name,), r.name, _wrap(text)
        for c in self.covered:
            yield c.modules, c.name, _wrap(f"covered {c.name} ({c.pattern}): runs in {c.by} ({c.op}). {c.reason}")
        for s in self.skipped:
            yield s.modules, s.name, _wrap(f"{s.kind} {s.name} ({s.pattern}): {s.reason}")

    def summary(self) -> str:
        """The report's opening lines: counts, bytes, recompute, budget, layout."""
        not_chosen = [s for s in self.skipped if s.kind == "not chosen"]
        skipped = [s for s in self.skipped if s.kind != "not chosen"]
        head = f"fxfuse report (mode={self.mode}): {len(self.fused)} sites fused"
        if self.covered:
            head += f", {len(self.covered)} covered"
        if not_chosen:
            head += f", {len(not_chosen)} recomputes not chosen"
        lines = [f"{head}, {len(skipped)} skipped"]
        if self.fused:
            ops = Counter(_short_op(s.op) for s in self.fused)
            lines.append("fused per op: " + ", ".join(f"{op} {n}" for op, n in ops.most_common()))
        if self.saved_bytes is not None:
            line = f"saved for backward: {format_bytes(self.saved_bytes)} less than eager"
            if self.eager_saved_bytes and self.selected_saved_bytes is not None:
                kept, eager = self.selected_saved_bytes, self.eager_saved_bytes
                line += f" (keeps {format_bytes(kept)} of eager's {format_bytes(eager)}: {kept / eager:.3f}×)"
            lines.append(line)
        lines.append(f"recompute in backward: {self._recompute_total()}")
        if self.budget_met is not None:
            lines.append(f"memory budget {self.budget:.2f}× {'met' if self.budget_met else 'NOT met'}")
        if self.peak_budget_met is not None:
            lines.append(f"peak budget {self.peak_budget:.2f}× {'met' if self.peak_budget_met else 'NOT met'}")
        if self.layout:
            lines.append(f"layout: {self.layout}")
        if self.precision:
            lines.append(f"precision: {self.precision}")
        if self.time_model is not None:
            lines.append(f"time model: {self.time_model.describe()}")
        if self.covered:
            ops = Counter(c.op for c in self.covered)
            by = ", ".join(f"{n} in {_short_op(op)}" for op, n in ops.most_common())
            lines.append(f"covered, not skipped: {len(self.covered)} sites run in another fused site ({by})")
        return "\n".join(_wrap(line) for line in lines)

    def _recompute_total(self) -> str:
        flops = [s.recompute_flops for s in self.fused] + [r.recompute_flops for r in self.regions]
        text = "unknown" if any(f is None for f in flops) else format_flops(sum(flops))
        moved = sum(_copies(s) for s in self.fused)
        return text + (f", {format_bytes(moved)} copied by rebuilds" if moved else "")

    def __str__(self) -> str:
        lines = [self.summary()]
        if self.fused:
            rows = [
                (
                    _short_name(s.modules),
                    _short_op(s.op),
                    format_bytes(s.saved_bytes),
                    _recompute(s),
                    s.short or s.reason,
                )
                for s in self.fused
            ]
            lines += ["", _table(rows, ["fused", "op", "saves", "recompute", "why"])]
        if self.regions:
            rows = [
                (r.name, r.kind, format_bytes(r.saved_bytes), format_flops(r.recompute_flops), r.reason)
                for r in self.regions
            ]
            lines += ["", _table(rows, ["recomputed region", "kind", "saves", "recompute", "why"])]
        for kind in ("not chosen", "skipped"):
            rows = [(_short_name(s.modules), s.pattern, s.short or s.reason) for s in self.skipped if s.kind == kind]
            if rows:
                lines += ["", _table(rows, [kind, "pattern", "reason"])]
        if self.notes:
            lines.append("")
            lines.extend(_wrap(f"note: {note}") for note in self.notes)
        lines.append("full reasons: report.explain(name), or fxfuse optimize --verbose")
        return "\n".join(lines)

    __repr__ = __str__


def _is(name: str, modules: tuple[str, ...], full: str) -> bool:
    return name in (full, _short_name(modules)) or name in modules


def _short_op(op: str) -> str:
    return op.removeprefix("fxfuse::")


def _copies(site: FusedSite) -> int:
    """The bytes a rebuild without FLOPs (a concatenation's copy) moves in backward."""
    return 0 if site.recompute_flops else site.recompute_bytes or 0


def _recompute(site: FusedSite) -> str:
    return f"{format_bytes(_copies(site))} copy" if _copies(site) else format_flops(site.recompute_flops)


def _short_name(modules: tuple[str, ...]) -> str:
    """`layer1.0.conv1 + layer1.0.bn1` as `layer1.0.{conv1,bn1}`, cut in the middle past NAME_WIDTH."""
    name = " + ".join(modules)
    if len(modules) > 1:
        prefix = modules[0].rsplit(".", 1)[0] + "." if "." in modules[0] else ""
        if prefix and all(m.startswith(prefix) and "." not in m[len(prefix) :] for m in modules):
            name = prefix + "{" + ",".join(m[len(prefix) :] for m in modules) + "}"
    if len(name) > NAME_WIDTH:
        half = (NAME_WIDTH - 1) // 2
        name = name[:half] + "…" + name[len(name) - (NAME_WIDTH - 1 - half) :]
    return name


def _shorten(text: str, width: int) -> str:
    """`text` cut at a word boundary to fit `width`, with an ellipsis where cut."""
    text = " ".join(text.split())
    if len(text) <= width:
        return text
    cut = text[: width - 1]
    if " " in cut[width // 2 :]:
        cut = cut[: cut.rindex(" ")]
    return cut.rstrip(" ,;:(") + "…"


def _table(rows: list[tuple], headers: list[str]) -> str:
    """A plain table whose last column (the reason) is shortened so that every line fits WIDTH."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers) - 1)]
    last = max(WIDTH - sum(widths) - 2 * len(widths), 16)
    rows = [(*r[:-1], _shorten(str(r[-1]).split("; ")[0], last)) for r in rows]
    return tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True)


def _wrap(line: str) -> str:
    return textwrap.fill(line, WIDTH, subsequent_indent="  ", break_on_hyphens=False)


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
    for skip in found.skipped:
        _skip_or_cover(report, skipped_site(skip))
    if choice is not None:
        _say_choice(report, choice)
    report.notes.extend(notes)
    if any(torch.is_autocast_enabled(device) for device in ("cpu", "cuda")):
        note = autocast_note(report.fused)
        if note:
            report.notes.append(note)
    return report


# The ops whose calls may not run fused under torch.autocast, and when (the other ops serve every
# autocast call on CPU and CUDA that eager accepts: csrc/autocast/layer_autocast.cpp).
_UNDER_AUTOCAST = {
    "bn_act_conv": (
        "runs as batch_norm_act, then the conv, where its input is not in the autocast dtype (the conv "
        "would read a cast copy of the activation output, which the op does not make)"
    ),
}
_CAT_UNDER_AUTOCAST = "keeps its input (or the cast copy autocast makes), not the concatenation's pieces"


def under_autocast(op: str) -> str:
    """What a site running fxfuse::`op` does under torch.autocast where that differs from float32."""
    name = op.removeprefix("fxfuse::")
    if name.startswith("cat_"):
        return _CAT_UNDER_AUTOCAST
    return _UNDER_AUTOCAST.get(name, "")


def autocast_note(fused: list[FusedSite]) -> Optional[str]:
    """The note for a report made under torch.autocast: the sites that may not save there what they
    save in float32, and why."""
    differ = [s for s in fused if s.under_autocast]
    if not differ:
        return None
    names = ", ".join(s.name for s in differ[:3]) + (", ..." if len(differ) > 3 else "")
    reasons = "; ".join(sorted({f"{s.op}: {s.under_autocast}" for s in differ}))
    return (
        f"under torch.autocast, {len(differ)} fused site(s) may not save what they save in float32 ({names}): {reasons}"
    )


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
        under_autocast(site.op),
    )
    fused.short = site.reason.split("; ")[0]
    if choice is None:
        return fused
    fused.mode = mode
    said = limit(choice)
    why = None
    region = next((r for r in choice.recomputed_regions if site_in_region(site.names, r)), None)
    if site.names in choice.upgrades:
        why = f"{said}: {choice.upgrades[site.names]}"
        per_byte = re.search(r"[\d.]+ FLOP/B", choice.upgrades[site.names])
        if per_byte:
            fused.short = f"{fused.short}, {per_byte.group()}" if fused.short else per_byte.group()
    elif region is not None:
        why = (
            f"{said}: inside recomputed region {region.name}, pointwise form "
            "(its conv is recomputed once, by the region)"
        )
        fused.short = f"pointwise, in recomputed region {region.name}"
    elif site.names in choice.pointwise_only:
        why = f"{said}: pointwise recompute only"
        fused.short = f"pointwise only: {fused.short}" if fused.short else "pointwise recompute only"
    if why:
        fused.reason = f"{why}; {fused.reason}" if fused.reason else why
    return fused


def _skip_or_cover(report: FusionReport, skipped: SkippedSite) -> None:
    """A site whose every layer but its first (a conv or linear, then ATen's) runs inside one fused site
    is covered by it, not skipped: e.g. a Conv→BN→act whose BN→act merges into the next conv."""
    rest = set(skipped.modules[1:] or skipped.modules)
    by = next((f for f in report.fused if rest <= set(f.modules)), None)
    if by is None:
        report.skipped.append(skipped)
    else:
        report.covered.append(CoveredSite(skipped.modules, skipped.pattern, by.name, by.op, skipped.reason))


def _per_byte(flops_per_byte: Optional[float]) -> str:
    return "recompute cost unknown" if flops_per_byte is None else f"{flops_per_byte:.0f} FLOP/B"


def _say_choice(report: FusionReport, choice: Choice) -> None:
    report.regions.extend(region_rows(choice))
    for site in choice.idle:
        _skip_or_cover(
            report,
            SkippedSite(
                site.names,
                pattern_text(site.pattern),
                "layer not recomputed: it would free nothing beyond its pointwise form (a BN→activation output "
                "the next conv rebuilds anyway: recomputing the conv keeps its input instead, of the same size)",
            ),
        )
    if choice.policy == "budget":
        why, why_short = "the budget is met without it", "budget met without it"
    else:
        why = f"above the auto limit of {choice.auto_limit:.0f} FLOP/B"
        why_short = f"above auto's {choice.auto_limit:.0f} FLOP/B"
    for c in rejected_rows(choice):
        cost = c.cost or _per_byte(c.flops_per_byte)
        frees = f" for {format_bytes(c.freed_bytes)}" if c.freed_bytes is not None else ""
        short = f"{_per_byte(c.flops_per_byte)}{frees}; {why_short}"
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
        report.skipped.append(SkippedSite(c.names, pattern_text(c.pattern), reason, "not chosen", short))
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
