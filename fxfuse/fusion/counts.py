"""What the budget policy checks its choices with: meta-device counts of a plan applied to the
captured graphs.

Each count runs one forward (and for the peak, a backward) of a meta-device copy of the model
whose roots (roots.py, found once per `optimize` call) run their captures rewritten with the plan
(apply.apply_roots, install.install, on the copy's modules): shapes, no compute, nothing of the
user's touched, and no tracing.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional

import torch
from torch import nn

from .. import measure
from ..measure.traffic import OpCosts
from ..ops import rebuild
from . import install
from . import roots as _roots
from .apply import apply_roots
from .plan import Options, Plan
from .regions import costs as region_costs
from .regions import time_model
from .regions.costs import Profile


def _counted(method):
    """A Counts method made under the call's autocast (measure.counting_under)."""

    @functools.wraps(method)
    def counted(self, *args, **kwargs):
        with measure.counting_under(self.autocast):
            return method(self, *args, **kwargs)

    return counted


class Counts:
    """`autocast`: what the model trains under (None: no autocast); every count is made under it."""

    def __init__(
        self,
        model: nn.Module,
        inputs: tuple,
        roots: list[_roots.Root],
        autocast: Optional[measure.Autocast] = None,
    ) -> None:
        self.model, self.inputs, self.roots, self.autocast = model, inputs, roots, autocast

    @_counted
    def eager_bytes(self) -> int:
        return measure.saved_activation_bytes_meta(self.model, self.inputs)

    @_counted
    def plan_bytes(self, plan: Plan) -> int:
        return measure.saved_activation_bytes_meta(self.model, self.inputs, prepare=self._prepare(plan))

    def rebuild_counts(self, plan: Plan) -> tuple[int, int, int]:
        """`plan` with its BN→activation outputs rebuilt (Plan.rebuild): its saved bytes, and the bytes and
        number of tensors backward rebuilds."""
        with rebuild.Tally() as tally:
            saved = self.plan_bytes(dataclasses.replace(plan, rebuild=True))
        return saved, tally.bytes, tally.count

    @_counted
    def eager_peak(self) -> int:
        return measure.step_peak_bytes_meta(self.model, self.inputs)

    @_counted
    def plan_peak(self, plan: Plan) -> int:
        return measure.step_peak_bytes_meta(self.model, self.inputs, prepare=self._prepare(plan))

    @_counted
    def plan_peak_parts(self, plan: Plan) -> measure.PeakParts:
        return measure.step_peak_parts_meta(self.model, self.inputs, prepare=self._prepare(plan))

    @_counted
    def eager_step_seconds(self) -> float:
        """One eager train step (forward + backward) as the time model prices it: its FLOPs, the bytes its
        ops move and how many run, counted on a meta-device copy."""
        trial = measure.meta_copy(self.model)
        with measure.counted_run(), OpCosts() as traffic:
            measure.train_step(trial, measure.to_meta(self.inputs))
        return time_model.seconds(traffic.flops, traffic.moved, traffic.data_ops)

    @_counted
    def profile(self, sites: frozenset) -> Optional[Profile]:
        """Region costs of the model fused with `sites` (the pointwise ones: what a region runs inside);
        None where no part of the model is captured as one graph.

        Where the model's own forward is not captured, the regions of every captured root inside it
        (the topmost optimized submodules) are costed on the inputs each received in one meta-device
        forward of the whole model, and named by their path in the model: all of them join one ranking,
        so the budget applies to the model as a whole."""
        trial = measure.meta_copy(self.model)
        with measure.counted_run():
            return self._profile(trial, sites)

    def _profile(self, trial: nn.Module, sites: frozenset) -> Optional[Profile]:
        self._prepare(Plan(sites))(trial)
        inputs = measure.to_meta(self.inputs)
        graph = install.fx_graph(trial)
        if graph is not None:
            return region_costs.profile(trial, graph, inputs)
        roots = _topmost_roots(trial)
        if not roots:
            return None
        seen = _inputs_of(trial, inputs, roots)
        parts = []
        for path, root in roots.items():
            if path in seen:
                parts.append((path, region_costs.profile(root, install.fx_graph(root), seen[path])))
        return region_costs.joined(parts)

    def _prepare(self, plan: Plan) -> Callable[[nn.Module], Any]:
        """Optimize a meta-device trial copy with `plan` (its inputs as meta tensors)."""
        options = Options("memory", plan)

        def prepare(trial: nn.Module) -> None:
            tree = _roots.on(self.roots, trial)
            applied = apply_roots(tree, options, installed=True)
            install.install(tree, applied, options, measure.to_meta(self.inputs), both_modes=False)

        return prepare


def _topmost_roots(model: nn.Module) -> dict[str, nn.Module]:
    """The optimized submodules of `model` with a graph, outside one another, in module order."""
    roots: dict[str, nn.Module] = {}
    for path, module in model.named_modules():
        if install.fx_graph(module) is not None and not any(path.startswith(f"{p}.") for p in roots):
            roots[path] = module
    return roots


def _inputs_of(model: nn.Module, inputs: tuple, roots: dict[str, nn.Module]) -> dict[str, tuple]:
    """The positional inputs each root receives first in one forward of `model` (roots called with
    keyword arguments are left out)."""
    seen: dict[str, tuple] = {}

    def record(path):
        def hook(module, args, kwargs):
            if path not in seen and not kwargs:
                seen[path] = tuple(
                    a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args
                )

        return hook

    handles = [root.register_forward_pre_hook(record(path), with_kwargs=True) for path, root in roots.items()]
    try:
        model(*inputs)
    finally:
        for handle in handles:
            handle.remove()
    return seen
