"""`fxfuse.verify`: check, on your own model, that fxfuse's rewrite trains exactly like it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from tabulate import tabulate
from torch import nn

from . import fusion
from .testing import (
    FP64_MULTIPLIER,
    Check,
    cast_inputs,
    compare_models,
    copy_model,
    failure_summary,
    few_values_hint,
    float64_copy,
    needs_float64_reference,
    norms_behind,
    validate_options,
)

__all__ = ["VerifyReport", "verify"]


@dataclass
class VerifyReport:
    """What `verify` compared, and whether everything matched.

    `checks` holds one Check per kind of tensor per point of the run (e.g. the
    parameter gradients of step 1), each with the worst difference and the name of
    the tensor it was in. `str(report)` is a table of them.
    """

    checks: list[Check]
    mode: str
    steps: int
    dtype: Optional[torch.dtype] = None
    optimize_report: Any = None  # the optimized copy's `fxfuse_report`, if it had one
    fp64_reference: bool = False  # whether a float64 copy of the model was the reference
    # On a failure by small differences only: the BatchNorm layers that normalize over at most FEW_VALUES
    # values per channel at these inputs, with that count (fxfuse.testing.norms_behind).
    few_value_norms: list[tuple[str, int]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(check.passed for check in self.checks)

    @property
    def failures(self) -> list[Check]:
        return [check for check in self.checks if not check.passed]

    def summary(self) -> str:
        """One line when everything matched; otherwise the first failure, and the others."""
        if self.ok:
            return f"equivalent: all {len(self.checks)} checks passed"
        summary = "NOT equivalent: " + failure_summary(self.checks)
        if not self.fp64_reference and self.dtype != torch.float64:
            summary += f"\n{_FLOAT64_HINT}"
        if self.few_value_norms:
            summary += "\n" + few_values_hint(self.few_value_norms)
        return summary

    def table(self) -> str:
        """One row per check: its worst tensor, eager's and fxfuse's error, and what was allowed.

        Errors are relative to the tensor's scale: against the float64 reference when
        there is one (eager's own error shown beside fxfuse's), else fxfuse against eager.
        """
        headers = ["phase", "check", "tensors", "worst tensor", "eager error", "fxfuse error", "allowed", "result"]
        return tabulate([_row(check) for check in self.checks], headers=headers, disable_numparse=True)

    def __str__(self) -> str:
        dtype = str(self.dtype).replace("torch.", "") if self.dtype is not None else "model's own dtype"
        lines = [f"fxfuse.verify (mode={self.mode}, steps={self.steps}, dtype={dtype})"]
        if self.fp64_reference:
            lines.append(
                "reference: eager in float64; errors are relative to each tensor's scale; a tensor passes when "
                f"fxfuse's error is at most {FP64_MULTIPLIER:g}x eager's own plus a floor"
            )
        if self.optimize_report is not None:
            lines.append(f"optimized copy: {str(self.optimize_report).splitlines()[0]}")
        return "\n".join([*lines, self.table(), self.summary()])


_FLOAT64_HINT = (
    "hint: without a float64 reference, float32 rounding that training amplifies reads as a difference; "
    "run with fp64_reference=True (the default) or dtype=torch.float64 to tell real differences from rounding."
)


def _row(check: Check) -> list[str]:
    worst = check.worst
    name = worst.name if worst.problem is None else f"{worst.name}: {worst.problem}"
    if worst.problem is not None or check.phase == "structure":
        numbers = ["-", "-", "-"]
    else:
        own = worst.reference_rel_diff
        numbers = [
            "-" if own is None else _number(own),
            _number(worst.rel_diff),
            _number(worst.tolerance / worst.scale if worst.scale > 0 else worst.tolerance),
        ]
    result = "ok" if check.passed else f"FAIL ({len(check.failures)})"
    return [check.label, check.kind, str(len(check.comparisons)), name, *numbers, result]


def _number(value: float) -> str:
    return str(value) if math.isnan(value) or math.isinf(value) else f"{value:.1e}"


def verify(
    model: nn.Module,
    *example_inputs: Any,
    mode: str = "memory",
    steps: int = 2,
    dtype: Optional[torch.dtype] = None,
    rtol: Optional[float] = None,
    atol: Optional[float] = None,
    fp64_reference: bool = True,
) -> VerifyReport:
    """Optimize a copy of `model` with fxfuse and check it trains exactly like the original.

    A deep copy of `model` is optimized (``fxfuse.optimize(copy, example_inputs,
    mode=mode)``) and run side by side with another deep copy of the original, in
    train mode, for `steps` plain SGD steps from the same RNG state; then both are
    compared in eval mode. See `fxfuse.testing` for everything that is compared.
    With `fp64_reference` (the default; it applies below float64), a third copy runs
    in float64 as the truth, and each tensor of the optimized copy may be off from it
    by at most FP64_MULTIPLIER times eager's own error at the same dtype, plus a small
    floor: float32 rounding that eager makes too is not reported as a difference.
    `model` itself is not changed: not its parameters, buffers, grads or training flag.

    Args:
        model: the model to check.
        *example_inputs: the positional arguments of ``model.forward``; floating
            tensors among them also get their gradients compared.
        mode: the fxfuse.optimize mode to check.
        steps: training steps to compare (0: eval mode and structure only).
        dtype: if given, both copies and the floating inputs are cast to it first.
        rtol, atol: override the floor ``atol + rtol * max|ref64|`` added to the
            multiple of eager's error (default `fxfuse.testing.fp64_floor`); without a
            float64 reference, the whole tolerance: ``max|ref - opt| <= atol + rtol * max|ref|``.
        fp64_reference: False compares the optimized copy with eager directly, at
            fixed per-dtype tolerances (`fxfuse.testing.default_tolerance`).

    Returns:
        A VerifyReport; ``report.ok`` is True when everything matched. Errors raised
        by fxfuse.optimize (an unknown `mode`, say) propagate.
    """
    validate_options(steps, dtype, rtol, atol)
    inputs = cast_inputs(example_inputs, dtype)
    reference = copy_model(model, dtype).train()
    reference64 = float64_copy(reference) if fp64_reference and needs_float64_reference(reference, inputs) else None
    candidate = fusion.optimize(copy_model(model, dtype).train(), inputs, mode=mode)
    checks = compare_models(reference, candidate, inputs, steps=steps, rtol=rtol, atol=atol, reference64=reference64)
    return VerifyReport(
        checks=checks,
        mode=mode,
        steps=steps,
        dtype=dtype,
        optimize_report=getattr(candidate, "fxfuse_report", None),
        fp64_reference=reference64 is not None,
        few_value_norms=norms_behind(checks, reference, inputs),
    )
