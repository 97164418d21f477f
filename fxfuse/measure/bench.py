"""Side-by-side measurement of eager, fxfuse and the peers users would pick instead, in one process.

Used by `fxfuse bench`, `make demo` and the benchmark scripts, so every number in the
README comes from the same code. Every row is also a ratio to the first (eager).
Resident-memory numbers need MALLOC_MMAP_THRESHOLD_=65536 in the environment at
process start (see `ensure_malloc_env`).

Variants: "eager"; fxfuse modes "fast", "memory", "auto"; "budget=0.7" (fxfuse with
memory_budget=0.7); peers "checkpoint" (torch.utils.checkpoint, non-reentrant, on each
top-level child block) and "compile" (torch.compile).
"""
from __future__ import annotations

import copy
import ctypes
import os
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from tabulate import tabulate
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..errors import ConfigurationError
from ..fusion import MODES, optimize
from . import memory

PEERS = ("checkpoint", "compile")


_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


def ensure_malloc_env() -> bool:
    """Make freed activation buffers go back to the OS, so resident memory tracks live tensors.

    glibc's mallopt(M_MMAP_THRESHOLD, 65536), the run-time form of MALLOC_MMAP_THRESHOLD_=65536:
    blocks of 64 KiB and more are mmapped and unmapped when freed. Returns False where
    that is not available (not glibc); resident numbers then include freed memory.
    """
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") == "65536":
        return True
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, 65536))
    except (OSError, AttributeError):
        return False
    if ok:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # and for child processes
    return ok


@dataclass
class Row:
    variant: str
    saved_bytes: int
    resident_bytes: int
    step_seconds: float
    saved_ratio: float = 1.0
    resident_ratio: float = 1.0
    time_ratio: float = 1.0
    peak_bytes: Optional[int] = None  # resident-memory growth during a train step (CPU) / allocator peak (CUDA)
    peak_ratio: Optional[float] = None


# ------------------------------------------------------------------ variants


class Checkpointed(nn.Module):
    """Runs `block` under torch.utils.checkpoint (non-reentrant): keeps only the block's inputs."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        return checkpoint(self.block, *args, use_reentrant=False, **kwargs)


def checkpoint_blocks(model: nn.Module) -> nn.Module:
    """Checkpoint every top-level child block of `model` that has parameters, in place.

    A top-level nn.Sequential (ResNet's layer1, EfficientNet's features) is a list of
    blocks, not a block: its children are checkpointed one by one.
    """
    def wrap(parent: nn.Module) -> None:
        for name, child in list(parent.named_children()):
            if not any(True for _ in child.parameters()):
                continue
            setattr(parent, name, Checkpointed(child))

    for child in list(model.children()):
        if isinstance(child, nn.Sequential):
            wrap(child)
    for name, child in list(model.named_children()):
        if not isinstance(child, nn.Sequential) and any(True for _ in child.parameters()):
            setattr(model, name, Checkpointed(child))
    return model


def parse_variants(modes: Sequence[str], budgets: Sequence[float] = (), peers: Sequence[str] = ()) -> list[str]:
    """Variant names in table order, with eager first; bad names raise ConfigurationError."""
    names = ["eager"]
    for mode in modes:
        if mode != "eager" and mode not in MODES:
            raise ConfigurationError(f"unknown mode {mode!r}: choose from eager, {', '.join(MODES)}")
        if mode not in names:
            names.append(mode)
    names += [f"budget={b:g}" for b in budgets]
    for peer in peers:
        if peer not in PEERS:
            raise ConfigurationError(f"unknown peer {peer!r}: choose from {', '.join(PEERS)}")
        names.append(peer)
    return names


def make_variant(name: str, model: nn.Module, example_inputs: Sequence[Any]) -> nn.Module:
    """A fresh copy of `model` set up as variant `name` (see parse_variants)."""
    if name == "eager":
        return copy.deepcopy(model)
    if name in MODES:
        return optimize(copy.deepcopy(model), tuple(example_inputs), mode=name)
    if name.startswith("budget="):
        return optimize(copy.deepcopy(model), tuple(example_inputs), memory_budget=float(name.split("=", 1)[1]))
    if name == "checkpoint":
        return checkpoint_blocks(copy.deepcopy(model))
    if name == "compile":
        return torch.compile(copy.deepcopy(model))
    raise ConfigurationError(f"unknown variant {name!r}")


def variants_for(model: nn.Module, modes: Sequence[str], example_inputs: Optional[Sequence[Any]] = None
                 ) -> dict[str, nn.Module]:
    """eager (the model itself) and fxfuse.optimize in each mode."""
    out: dict[str, nn.Module] = {}
    for mode in modes:
        out[mode] = model if mode == "eager" else optimize(
            copy.deepcopy(model), tuple(example_inputs) if example_inputs is not None else None, mode=mode)
    return out


# ------------------------------------------------------------------ measuring


def _peak_bytes(model: nn.Module, inputs: Sequence[Any]) -> Optional[int]:
    device = next((x.device for x in inputs if isinstance(x, torch.Tensor)), torch.device("cpu"))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        memory.train_step(model, inputs)
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    return memory.step_peak_bytes(lambda: memory.train_step(model, inputs))


def compare(variants: dict[str, nn.Module], inputs: Sequence[Any], repeats: int = 5,
            log: Callable[[str], None] = lambda s: None) -> list[Row]:
    """Measure every variant; the first one is the baseline of the ratios."""
    saved, resident, peak = {}, {}, {}
    for name, model in variants.items():
        log(f"measuring memory: {name}")
        memory.train_step(model, inputs)  # warm-up: allocator, kernels, compilation
        saved[name] = memory.saved_activation_bytes(model, inputs)
        memory.forward_resident_bytes(model, inputs)
        resident[name] = min(memory.forward_resident_bytes(model, inputs) for _ in range(2))
        peak[name] = _peak_bytes(model, inputs)
    log(f"timing train steps ({repeats} interleaved repeats)")
    times = memory.median_step_times(
        {name: (lambda m=model: memory.train_step(m, inputs)) for name, model in variants.items()},
        repeats=repeats)
    base = next(iter(variants))

    def ratio(values: dict, name: str) -> Optional[float]:
        if values[name] is None or not values[base]:
            return None
        return values[name] / values[base]

    return [Row(name, saved[name], resident[name], times[name], ratio(saved, name) or 0.0,
                ratio(resident, name) or 0.0, times[name] / times[base], peak[name], ratio(peak, name))
            for name in variants]


def render(rows: list[Row]) -> str:
    mib = 2 ** 20

    def size(n: Optional[int]) -> str:
        return "-" if n is None else f"{n / mib:.1f} MiB"

    def x(r: Optional[float]) -> str:
        return "-" if r is None else f"{r:.3f}"

    table = [(r.variant, size(r.saved_bytes), x(r.saved_ratio), size(r.resident_bytes), x(r.resident_ratio),
              size(r.peak_bytes), x(r.peak_ratio), f"{r.step_seconds * 1e3:.0f} ms", x(r.time_ratio)) for r in rows]
    return tabulate(table, headers=["variant", "saved for backward", "ratio", "resident at end of fwd", "ratio",
                                    "peak in step", "ratio", "train step", "ratio"])


def to_json(rows: list[Row]) -> list[dict]:
    return [asdict(r) for r in rows]
