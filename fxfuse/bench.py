"""Side-by-side measurement of eager and fxfuse variants of one model, in one process.

Used by `fxfuse bench`, `make demo` and the benchmark scripts, so every number in the
README comes from the same code. Each row is also given as a ratio to eager.
Resident-memory numbers need MALLOC_MMAP_THRESHOLD_=65536 in the environment at
process start (see `ensure_malloc_env`).
"""
from __future__ import annotations

import copy
import os
import sys
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

from tabulate import tabulate
from torch import nn

from . import measure
from .fusion import optimize


def ensure_malloc_env() -> None:
    """Re-exec the current process with MALLOC_MMAP_THRESHOLD_=65536 so freed memory returns to the OS."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
        os.execv(sys.executable, [sys.executable, *sys.argv])


@dataclass
class Row:
    variant: str
    saved_bytes: int
    resident_bytes: int
    step_seconds: float
    saved_ratio: float = 1.0
    resident_ratio: float = 1.0
    time_ratio: float = 1.0


def variants_for(model: nn.Module, modes: Sequence[str]) -> dict[str, nn.Module]:
    out: dict[str, nn.Module] = {}
    for mode in modes:
        out[mode] = model if mode == "eager" else optimize(copy.deepcopy(model), mode=mode)
    return out


def compare(variants: dict[str, nn.Module], inputs: Sequence[Any], repeats: int = 5,
            log: Callable[[str], None] = lambda s: None) -> list[Row]:
    """Measure every variant; the first one is the baseline of the ratios."""
    saved, resident = {}, {}
    for name, model in variants.items():
        log(f"measuring memory: {name}")
        saved[name] = measure.saved_activation_bytes(model, inputs)
        measure.forward_resident_bytes(model, inputs)  # warm-up: allocator, kernels
        resident[name] = min(measure.forward_resident_bytes(model, inputs) for _ in range(2))
    log(f"timing train steps ({repeats} interleaved repeats)")
    times = measure.median_step_times(
        {name: (lambda m=model: measure.train_step(m, inputs)) for name, model in variants.items()},
        repeats=repeats)
    base = next(iter(variants))
    return [Row(name, saved[name], resident[name], times[name], saved[name] / max(saved[base], 1),
                resident[name] / max(resident[base], 1), times[name] / times[base]) for name in variants]


def render(rows: list[Row]) -> str:
    mib = 2 ** 20
    table = [(r.variant, f"{r.saved_bytes / mib:.1f} MiB", f"{r.saved_ratio:.3f}", f"{r.resident_bytes / mib:.1f} MiB",
              f"{r.resident_ratio:.3f}", f"{r.step_seconds * 1e3:.0f} ms", f"{r.time_ratio:.3f}") for r in rows]
    return tabulate(table, headers=["variant", "saved for backward", "ratio", "resident at end of fwd", "ratio",
                                    "train step", "ratio"])


def to_json(rows: list[Row]) -> list[dict]:
    return [asdict(r) for r in rows]
