"""ChannelsLastReport: what the audit found, as data, JSON and a table."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch
from tabulate import tabulate

from .formats import SHORT_NAMES, memory_format_of

FORWARD = "forward"
BACKWARD = "backward"


@dataclass(frozen=True)
class TensorMeta:
    """Shape, strides and memory format of one tensor an op read or wrote."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    memory_format: str

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorMeta:
        return cls(tuple(tensor.shape), tuple(tensor.stride()), memory_format_of(tensor))

    def __str__(self) -> str:
        dims = "x".join(map(str, self.shape)) or "scalar"
        return f"{dims} {SHORT_NAMES[self.memory_format]}" if len(self.shape) == 4 else dims


@dataclass(frozen=True)
class Finding:
    """One op call site (grouped over repeated calls) that lost, reordered or blurred channels_last.

    severity is "loss" (counts against `ok`), "info" (a view that reorders dims, no copy),
    "ambiguous" (an N1HW/NC11/empty tensor that is both contiguous and channels_last) or, in
    fake mode only, "caveat" (kept on fake tensors by an op whose fake strides are known to
    differ from the real kernel's; `note` says how).
    module is the qualified path of the innermost module ("" is the root; None when unknown);
    for backward ops it is the module whose forward created the autograd node.
    """

    op: str
    phase: str
    module: Optional[str]
    location: Optional[str]
    inputs: tuple[TensorMeta, ...]
    outputs: tuple[TensorMeta, ...]
    hint: str
    severity: str = "loss"
    autograd_node: Optional[str] = None
    note: Optional[str] = None
    count: int = 1

    @property
    def input_shapes(self) -> list[tuple[int, ...]]:
        return [t.shape for t in self.inputs]

    @property
    def output_shapes(self) -> list[tuple[int, ...]]:
        return [t.shape for t in self.outputs]

    @property
    def input_strides(self) -> list[tuple[int, ...]]:
        return [t.stride for t in self.inputs]

    @property
    def output_strides(self) -> list[tuple[int, ...]]:
        return [t.stride for t in self.outputs]


@dataclass(repr=False)
class ChannelsLastReport:
    """Result of `audit_channels_last`. `ok` is True when no op lost channels_last.

    findings are the losses; info, ambiguous and caveats are the other severities (see
    Finding). ops_seen counts, per phase, the aten ops that returned tensors; ops_checked
    those with an unambiguously channels_last input. backward is True when backward ran.
    """

    model: str
    input_shapes: list[tuple[int, ...]]
    training: bool
    fake: bool
    backward: bool
    findings: list[Finding] = field(default_factory=list)
    info: list[Finding] = field(default_factory=list)
    ambiguous: list[Finding] = field(default_factory=list)
    caveats: list[Finding] = field(default_factory=list)
    ops_seen: dict[str, int] = field(default_factory=lambda: {FORWARD: 0, BACKWARD: 0})
    ops_checked: dict[str, int] = field(default_factory=lambda: {FORWARD: 0, BACKWARD: 0})
    saw_4d_tensors: bool = False
    backward_skipped: Optional[str] = None

    @property
    def ok(self) -> bool:
        return not self.findings

    @property
    def nothing_to_audit(self) -> bool:
        return not self.saw_4d_tensors

    def losses(self, phase: Optional[str] = None) -> list[Finding]:
        return [f for f in self.findings if phase is None or f.phase == phase]

    def to_dict(self) -> dict:
        data = asdict(self)
        data.update(ok=self.ok, nothing_to_audit=self.nothing_to_audit)
        return data

    def to_json(self, indent: Optional[int] = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def __str__(self) -> str:
        return "\n".join(self._render())

    def __repr__(self) -> str:
        return (
            f"<ChannelsLastReport {self.model}: {len(self.findings)} losses, {len(self.info)} info, "
            f"{len(self.ambiguous)} ambiguous, {len(self.caveats)} caveats>"
        )

    def _render(self) -> list[str]:
        phases = "forward+backward" if self.backward else "forward"
        tensors = "fake tensors" if self.fake else "real tensors"
        shapes = ", ".join("x".join(map(str, s)) for s in self.input_shapes) or "no tensors"
        lines = [
            f"channels_last audit of {self.model}: input {shapes}, "
            f"{'train' if self.training else 'eval'} mode, {phases}, {tensors}"
        ]
        if self.backward_skipped:
            lines.append(f"backward not audited: {self.backward_skipped}")
        if self.nothing_to_audit:
            lines.append("nothing to audit: the model produced no 4-D tensors")
            return lines
        checked = ", ".join(f"{n} {phase}" for phase, n in self.ops_checked.items() if n)
        lines.append(f"aten ops with a channels_last input: {checked or 'none'}")
        if self.ok:
            lines.append("OK: no op lost channels_last")
        else:
            calls = sum(f.count for f in self.findings)
            lines += [f"{len(self.findings)} op site(s) lost channels_last ({calls} calls):", _table(self.findings)]
        sections = (
            (self.info, "info: views that reorder dims (no copy, not a loss):"),
            (self.ambiguous, "ambiguous: tensors both contiguous and channels_last (neither kept nor lost):"),
            (self.caveats, "caveats: kept on fake tensors, but these ops' fake strides differ from real ones:"),
        )
        for entries, title in sections:
            if entries:
                lines += [title, _summary(entries)]
        return lines


def _tensors(metas: tuple[TensorMeta, ...]) -> str:
    shown = [str(t) for t in metas if len(t.shape) == 4] or [str(t) for t in metas[:1]]
    hidden = len(metas) - len(shown)
    return ", ".join(shown) + (f" (+{hidden})" if hidden > 0 else "")


def _module(finding: Finding) -> str:
    if finding.module is None:
        return "?"
    return finding.module or "<root>"


def _table(findings: list[Finding]) -> str:
    rows = [
        [
            f.phase,
            f.op,
            _module(f),
            f.location or "",
            f.count,
            _tensors(f.inputs),
            _tensors(f.outputs),
            f.hint + (f" [{f.note}]" if f.note else ""),
        ]
        for f in findings
    ]
    headers = ["phase", "op", "module", "location", "calls", "inputs", "outputs", "hint"]
    return tabulate(rows, headers=headers, tablefmt="simple")


def _summary(entries: list[Finding]) -> str:
    """One row per (phase, op, hint): how many sites and calls, and the first site's location."""
    grouped: dict[tuple[str, str, str], list] = {}
    for f in entries:
        row = grouped.setdefault((f.phase, f.op, f.note or f.hint), [0, 0, _module(f), f.location or ""])
        row[0] += 1
        row[1] += f.count
    rows = [[phase, op, *counts, why] for (phase, op, why), counts in grouped.items()]
    return tabulate(rows, headers=["phase", "op", "sites", "calls", "first module", "first location", "why"])
