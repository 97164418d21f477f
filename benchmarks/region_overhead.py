"""What a recompute region's machinery costs the host, beyond the ops it runs.

    python benchmarks/region_overhead.py [--calls 300] [--rounds 7] [--instructions]

A memory budget's regions (fusion/regions/recompute.py) run under non-reentrant
`torch.utils.checkpoint`: a saved-tensor hook pair per tensor the region's ops keep, the RNG and
autocast state saved and restored, the recompute run from a hook in backward. On tiny tensors,
where the ops cost next to nothing, this times one two-op region (1×1 conv, ReLU; forward and
backward) three ways: called directly, under `torch.utils.checkpoint`, and as fxfuse's
`RegionCall` (checkpoint plus the buffer swap that keeps running statistics from a second
update). µs of the thread's CPU time a call (median of interleaved rounds), or with
--instructions thousands of instructions (benchmarks/instructions.py), and Python calls.
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


def variants() -> dict[str, Callable[[], None]]:
    torch.manual_seed(0)
    x = torch.randn(2, 8, 4, 4, requires_grad=True)
    w = torch.randn(8, 8, 1, 1, requires_grad=True)
    owner = types.SimpleNamespace(w=w)

    def body(owner, t):
        return torch.relu(F.conv2d(t, owner.w))

    region = RegionCall("conv, relu", body, ["w"], [])
    return {
        "direct": lambda: body(owner, x).sum().backward(),
        "torch.utils.checkpoint": lambda: checkpoint(body, owner, x, use_reentrant=False).sum().backward(),
        "fxfuse RegionCall": lambda: region([w], x).sum().backward(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=7)
    args = instructions.parse_args(parser)
    torch.set_num_threads(1)
    fns = variants()
    costs = {name: total for name, (total, _) in instructions.rounds(fns, args.calls, args.rounds, warmup=20).items()}
    unit = "k instructions" if instructions.active() else "µs"
    rows = [[name, f"{c:.0f}", f"{c - costs['direct']:.0f}", python_calls(fns[name])] for name, c in costs.items()]
    print(f"one two-op region (2×8×4×4), forward + backward, one thread: {unit} a call")
    print(tabulate(rows, headers=["call", unit, "beyond direct", "Python calls"], tablefmt="github"))


if __name__ == "__main__":
    main()
