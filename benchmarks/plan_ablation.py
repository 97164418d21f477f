"""What each part of a budget's plan costs: the plan as chosen, and the plan less each group of regions in turn.

    python benchmarks/plan_ablation.py [--model timm.models.dla:dla34] [--budget 0.45] [--rounds 15]

Variants, model and input channels_last, batch 8 at 224², float32, one process: eager; the plan
`memory_budget=BUDGET` chooses; the same plan without each of its region groups (`Plan.regions`, links that
touch the group dropped with it); the plan's rebuild alone (no regions); torch.compile with
`activation_memory_budget=0.5`. Prints each variant's saved activations (`fxfuse.measure`) and its median
train step over interleaved rounds, both as ratios to eager's, with the step's interquartile range.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib

import torch

from fxfuse import bench
from fxfuse.commands._common import load_model
from fxfuse.fusion.capture import Captures
from fxfuse.fusion.plan import Options
from fxfuse.measure import memory

optimize_module = importlib.import_module("fxfuse.fusion.optimize")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="timm.models.dla:dla34")
    parser.add_argument("--budget", type=float, default=0.45)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = load_model(args.model).train()
    cl = torch.channels_last
    x = torch.randn(8, 3, 224, 224)
    xs = x.contiguous(memory_format=cl)
    base = copy.deepcopy(model).to(memory_format=cl)
    tree = optimize_module._roots(base, (xs,), Captures())
    plan = optimize_module._plan(base, (xs,), "memory", args.budget, None, tree).plan

    def build(p):
        optimized = copy.deepcopy(model).to(memory_format=cl)
        optimize_module._run(optimized, (xs,), Options("memory", p, args.budget), install=True)
        return optimized

    variants = {"eager channels_last": bench.make_variant("eager-channels_last", model, (x,), cl), "plan": build(plan)}
    for group in plan.regions:
        regions = tuple(g for g in plan.regions if g != group)
        links = frozenset(link for link in plan.flat_links if not set(link) & set(group))
        variants[f"without {'+'.join(group)}"] = build(dataclasses.replace(plan, regions=regions, flat_links=links))
    variants["rebuild alone"] = build(dataclasses.replace(plan, regions=(), flat_links=frozenset()))
    variants["compile budget 0.5"] = bench.make_variant("compile-budget=0.5", model, (x,), cl)
    eager = memory.saved_activation_bytes(variants["eager channels_last"], (xs,))
    saved = {name: memory.saved_activation_bytes(m, (xs,)) / eager for name, m in variants.items()}
    steps = {name: (lambda m=m: memory.train_step(m, (xs,))) for name, m in variants.items()}
    spread: dict[str, float] = {}
    times = memory.median_step_times(steps, repeats=args.rounds, warmup=2, spread=spread)
    base_time = times["eager channels_last"]
    print(f"{args.model}, budget {args.budget}: regions {plan.regions}, rebuild {plan.rebuild}")
    for name in variants:
        print(f"{name:60s} {saved[name]:6.3f} {times[name] / base_time:6.3f}  ({spread[name] * 100:.0f}%, "
              f"{times[name] * 1e3:.0f} ms)")  # fmt: skip


if __name__ == "__main__":
    main()
