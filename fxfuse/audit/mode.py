"""The dispatch mode that watches every aten op, forward and backward, without patching torch."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .attribution import AutogradOrigins, ModuleTracker, Origin, SourceLocator
from .fake_notes import FakeStrideTracker
from .report import BACKWARD, FORWARD, Finding, TensorMeta
from .rules import AMBIGUOUS, CAVEAT, HINT_CAVEAT, INFO, KEPT, LOSS, classify


class FormatAuditMode(TorchDispatchMode):
    """Runs each aten op, then judges its inputs' and outputs' memory formats with `rules.classify`.

    Set `phase` to BACKWARD before entering the mode around `torch.autograd.backward`.
    Pass `origins` to attribute backward ops (it costs a stack walk per forward op).
    """

    def __init__(
        self,
        modules: ModuleTracker,
        locate: SourceLocator,
        origins: Optional[AutogradOrigins] = None,
        fake: bool = False,
    ):
        super().__init__()
        self.phase = FORWARD
        self._modules = modules
        self._locate = locate
        self._origins = origins
        self._fake_strides = FakeStrideTracker() if fake else None
        self._counts: dict[Finding, int] = {}
        self.ops_seen = {FORWARD: 0, BACKWARD: 0}
        self.ops_checked = {FORWARD: 0, BACKWARD: 0}
        self.saw_4d_tensors = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self._observe(func, args, kwargs, out)
        return out

    def _observe(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict[str, Any], out: Any) -> None:
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not outputs:
            return  # metadata queries such as FakeTensor's prim.device: nothing to judge
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        phase = self.phase
        self.ops_seen[phase] += 1
        origin = None
        if phase == FORWARD and self._origins is not None:
            origin = Origin(self._modules.current, self._locate())
            self._origins.log_forward_op(origin)

        if not self.saw_4d_tensors:
            self.saw_4d_tensors = any(t.dim() == 4 for t in inputs + outputs)

        op = str(func)
        note, known_difference = None, False
        if self._fake_strides is not None:
            note, known_difference = self._fake_strides.observe(op, inputs, outputs)

        verdict = classify(func, kwargs, inputs, outputs)
        if verdict is None:
            return
        if verdict.checked:
            self.ops_checked[phase] += 1
        severity, hint = verdict.severity, verdict.hint
        if severity == KEPT:
            if not known_difference:
                return
            severity, hint = CAVEAT, HINT_CAVEAT

        if origin is None:
            if phase == FORWARD:
                origin = Origin(self._modules.current, self._locate())
            else:
                origin = self._origins.of_current_node() if self._origins else Origin(None, None)
        finding = Finding(
            op=op,
            phase=phase,
            module=origin.module,
            location=origin.location,
            inputs=tuple(TensorMeta.of(t) for t in inputs),
            outputs=tuple(TensorMeta.of(t) for t in outputs),
            hint=hint,
            severity=severity,
            autograd_node=origin.autograd_node,
            note=note,
        )
        self._counts[finding] = self._counts.get(finding, 0) + 1

    def results(self) -> dict[str, list[Finding]]:
        """Grouped findings by severity: {'loss': [...], 'info': [...], 'ambiguous': [...], 'caveat': [...]}."""
        grouped: dict[str, list[Finding]] = {LOSS: [], INFO: [], AMBIGUOUS: [], CAVEAT: []}
        for finding, count in self._counts.items():
            grouped[finding.severity].append(replace(finding, count=count))
        return grouped
