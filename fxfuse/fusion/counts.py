"""What the budget policy checks its choices with: meta-device counts of a plan applied to the
captured graphs.

Each count runs one forward (and for the peak, a backward) of a meta-device copy of the model
whose traceable roots run the captured graphs rewritten with the plan (install.walk with the
call's `Captures`): shapes, no compute, nothing of the user's touched, and no tracing.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from torch import nn

from .. import measure
from . import install, region_costs
from .capture import Captures
from .plan import Options, Plan
from .region_costs import Profile
from .report import FusionReport


class Counts:
    def __init__(self, model: nn.Module, inputs: tuple, captures: Captures) -> None:
        self.model, self.inputs, self.captures = model, inputs, captures

    def eager_bytes(self) -> int:
        return measure.saved_activation_bytes_meta(self.model, self.inputs)

    def plan_bytes(self, plan: Plan) -> int:
        return measure.saved_activation_bytes_meta(self.model, self.inputs, prepare=self._prepare(plan))

    def eager_peak(self) -> int:
        return measure.step_peak_bytes_meta(self.model, self.inputs)

    def plan_peak(self, plan: Plan) -> int:
        return measure.step_peak_bytes_meta(self.model, self.inputs, prepare=self._prepare(plan))

    def profile(self, sites: frozenset) -> Optional[Profile]:
        """Region costs of the model fused with `sites` (the pointwise ones: what a region runs inside);
        None where the model is not captured as one graph."""
        trial = measure.meta_copy(self.model)
        self._prepare(Plan(sites))(trial)
        graph = install.fx_graph(trial)
        if graph is None:
            return None
        return region_costs.profile(trial, graph, measure.to_meta(self.inputs))

    def _prepare(self, plan: Plan) -> Callable[[nn.Module], Any]:
        """Optimize a meta-device trial copy with `plan` (its inputs as meta tensors)."""
        walk = install.Walk(FusionReport("memory"), install=True, captures=self.captures, both_modes=False)
        return lambda trial: install.walk(trial, measure.to_meta(self.inputs), Options("memory", plan), walk)
