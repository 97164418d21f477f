"""Measuring what fxfuse changes, the same way everywhere (tests, benchmarks, CLI, examples).

`fxfuse.measure` holds the memory and time measurements (`memory.py`) and the step
peak counted on a meta-device copy (`peak.py`); `fit.py` finds the largest batch within a
memory cap, counted on meta or measured with real steps (`largest_batch`). The side-by-side
benchmark built on them (`fxfuse bench`) is `fxfuse.bench`, above `fxfuse.fusion`, which
imports this package.
"""

from .fit import largest_batch
from .memory import (
    Autocast,
    autocast_in_effect,
    counted_run,
    counting_autocast,
    counting_under,
    forward_allocated_bytes,
    forward_resident_bytes,
    median_step_times,
    meta_copy,
    minor_faults,
    python_calls,
    rss_bytes,
    saved_activation_bytes,
    saved_activation_bytes_meta,
    step_allocated_peak_bytes,
    step_peak_bytes,
    synchronize,
    timed,
    to_meta,
    train_step,
)
from .peak import PeakParts, step_peak_bytes_meta, step_peak_parts_meta

__all__ = [
    "Autocast",
    "autocast_in_effect",
    "counted_run",
    "counting_autocast",
    "counting_under",
    "PeakParts",
    "forward_allocated_bytes",
    "forward_resident_bytes",
    "largest_batch",
    "median_step_times",
    "meta_copy",
    "minor_faults",
    "python_calls",
    "rss_bytes",
    "saved_activation_bytes",
    "saved_activation_bytes_meta",
    "step_allocated_peak_bytes",
    "step_peak_bytes",
    "step_peak_bytes_meta",
    "step_peak_parts_meta",
    "synchronize",
    "timed",
    "to_meta",
    "train_step",
]
