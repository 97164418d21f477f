"""What each memory budget selects, counted on the meta device, and how long optimize takes to choose it.

    python benchmarks/budget_sweep.py [--models resnet50,efficientnet_b0,convnext_tiny,densenet121]
                                      [--batch 8] [--size 224] [--budgets 0.5,0.45,...,0.1]
                                      [--peak-budget P | --peak-budgets 0.6,0.5,...]

For each model (random weights, channels_last, float32, train mode) and budget: the selected saved
activations and step peak as ratios to eager's (fxfuse.explain: no real compute), and whether both
never rise as the budget tightens. Then the wall time of one fxfuse.optimize(model, x, memory_budget=B)
for the first and the tightest budget. With --peak-budget P, every memory budget is given with
peak_budget=P; with --peak-budgets, peak_budget alone is swept instead of memory_budget.
"""

from __future__ import annotations

import argparse
import time

import torch
import torchvision

import fxfuse

MODELS = {
    "resnet50": torchvision.models.resnet50,
    "efficientnet_b0": torchvision.models.efficientnet_b0,
    "convnext_tiny": torchvision.models.convnext_tiny,
    "densenet121": torchvision.models.densenet121,
}


def _never_rises(values: list[float]) -> bool:
    return all(a >= b for a, b in zip(values, values[1:]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--budgets", default="0.5,0.45,0.4,0.35,0.3,0.25,0.2,0.15,0.1")
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--peak-budget", type=float, help="give every memory budget with this peak_budget")
    how.add_argument("--peak-budgets", help="sweep peak_budget alone over these (no memory_budget)")
    args = parser.parse_args(argv)
    if args.peak_budgets:
        budgets = [float(b) for b in args.peak_budgets.split(",")]
        options = [{"peak_budget": b} for b in budgets]
    else:
        budgets = [float(b) for b in args.budgets.split(",")]
        extra = {} if args.peak_budget is None else {"peak_budget": args.peak_budget}
        options = [{"memory_budget": b, **extra} for b in budgets]
    x = torch.randn(args.batch, 3, args.size, args.size).to(memory_format=torch.channels_last)
    failed = False
    for name in args.models.split(","):
        torch.manual_seed(0)
        model = MODELS[name]().to(memory_format=torch.channels_last)
        reports = [fxfuse.explain(model, x, **o) for o in options]
        saved = [r.selected_saved_bytes / r.eager_saved_bytes for r in reports]
        peak = [r.selected_peak_bytes / r.eager_peak_bytes for r in reports]
        monotone = _never_rises(saved) and _never_rises(peak)
        failed |= not monotone
        print(f"{name}: {'monotone' if monotone else 'NOT MONOTONE'} (budget: saved / peak)")
        print("  " + "  ".join(f"{b}: {s:.3f} / {p:.3f}" for b, s, p in zip(budgets, saved, peak)))
        for o in (options[0], options[-1]):
            start = time.perf_counter()
            fxfuse.optimize(MODELS[name]().to(memory_format=torch.channels_last), x, **o)
            given = ", ".join(f"{k}={v}" for k, v in o.items())
            print(f"  optimize({given}): {time.perf_counter() - start:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
