"""Where an optimized train step's time goes against eager's: `torch.profiler` self time per op,
the mean of a few steps of each, eager and fxfuse interleaved in one process.

    python benchmarks/profile_step.py [--model torchvision:densenet121] [--budget 0.5] [--mode memory]
        [--batch 8] [--size 224] [--steps 3] [--rows 25]

Channels_last, float32, random weights. Prints each model's total self time and the ops whose
self time differs most between the two (eager's ATen ops, fxfuse's ops and the autograd nodes
around them), in milliseconds.
"""

from __future__ import annotations

import argparse
import collections
import copy

import torch
from torch.profiler import ProfilerActivity, profile

import fxfuse
from fxfuse.commands._common import load_model


def _self_times(model, x, steps: int) -> collections.Counter:
    model(x).sum().backward()
    total: collections.Counter = collections.Counter()
    for _ in range(steps):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model(x).sum().backward()
        for event in prof.key_averages():
            total[event.key] += event.self_cpu_time_total / 1e3 / steps
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="torchvision:densenet121")
    parser.add_argument("--budget", type=float, default=0.5, help="memory_budget (0: none, use --mode)")
    parser.add_argument("--mode", default="memory")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=25)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = load_model(args.model).to(memory_format=torch.channels_last)
    x = torch.randn(args.batch, 3, args.size, args.size).contiguous(memory_format=torch.channels_last)
    options = {"memory_budget": args.budget} if args.budget else {"mode": args.mode}
    optimized = fxfuse.optimize(copy.deepcopy(model), x, **options)

    times = {"eager": collections.Counter(), "fxfuse": collections.Counter()}
    for _ in range(args.steps):
        for name, m in (("eager", model), ("fxfuse", optimized)):
            times[name].update({k: v / args.steps for k, v in _self_times(m, x, 1).items()})
    for name, counter in times.items():
        print(f"{name}: {sum(counter.values()):.1f} ms self time per step")
    keys = set(times["eager"]) | set(times["fxfuse"])
    print(f"{'eager':>9} {'fxfuse':>9}  op")
    for key in sorted(keys, key=lambda k: -abs(times["fxfuse"][k] - times["eager"][k]))[: args.rows]:
        print(f"{times['eager'][key]:9.1f} {times['fxfuse'][key]:9.1f}  {key[:100]}")


if __name__ == "__main__":
    main()
