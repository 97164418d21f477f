"""Which memory format an optimized model runs in: `optimize(..., memory_format=...)`.

"preserve" leaves every layout as it is. "channels_last" converts the model's 4-D
parameters and buffers to channels_last and has the optimized forward convert its 4-D
floating inputs. "auto" does the same only where it is known to pay: the model has a
Conv2d, `fxfuse.audit_channels_last` (on fake tensors) finds no op that loses the
format, and a forward+backward of the eager model at the example inputs measures
faster in channels_last than in the current layout on this device and dtype. The
inputs are timed as given, not cut to batch 1: at batch 1 ResNet-50 (224², CPU)
measured 1.05x in channels_last, at batch 8 0.79x, so a smaller batch picks the
wrong layout (and a BatchNorm1d after pooling cannot train on one sample).
The report says what was chosen and why.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from .. import measure

MEMORY_FORMATS = ("preserve", "channels_last", "auto")
_TIMING_REPEATS = 2  # after one warm-up round; the fastest counts (others' jobs only add time)


@dataclass(frozen=True)
class LayoutDecision:
    channels_last: bool
    reason: str


def to_channels_last(args: Sequence[Any]) -> tuple:
    """`args` with every 4-D floating tensor in channels_last."""
    return tuple(
        a.contiguous(memory_format=torch.channels_last)
        if isinstance(a, torch.Tensor) and a.dim() == 4 and a.is_floating_point()
        else a
        for a in args
    )


def is_channels_last(model: nn.Module) -> bool:
    """Every Conv2d weight is channels_last, and at least one unambiguously so.

    A 1x1 kernel (O, C, 1, 1) or a one-channel input (O, 1, kH, kW) makes a weight both
    contiguous and channels_last: such weights say nothing about the layout either way.
    """
    weights = [m.weight for m in model.modules() if isinstance(m, nn.Conv2d)]
    telling = [w for w in weights if not w.is_contiguous()]
    return bool(telling) and all(w.is_contiguous(memory_format=torch.channels_last) for w in weights)


def decide(model: nn.Module, inputs: Optional[tuple], memory_format: str) -> LayoutDecision:
    if memory_format == "preserve":
        return LayoutDecision(False, "memory_format='preserve'")
    if memory_format == "channels_last":
        return LayoutDecision(True, "memory_format='channels_last'")
    if not any(isinstance(m, nn.Conv2d) for m in model.modules()):
        return LayoutDecision(False, "auto: no Conv2d, nothing for channels_last to speed up")
    if is_channels_last(model):
        return LayoutDecision(True, "auto: the model is channels_last already")
    four_d = [x for x in inputs or () if isinstance(x, torch.Tensor) and x.dim() == 4 and x.is_floating_point()]
    if not four_d:
        return LayoutDecision(False, "auto: needs a 4-D example input to check and time channels_last")
    from ..audit import audit_channels_last

    report = audit_channels_last(model, *inputs, fake=True)
    if report.findings:
        first = report.findings[0]
        where = f"{first.op} in {first.module}" if first.module else first.op
        return LayoutDecision(
            False,
            f"auto: channels_last would be lost at {where} "
            f"({len(report.findings)} op sites; see fxfuse.audit_channels_last; "
            "memory_format='channels_last' converts anyway)",
        )
    nchw, cl = _step_seconds(model, inputs)
    if cl >= nchw:
        return LayoutDecision(
            False,
            f"auto: channels_last measured no faster here ({cl / nchw:.2f}x the current "
            f"layout's forward+backward at the example input)",
        )
    return LayoutDecision(
        True,
        f"auto: no format loss, and {cl / nchw:.2f}x the current layout's forward+backward time at the example input",
    )


def _step_seconds(model: nn.Module, inputs: tuple) -> tuple[float, float]:
    """Fastest forward+backward seconds of a copy of `model` at `inputs`: (current layout, channels_last)."""
    current = copy.deepcopy(model)
    converted = copy.deepcopy(model).to(memory_format=torch.channels_last)
    runs = {"current": (current, tuple(inputs)), "channels_last": (converted, to_channels_last(inputs))}
    times: dict[str, list[float]] = {name: [] for name in runs}

    def step(m: nn.Module, x: tuple) -> None:
        out = m(*x)
        loss = sum(t.float().sum() for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad)
        if isinstance(loss, torch.Tensor):
            loss.backward()

    for repeat in range(_TIMING_REPEATS + 1):
        for name, (m, x) in runs.items():
            seconds = measure.timed(lambda m=m, x=x: step(m, x))
            if repeat:  # the first round warms up
                times[name].append(seconds)
    return min(times["current"]), min(times["channels_last"])
