"""Ops whose FakeTensor output strides differ from the real CPU kernel's (measured on torch 2.14).

Fake mode takes strides from meta kernels and Python decompositions. For these ops they do
not match what the CPU kernel returns, so under `fake=True` their verdicts carry a note, and
calls that look fine on fake tensors are listed as caveats. A difference propagates: every
op downstream of such a call sees inputs whose strides may not be the real ones, so its
findings carry a note too.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .rules import has_mixed_formats, is_channels_last

_FOLLOWS_GRAD = (
    "with mixed-format inputs the CPU kernel's output follows grad_output, the fake (decomposition) output follows self"
)
_BN_BACKWARD = (
    "with mixed-format inputs the CPU kernel's grad_input follows input, the fake (meta) one follows grad_output"
)
_META_CONTIGUOUS = "the CPU kernel keeps channels_last; the fake (meta) output is contiguous"

# op -> (note, differs only when inputs mix channels_last and NCHW; else whenever one is channels_last)
_DIFFERENCES: dict[str, tuple[str, bool]] = {
    "aten.hardtanh_backward.default": (_FOLLOWS_GRAD, True),
    "aten.hardswish_backward.default": (_FOLLOWS_GRAD, True),
    "aten.hardsigmoid_backward.default": (_FOLLOWS_GRAD, True),
    "aten.elu_backward.default": (_FOLLOWS_GRAD, True),
    "aten.native_batch_norm_backward.default": (_BN_BACKWARD, True),
    "aten.roll.default": (_META_CONTIGUOUS, False),
    "aten.channel_shuffle.default": (_META_CONTIGUOUS, False),
    "aten.reflection_pad2d_backward.default": (_META_CONTIGUOUS, False),
    "aten.replication_pad2d_backward.default": (_META_CONTIGUOUS, False),
}

KNOWN_FAKE_STRIDE_DIFFERENCES = frozenset(_DIFFERENCES)


def fake_stride_note(op: str, inputs: Sequence[torch.Tensor]) -> Optional[str]:
    """Why fake strides for this call may not be the real ones, or None when they should match."""
    difference = _DIFFERENCES.get(op)
    if difference is None:
        return None
    note, mixed_only = difference
    differs = has_mixed_formats(inputs) if mixed_only else any(is_channels_last(t) for t in inputs)
    return f"fake strides may differ: {note}" if differs else None


class FakeStrideTracker:
    """Follows fake tensors whose strides may differ from the real ones, from the call that made them on."""

    def __init__(self):
        self._doubtful: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> op that made it doubtful

    def observe(
        self, op: str, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]
    ) -> tuple[Optional[str], bool]:
        """(note for this call or None, whether the op itself is a known difference)."""
        note = fake_stride_note(op, inputs)
        source = op if note is not None else next((self._doubtful[t] for t in inputs if t in self._doubtful), None)
        if source is None:
            return None, False
        for tensor in outputs:
            self._doubtful[tensor] = source
        if note is not None:
            return note, True
        return f"fake strides may differ: an input derives from {source}, whose fake strides differ", False
