"""Which sites to rewrite when recomputing costs time: `memory_budget=` and mode="auto".

A site where fxfuse recomputes a convolution or a linear layer in backward (an
*upgrade*) saves bytes and costs FLOPs. Pointwise sites (BN→activation, and the
"fast" form of Conv→BN→activation) recompute only pointwise work, which the fused
kernels do faster than eager does the original, so they are always taken. An upgrade
replaces the pointwise site on the same modules, so it is worth its *marginal* bytes:
what it saves beyond that pointwise site.

Upgrades are ranked by recompute FLOPs per marginal byte, cheapest first, and every
selection is a prefix of that one ranking, so a tighter budget never saves less:

* `memory_budget=b`: the shortest prefix whose saved activations are at most b × eager's.
  Both sides are counted the way `fxfuse.measure` counts them (unique storages saved
  for backward), on a meta-device copy of the model: shapes, no compute, nothing of the
  user's touched. The per-site estimates pick the prefix; the meta count checks it.
* mode="auto": the upgrades that cost at most AUTO_MAX_FLOPS_PER_BYTE, e.g. depthwise
  convs and 1×1 convs with few input channels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

from torch import nn

from ..errors import ConfigurationError
from .report import FusedSite, FusionReport, SkippedSite, format_bytes
from .tracing import first_line

RECOMPUTE_OPS = frozenset({"fxfuse::conv_bn_act", "fxfuse::linear_act", "fxfuse::conv_act"})

# mode="auto" takes an upgrade when one backward recompute costs at most this many FLOPs
# per byte it frees. 64 FLOP/B in float32 is a 1×1 conv with 128 input channels per group,
# or any depthwise conv; a 3×3 conv with 64 input channels costs 288.
AUTO_MAX_FLOPS_PER_BYTE = 64.0


@dataclass
class Candidate:
    site: FusedSite  # the site as mode="memory" fuses it (recomputing the conv/linear)
    fallback: list[FusedSite]  # the pointwise sites it replaces
    marginal_bytes: Optional[int]
    flops_per_byte: Optional[float]

    def describe(self) -> str:
        if self.flops_per_byte is None:
            return "recompute cost unknown"
        return f"{self.flops_per_byte:.0f} FLOP/B"


@dataclass
class Decision:
    """The policy's choice, and what it measured on the way."""

    allowed: frozenset  # site names the passes may rewrite
    policy: str  # "auto" or "budget"
    chosen: list[Candidate]
    rejected: list[Candidate]
    fallback_names: set = field(default_factory=set)  # pointwise sites kept in place of a rejected upgrade
    budget: Optional[float] = None
    eager_bytes: Optional[int] = None
    selected_bytes: Optional[int] = None  # saved for backward with this selection (meta-device count)
    notes: list[str] = field(default_factory=list)

    @property
    def met(self) -> Optional[bool]:
        if self.budget is None or self.eager_bytes is None or self.selected_bytes is None:
            return None
        return self.selected_bytes <= self.budget * self.eager_bytes


def _intrinsic_flops_per_byte(model: nn.Module, site: FusedSite) -> Optional[float]:
    """Recompute FLOPs per byte of the recomputed output, from the layer's weight alone (no shapes needed)."""
    try:
        layer = model.get_submodule(site.modules[0])
    except (AttributeError, ValueError):
        return None  # functional call ("scope:function")
    weight = getattr(layer, "weight", None)
    if weight is None or weight.dim() not in (2, 4):
        return None
    per_output = math.prod(weight.shape[1:])  # in_features, or in_channels/groups × kh × kw
    return 2.0 * per_output / weight.element_size()


def candidates(model: nn.Module, memory: FusionReport, fast: FusionReport) -> tuple[list[Candidate], list[FusedSite]]:
    """Upgrades ranked cheapest first, and the pointwise sites (taken in any case)."""
    pointwise = list(fast.fused)
    upgrades = []
    for site in memory.fused:
        if site.op not in RECOMPUTE_OPS:
            continue
        fallback = [p for p in pointwise if set(p.modules) & set(site.modules)]
        marginal = None
        if site.saved_bytes is not None and all(p.saved_bytes is not None for p in fallback):
            marginal = site.saved_bytes - sum(p.saved_bytes for p in fallback)
        ratio = None
        if site.recompute_flops is not None and marginal:
            ratio = site.recompute_flops / marginal
        if ratio is None:
            ratio = _intrinsic_flops_per_byte(model, site)
        upgrades.append(Candidate(site, fallback, marginal, ratio))
    upgrades.sort(key=lambda c: (c.flops_per_byte is None, c.flops_per_byte or 0.0, -(c.marginal_bytes or 0)))
    return upgrades, pointwise


def allowed_names(chosen: list[Candidate], pointwise: list[FusedSite]) -> tuple[frozenset, set]:
    taken = {name for c in chosen for name in c.site.modules}
    fallback = {p.modules for p in pointwise if not set(p.modules) & taken}
    return frozenset({c.site.modules for c in chosen} | fallback), fallback


