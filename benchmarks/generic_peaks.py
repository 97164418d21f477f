"""Memory of fxfuse's device-generic implementations (what CUDA and other devices run) against
eager's ATen composition of the same work, measured on CPU with the allocator's events.

    python benchmarks/generic_peaks.py [--size 16] [--channels-last]

One row per op family (tests/support/generic_peaks.py): forward peak, saved bytes and backward peak
(KiB) of eager, of the generic path (fxfuse.ops.generic_path()) and of the hand-written CPU
kernels; then one row per primitive op call. The README's table is this output.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the cases live with the tests
from support import generic_peaks as gp  # noqa: E402

from fxfuse.ops import generic_path  # noqa: E402


def kib(n: int) -> str:
    return f"{n / 1024:.0f}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", type=int, default=16)
    p.add_argument("--channels-last", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    print("| op family | eager fwd / saved / bwd | generic fwd / saved / bwd | CPU kernels fwd / saved / bwd |")
    print("|---|---|---|---|")
    for case in gp.step_cases(torch.float32, args.channels_last, args.size):
        eager = gp.measure_step(case.eager, case.leaves, case.dy)
        with generic_path():
            generic = gp.measure_step(case.fused, case.leaves, case.dy)
        kernels = gp.measure_step(case.fused, case.leaves, case.dy)
        cells = [
            " / ".join(kib(v) for v in (u.forward_peak, u.saved, u.backward_peak)) for u in (eager, generic, kernels)
        ]
        print(f"| {case.name} | " + " | ".join(cells) + " |")
    print()
    print("| op call | dtype | eager | generic | CPU kernels |")
    print("|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        for case in gp.call_cases(dtype, args.channels_last, args.size):
            eager = gp.measure_call(case.eager)
            with generic_path():
                generic = gp.measure_call(case.fused)
            kernels = gp.measure_call(case.fused)
            name = str(dtype).removeprefix("torch.")
            print(f"| {case.name} | {name} | {kib(eager)} | {kib(generic)} | {kib(kernels)} |")


if __name__ == "__main__":
    main()
