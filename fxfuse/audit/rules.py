"""The audit's rule: which aten op calls lose channels_last, and why.

An op *loses* the format when one of its 4-D inputs is unambiguously channels_last and one
of its 4-D outputs is unambiguously contiguous (NCHW). Views only relabel dims (ConvNeXt's
NHWC permute is the usual example), so they are reported as info, never as losses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from .formats import AMBIGUOUS, CHANNELS_LAST, CONTIGUOUS, STRIDED, ambiguity_kind, memory_format_of

LOSS = "loss"
INFO = "info"
KEPT = "kept"
CAVEAT = "caveat"  # fake mode only: kept on fake tensors, but the op's fake strides are known to differ
# AMBIGUOUS ("ambiguous") doubles as a severity: the call proves neither a keep nor a loss.

_aten = torch.ops.aten
# Ops that return a fresh tensor by schema but are views in practice (reshape's building blocks).
_VIEW_PACKETS = {_aten._unsafe_view, _aten._reshape_alias}

HINT_VIEW = "permute/view changed dim order (no copy)"
HINT_INPLACE = "in-place write into an NCHW tensor"
HINT_CONTIGUOUS = "memory_format=contiguous_format requested: .contiguous(), or a reshape/flatten that had to copy"
HINT_MIXED = "mixed-format inputs"
HINT_NO_KERNEL = "op has no channels_last kernel"
HINT_CAVEAT = "kept on fake tensors; the real kernel's strides may differ"


@dataclass(frozen=True)
class Verdict:
    severity: str
    hint: str = ""
    checked: bool = True  # the call had an unambiguously channels_last input


def is_view_like(func: torch._ops.OpOverload) -> bool:
    """True for ops whose output aliases an input: view, permute, expand, detach, as_strided_..."""
    return func.is_view or torch.Tag.inplace_view in func.tags or func.overloadpacket in _VIEW_PACKETS


def _writes_first_argument(func: torch._ops.OpOverload) -> bool:
    arguments = func._schema.arguments
    return bool(arguments) and arguments[0].alias_info is not None and arguments[0].alias_info.is_write


def classify(
    func: torch._ops.OpOverload,
    kwargs: dict[str, Any],
    inputs: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor],
) -> Optional[Verdict]:
    """Judge one op call from its flattened tensor inputs and outputs.

    Returns None when the call has nothing to do with channels_last (no channels_last input,
    no ambiguity), else a Verdict whose severity is LOSS, INFO, AMBIGUOUS or KEPT.
    """
    in_formats = [memory_format_of(t) for t in inputs if t.dim() == 4]
    out_formats = [memory_format_of(t) for t in outputs if t.dim() == 4]

    if CHANNELS_LAST not in in_formats:
        if in_formats and all(f == AMBIGUOUS for f in in_formats) and CONTIGUOUS in out_formats:
            kind = _first_ambiguity(inputs)
            return Verdict(AMBIGUOUS, f"{kind} input: cannot tell whether channels_last was lost", checked=False)
        return None

    if CONTIGUOUS in out_formats:
        if is_view_like(func):
            return Verdict(INFO, HINT_VIEW)
        if _writes_first_argument(func) and inputs[0].dim() == 4 and memory_format_of(inputs[0]) == CONTIGUOUS:
            return Verdict(LOSS, HINT_INPLACE)
        if kwargs.get("memory_format") == torch.contiguous_format:
            return Verdict(LOSS, HINT_CONTIGUOUS)
        if has_mixed_formats(inputs):
            return Verdict(LOSS, HINT_MIXED)
        return Verdict(LOSS, HINT_NO_KERNEL)

    if AMBIGUOUS in out_formats:
        kind = _first_ambiguity(outputs)
        return Verdict(AMBIGUOUS, f"{kind} output is both contiguous and channels_last")
    return Verdict(KEPT)


def is_channels_last(tensor: torch.Tensor) -> bool:
    """Unambiguously channels_last (4-D, and not also contiguous)."""
    return tensor.dim() == 4 and memory_format_of(tensor) == CHANNELS_LAST


def has_mixed_formats(inputs: Sequence[torch.Tensor]) -> bool:
    """Some 4-D input is channels_last and another is laid out NCHW-style."""
    return any(is_channels_last(t) for t in inputs) and any(_is_channel_major(t) for t in inputs)


def _is_channel_major(tensor: torch.Tensor) -> bool:
    """A 4-D input laid out NCHW-style: contiguous, or a view whose C stride is outside H and W."""
    if tensor.dim() != 4:
        return False
    layout = memory_format_of(tensor)
    if layout != STRIDED:
        return layout == CONTIGUOUS
    # Size-1 and broadcast (stride-0) dims carry no order.
    spatial = [tensor.stride(d) for d in (2, 3) if tensor.size(d) > 1 and tensor.stride(d) > 0]
    channel_stride = tensor.stride(1) if tensor.size(1) > 1 else 0
    return bool(spatial) and channel_stride > max(spatial)


def _first_ambiguity(tensors: Sequence[torch.Tensor]) -> str:
    for t in tensors:
        if t.dim() == 4 and memory_format_of(t) == AMBIGUOUS:
            return ambiguity_kind(tuple(t.shape))
    return "ambiguous"
