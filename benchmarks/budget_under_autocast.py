"""What fxfuse's plans keep under autocast, as a fraction of what eager autocast keeps.

    python benchmarks/budget_under_autocast.py [--model resnet18] [--shape 8,3,96,96] [--budgets 0.5,0.3]

Prints, for `mode="memory"` and each `memory_budget`, the saved-for-backward bytes with and without
CPU bfloat16 autocast (fxfuse.measure.saved_activation_bytes), as ratios to eager's in the same
precision: for plans made outside autocast (counted in float32), and for plans made inside it
(counted under bf16 autocast, as optimize does when called there).
"""

from __future__ import annotations

import argparse
import copy

import torch
import torchvision

import fxfuse
from fxfuse import measure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--shape", default="8,3,96,96")
    parser.add_argument("--budgets", default="0.5,0.3")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = getattr(torchvision.models, args.model)().to(memory_format=torch.channels_last)
    x = torch.randn(*map(int, args.shape.split(","))).contiguous(memory_format=torch.channels_last)
    plans = [{"mode": "memory"}] + [{"memory_budget": float(b)} for b in args.budgets.split(",")]
    for planned_under in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=planned_under):
            optimized = [fxfuse.optimize(copy.deepcopy(model), (x,), **plan) for plan in plans]
        print(f"plans made {'inside bf16 autocast' if planned_under else 'without autocast'}:")
        for amp in (False, True):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                eager = measure.saved_activation_bytes(model, (x,))
                ratios = [measure.saved_activation_bytes(m, (x,)) / eager for m in optimized]
            label = "bf16 autocast" if amp else "no autocast  "
            cells = ", ".join(f"{k}={v}: {r:.3f}" for p, r in zip(plans, ratios) for k, v in p.items())
            print(f"  {label}  eager {eager / 2**20:.1f} MiB  {cells}")


if __name__ == "__main__":
    main()
