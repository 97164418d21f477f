"""FusionReport: what fxfuse fused, what it skipped and why, rendered with tabulate."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

from tabulate import tabulate


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


_LAYER_PARTS = ("conv2d", "batch_norm2d", "linear", "layer_norm")  # pattern parts that name a layer, not an activation


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

    @property
    def name(self) -> str:
        return " + ".join(self.modules)

    @property
    def layers(self) -> frozenset:
        """Its conv, BN and linear module names: what two sites on the same nodes share. Not its
        activation's, since one activation module may serve several sites (LeNet's one nn.GELU)."""
        parts = self.pattern.split("→")
        if len(parts) != len(self.modules):
            return frozenset(self.modules)
        return frozenset(m for m, part in zip(self.modules, parts) if part in _LAYER_PARTS)


@dataclass
class SkippedSite:
    modules: tuple[str, ...]
    pattern: str
    reason: str

    @property
    def name(self) -> str:
        return " + ".join(self.modules)


@dataclass
class RegionChoice:
    """A recompute region (or a link chaining two) that a budget chose (fusion/regions/ranking.py)."""

    name: str
    kind: str  # "region" or "link"
    recompute_flops: int
    saved_bytes: int  # activation bytes it frees, as estimated on the meta device
    reason: str


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
