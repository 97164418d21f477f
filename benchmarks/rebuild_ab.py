"""What the rebuild of BN→activation outputs (ops/rebuild.py, passes/rebuild.py) frees and costs, in one process.

    python benchmarks/rebuild_ab.py [--model timm.models.vovnet:ese_vovnet19b_dw] [--budget 0.4] [--rounds 31]

Variants, model and input channels_last, batch 8 at 224², float32: eager; fxfuse mode="fast" without and
with the rebuild (`Plan(rebuild=True)`, no other change); `memory_budget=BUDGET` as fxfuse chooses it, and
as it chose before the rebuild existed (the ranking built without its entry); torch.compile with
`activation_memory_budget=0.5`. Prints each variant's saved activations (`fxfuse.measure`, unique storages
through `saved_tensors_hooks`) and its median train step over interleaved rounds, both as ratios to eager's,
with the step's interquartile range over its median.
"""

from __future__ import annotations

import argparse
import copy
import importlib
from unittest import mock

import torch

from fxfuse import bench
from fxfuse.commands._common import load_model
from fxfuse.fusion import policy
from fxfuse.fusion.plan import Options, Plan
from fxfuse.measure import memory

optimize_module = importlib.import_module("fxfuse.fusion.optimize")


def _fast(model, x, rebuild: bool):
    optimized = copy.deepcopy(model).to(memory_format=torch.channels_last)
    optimize_module._run(optimized, (x,), Options("fast", Plan(rebuild=rebuild)), install=True)
    return optimized


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="timm.models.vovnet:ese_vovnet19b_dw")
    parser.add_argument("--budget", type=float, default=0.4)
    parser.add_argument("--rounds", type=int, default=31)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = load_model(args.model).train()
    x = torch.randn(8, 3, 224, 224)
    cl = torch.channels_last
    xs = x.contiguous(memory_format=cl)
    variants = {
        "eager channels_last": bench.make_variant("eager-channels_last", model, (x,), cl),
        "fxfuse fast": _fast(model, xs, False),
        "fxfuse fast + rebuild": _fast(model, xs, True),
        f"fxfuse budget {args.budget}": bench.make_variant(f"budget={args.budget}", model, (x,), cl),
    }
    with mock.patch.object(policy, "_rebuild_entry", lambda *a: (None, None)):
        variants[f"fxfuse budget {args.budget}, no rebuild"] = bench.make_variant(
            f"budget={args.budget}", model, (x,), cl
        )
    variants["compile budget 0.5"] = bench.make_variant("compile-budget=0.5", model, (x,), cl)
    eager = memory.saved_activation_bytes(variants["eager channels_last"], (xs,))
    saved = {name: memory.saved_activation_bytes(m, (xs,)) / eager for name, m in variants.items()}
    steps = {name: (lambda m=m: memory.train_step(m, (xs,))) for name, m in variants.items()}
    spread: dict[str, float] = {}
    times = memory.median_step_times(steps, repeats=args.rounds, warmup=2, spread=spread)
    base = times["eager channels_last"]
    print(f"{args.model}, 8x3x224x224 channels_last, {torch.get_num_threads()} threads, {args.rounds} rounds")
    print(f"{'variant':40s} {'saved':>6s} {'step':>6s}  (IQR)")
    for name in variants:
        print(f"{name:40s} {saved[name]:6.3f} {times[name] / base:6.3f}  ({spread[name] * 100:.0f}%, "
              f"{times[name] * 1e3:.0f} ms)")  # fmt: skip


if __name__ == "__main__":
    main()
