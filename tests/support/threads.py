"""Pinning ATen's intra-op thread count for a block (the conftest fixtures, test_accuracy)."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def intra_op_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