def choose_auto(model: nn.Module, memory: FusionReport, fast: FusionReport) -> Decision:
    upgrades, pointwise = candidates(model, memory, fast)
    chosen = [c for c in upgrades if c.flops_per_byte is not None and c.flops_per_byte <= AUTO_MAX_FLOPS_PER_BYTE]
    rejected = [c for c in upgrades if c not in chosen]
    allowed, fallback = allowed_names(chosen, pointwise)
    return Decision(allowed, "auto", chosen, rejected, fallback)


def choose_budget(
    model: nn.Module,
    memory: FusionReport,
    fast: FusionReport,
    budget: float,
    eager_bytes: Callable[[], int],
    selection_bytes: Callable[[frozenset], int],
) -> Decision:
    """The cheapest prefix of the ranking that meets `budget` (else all upgrades, and say so)."""
    upgrades, pointwise = candidates(model, memory, fast)
    decision = Decision(frozenset(), "budget", [], list(upgrades), budget=budget)
    try:
        decision.eager_bytes = eager_bytes()
    except Exception as exc:  # noqa: BLE001 - arbitrary models on the meta device; re-raised as one line
        raise ConfigurationError(
            f"memory_budget={budget} cannot be applied to {type(model).__name__}: counting eager's saved "
            f"activations needs a forward on the meta device, which raises {type(exc).__name__}: "
            f"{first_line(exc)} (optimize without memory_budget, or with mode='auto')"
        ) from exc

    target = budget * decision.eager_bytes
    known = [c.marginal_bytes or 0 for c in upgrades]
    pointwise_saved = sum(p.saved_bytes or 0 for p in pointwise)

    def shortest_prefix(start: int, needed: float) -> int:
        k, gained = start, 0.0
        while k < len(upgrades) and gained < needed:
            gained += known[k]
            k += 1
        return k

    # Start from the measured pointwise-only selection: per-site estimates of pointwise sites
    # miss what in-place activations save, and overshooting here would recompute for nothing.
    try:
        baseline = selection_bytes(allowed_names([], pointwise)[0])
    except Exception:  # noqa: BLE001 - measured again below, where failures are reported
        baseline = decision.eager_bytes - pointwise_saved
    k = shortest_prefix(0, baseline - target)
    while True:
        allowed, fallback = allowed_names(upgrades[:k], pointwise)
        try:
            measured = selection_bytes(allowed)
        except Exception as exc:  # noqa: BLE001
            decision.notes.append(
                f"could not count the selection's saved activations on the meta device "
                f"({type(exc).__name__}: {exc}); chose by the per-site estimates"
            )
            measured = None
        decision.allowed, decision.fallback_names = allowed, fallback
        decision.chosen, decision.rejected = upgrades[:k], upgrades[k:]
        decision.selected_bytes = measured
        if measured is None or measured <= target or k == len(upgrades):
            break
        # The per-site estimates were optimistic (e.g. shared storages): take more, cheapest first.
        k = max(k + 1, shortest_prefix(k, measured - target))
    if decision.met is False:
        decision.notes.append(
            f"memory budget {budget:.2f}× is not reachable: fusing every site keeps "
            f"{decision.selected_bytes / decision.eager_bytes:.3f}× of eager's saved activations; fused all it can"
        )
    return decision


def annotate(report: FusionReport, decision: Decision) -> None:
    """Say in the report what the policy chose and why."""
    by_name = {c.site.modules: c for c in decision.chosen}
    limit = (
        f"budget {decision.budget:.2f}×"
        if decision.policy == "budget"
        else f"auto: ≤ {AUTO_MAX_FLOPS_PER_BYTE:.0f} FLOP/B"
    )
    for site in report.fused:
        site.mode = report.mode
        why = None
        if site.modules in by_name:
            why = f"{limit}: {by_name[site.modules].describe()}"
        elif site.modules in decision.fallback_names and any(
            set(site.modules) & set(c.site.modules) for c in decision.rejected
        ):
            why = f"{limit}: pointwise recompute only"
        if why:
            site.reason = f"{why}; {site.reason}" if site.reason else why
    for c in decision.rejected:
        if decision.policy == "budget":
            why = "the budget is met without it"
        else:
            why = f"above the auto limit of {AUTO_MAX_FLOPS_PER_BYTE:.0f} FLOP/B"
        report.skipped.append(
            SkippedSite(c.site.modules, c.site.pattern, f"recompute not chosen: {c.describe()}, {why}")
        )
    report.budget = decision.budget
    report.eager_saved_bytes = decision.eager_bytes
    report.selected_saved_bytes = decision.selected_bytes
    report.budget_met = decision.met
    report.notes.extend(decision.notes)
    if decision.met is not None:
        report.notes.append(
            f"memory budget {decision.budget:.2f}× {'met' if decision.met else 'NOT met'}: saved activations "
            f"{format_bytes(decision.selected_bytes)} of eager's {format_bytes(decision.eager_bytes)} "
            f"({decision.selected_bytes / decision.eager_bytes:.3f}×, counted on the meta device)"
        )
