"""What each op of a run costs: its FLOPs and the bytes it moves, and on real tensors its time.

`OpCosts` is a TorchDispatchMode that notes, for every op that runs under it, the FLOPs
torch's FlopCounterMode formulas give it (convs, matmuls and fxfuse's ops that have one;
pointwise ops count none; `aten.convolution_backward` is counted here as its forward for each
gradient it computes, since torch's formula counts a grouped conv's weight gradient as if it had
one group: a depthwise conv's backward came to 33× its forward) and the bytes it moves: every
tensor it reads (its tensor arguments) and writes (its outputs). That is a roofline count: an op
that streams its operands once moves exactly that, and a conv or matmul that re-reads them from
cache is priced by its FLOPs. Views and shape-only ops move nothing. On the meta device this costs
no compute, so the budget policy can price a recompute before running anything
(fusion/regions/time_model.py); with `timed=True` on real tensors it also times each op,
which is how `benchmarks/time_model.py` measures the constants of that model.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

# Ops that read or write no tensor data: allocation, shape and metadata only.
_NO_TRAFFIC = frozenset(
    {
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "detach",
        "lift_fresh",
        "sym_size",
        "sym_stride",
        "sym_numel",
        "sym_storage_offset",
        "is_same_size",
        "resize_",
        "set_",
    }
)


@dataclass
class OpCost:
    name: str  # e.g. "aten.convolution.default"
    flops: int
    moved: int  # bytes read and written
    seconds: Optional[float] = None  # with timed=True


def _tensor_bytes(obj: Any) -> int:
    leaves = torch.utils._pytree.tree_leaves(obj)
    return sum(math.prod(t.shape) * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


def _conv_backward_flops(grad_out, input, weight, *args, out_val=None, **kwargs) -> int:
    """Each gradient computed (input, weight) costs the forward's multiply-adds; a grouped conv's forward has
    `weight.shape[1]` input channels per output, so groups are counted."""
    output_mask = args[-1] if args else kwargs["output_mask"]
    forward = 2 * math.prod(grad_out.shape) * math.prod(weight.shape[1:])
    return forward * (int(output_mask[0]) + int(output_mask[1]))


_FLOPS = {torch.ops.aten.convolution_backward: _conv_backward_flops}


def moves_nothing(func) -> bool:
    """Views alias their input; allocation and metadata ops touch no data."""
    return bool(getattr(func, "is_view", False)) or func.__name__.split(".")[0] in _NO_TRAFFIC


@dataclass
class OpCosts(TorchDispatchMode):
    """Notes each op's FLOPs and bytes moved (`ops`), and their totals; times each op with `timed`."""

    timed: bool = False
    ops: list[OpCost] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__()
        self._registry = FlopCounterMode().flop_registry

    @property
    def flops(self) -> int:
        return sum(op.flops for op in self.ops)

    @property
    def moved(self) -> int:
        return sum(op.moved for op in self.ops)

    @property
    def data_ops(self) -> int:
        """How many of the ops read or wrote data (views and allocations are not counted)."""
        return sum(1 for op in self.ops if op.moved)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        start = time.perf_counter() if self.timed else 0.0
        out = func(*args, **kwargs)
        seconds = time.perf_counter() - start if self.timed else None
        own = _FLOPS.get(func._overloadpacket)
        counter = self._registry.get(func._overloadpacket)
        if own is not None:
            flops = own(*args, **kwargs, out_val=out)
        else:
            flops = int(counter(*args, **kwargs, out_val=out)) if counter is not None else 0
        moved = 0 if moves_nothing(func) else _tensor_bytes((args, kwargs)) + _tensor_bytes(out)
        self.ops.append(OpCost(str(func), flops, moved, seconds))
        return out
