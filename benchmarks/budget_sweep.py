"""What each memory budget selects, counted on the meta device, and how long optimize takes to choose it.

    python benchmarks/budget_sweep.py [--models resnet50,efficientnet_b0,convnext_tiny,densenet121]
                                      [--batch 8] [--size 224] [--budgets 0.5,0.45,...,0.1]

For each model (random weights, channels_last, float32, train mode) and budget: the selected saved
activations and step peak as ratios to eager's (fxfuse.explain: no real compute), and whether both
never rise as the budget tightens. Then the wall time of one fxfuse.optimize(model, x, memory_budget=B)
for the first and the tightest budget.
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
    args = parser.parse_args(argv)
    budgets = [float(b) for b in args.budgets.split(",")]
    x = torch.randn(args.batch, 3, args.size, args.size).to(memory_format=torch.channels_last)
    failed = False
    for name in args.models.split(","):
        torch.manual_seed(0)
        model = MODELS[name]().to(memory_format=torch.channels_last)
        reports = [fxfuse.explain(model, x, memory_budget=b) for b in budgets]
        saved = [r.selected_saved_bytes / r.eager_saved_bytes for r in reports]
        peak = [r.selected_peak_bytes / r.eager_peak_bytes for r in reports]
        monotone = _never_rises(saved) and _never_rises(peak)
        failed |= not monotone
        print(f"{name}: {'monotone' if monotone else 'NOT MONOTONE'} (budget: saved / peak)")
        print("  " + "  ".join(f"{b}: {s:.3f} / {p:.3f}" for b, s, p in zip(budgets, saved, peak)))
        for b in (budgets[0], budgets[-1]):
            start = time.perf_counter()
            fxfuse.optimize(MODELS[name]().to(memory_format=torch.channels_last), x, memory_budget=b)
            print(f"  optimize(memory_budget={b}): {time.perf_counter() - start:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
