"""What a recompute region's machinery costs the host, beyond the ops it runs.

    python benchmarks/region_overhead.py [--pairs 1,3,6,12] [--calls 300] [--rounds 7] [--instructions]

A memory budget's regions (fusion/regions/recompute.py) run under fxfuse's lean non-reentrant
checkpoint (fusion/regions/checkpointed.py): a saved-tensor hook pair per tensor the region's ops
keep, the RNG state saved and restored, the recompute run from a hook in backward. On tiny tensors,
where the ops cost next to nothing, this times a region of n pairs of (1×1 conv, ReLU) at 2×8×4×4,
forward and backward, three ways: called directly, under `torch.utils.checkpoint`
(use_reentrant=False), and as fxfuse's `RegionCall` (the lean checkpoint plus the buffer swap that
keeps running statistics from a second update). µs of the thread's CPU time a call (median of
interleaved rounds), or with --instructions thousands of instructions (benchmarks/instructions.py),
and Python calls. What a call adds beyond the direct one is the recompute's ops plus the machinery;
the last lines fit it as a part per call and a part per pair, over the region sizes given.
"""

from __future__ import annotations

import argparse
import types
from typing import Callable

import instructions
import torch
import torch.nn.functional as F
from tabulate import tabulate
from torch.utils.checkpoint import checkpoint

from fxfuse.fusion.regions.recompute import RegionCall
from fxfuse.measure import python_calls


def variants(pairs: int) -> dict[str, Callable[[], None]]:
    torch.manual_seed(0)
    x = torch.randn(2, 8, 4, 4, requires_grad=True)
    weights = [torch.randn(8, 8, 1, 1, requires_grad=True) for _ in range(pairs)]
    owner = types.SimpleNamespace(**{f"w{i}": w for i, w in enumerate(weights)})

    def body(owner, t):
        for i in range(pairs):
            t = torch.relu(F.conv2d(t, getattr(owner, f"w{i}")))
        return t

    region = RegionCall(f"{pairs} × (conv, relu)", body, [f"w{i}" for i in range(pairs)], [])
    return {
        "direct": lambda: body(owner, x).sum().backward(),
        "torch.utils.checkpoint": lambda: checkpoint(body, owner, x, use_reentrant=False).sum().backward(),
        "fxfuse RegionCall": lambda: region(weights, x).sum().backward(),
    }


def _fit(sizes: list[int], extra: list[float]) -> tuple[float, float]:
    """Least squares of extra = per_call + per_pair × size."""
    n = len(sizes)
    mean_s, mean_e = sum(sizes) / n, sum(extra) / n
    spread = sum((s - mean_s) ** 2 for s in sizes)
    per_pair = sum((s - mean_s) * (e - mean_e) for s, e in zip(sizes, extra)) / spread if spread else 0.0
    return mean_e - per_pair * mean_s, per_pair


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", default="1", help="region sizes, comma-separated (default 1)")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=7)
    args = instructions.parse_args(parser)
    torch.set_num_threads(1)
    sizes = [int(p) for p in args.pairs.split(",")]
    unit = "k instructions" if instructions.active() else "µs"
    rows, extra = [], {}
    for pairs in sizes:
        fns = variants(pairs)
        measured = instructions.rounds(fns, args.calls, args.rounds, warmup=20)
        costs = {name: total for name, (total, _) in measured.items()}
        for name, c in costs.items():
            rows.append([pairs, name, f"{c:.0f}", f"{c - costs['direct']:.0f}", python_calls(fns[name])])
            extra.setdefault(name, []).append(c - costs["direct"])
    print(f"a region of n (1×1 conv, ReLU) pairs (2×8×4×4), forward + backward, one thread: {unit} a call")
    print(tabulate(rows, headers=["n", "call", unit, "beyond direct", "Python calls"], tablefmt="github"))
    if len(sizes) > 1:
        for name in ("torch.utils.checkpoint", "fxfuse RegionCall"):
            per_call, per_pair = _fit(sizes, extra[name])
            print(f"{name}: beyond direct ≈ {per_call:.0f} a call + {per_pair:.0f} a pair ({unit})")


if __name__ == "__main__":
    main()
