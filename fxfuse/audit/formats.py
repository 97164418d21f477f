"""Memory-format classification of tensors, as the channels_last audit sees them.

A 4-D tensor is *channels_last* or *contiguous* (NCHW) only when it is exactly one of the two.
Tensors with one channel (N1HW), 1x1 spatial size (NC11) or no elements satisfy both
`is_contiguous()` checks at once; they are *ambiguous* and prove nothing either way.
"""

from __future__ import annotations

import torch

CHANNELS_LAST = "channels_last"
CONTIGUOUS = "contiguous"
AMBIGUOUS = "ambiguous"
STRIDED = "strided"  # neither (a permuted, sliced or expanded view)

SHORT_NAMES = {CHANNELS_LAST: "CL", CONTIGUOUS: "NCHW", AMBIGUOUS: "ambiguous", STRIDED: "strided"}


def memory_format_of(tensor: torch.Tensor) -> str:
    """One of CHANNELS_LAST, CONTIGUOUS, AMBIGUOUS, STRIDED; only 4-D tensors can be CHANNELS_LAST."""
    contiguous = tensor.is_contiguous()
    if tensor.dim() != 4:
        return CONTIGUOUS if contiguous else STRIDED
    channels_last = tensor.is_contiguous(memory_format=torch.channels_last)
    if contiguous and channels_last:
        return AMBIGUOUS
    if channels_last:
        return CHANNELS_LAST
    return CONTIGUOUS if contiguous else STRIDED


def ambiguity_kind(shape: tuple[int, ...]) -> str:
    """Why a 4-D shape is ambiguous: 'N1HW', 'NC11' (1x1 spatial) or 'empty'."""
    _, channels, height, width = shape
    if channels * height * width == 0 or shape[0] == 0:
        return "empty"
    if channels == 1:
        return "N1HW"
    if height == 1 and width == 1:
        return "NC11"
    return "degenerate"
