"""Memory budgets on a wild-zoo model (tests/support/wild_zoo.py), counted and measured.

    python benchmarks/wild_budget.py [--model yolov8n] [--batch 4] [--size 256] [--budgets 0.5,0.3]

For each budget: fxfuse.optimize(model, x, memory_budget=B) in train mode, float32; what the report
counted on the meta device, and the saved-for-backward bytes measured on a real forward
(fxfuse.measure.saved_activation_bytes), both as ratios to eager.
"""

from __future__ import annotations

import argparse
import copy
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402
from support.wild_zoo import BY_NAME  # noqa: E402

import fxfuse  # noqa: E402
from fxfuse import measure  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="yolov8n")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--budgets", default="0.5,0.3")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    entry = BY_NAME[args.model]
    model, x = entry.build().train(), entry.example_input(batch=args.batch, size=args.size)
    eager = measure.saved_activation_bytes(copy.deepcopy(model), (x,))
    print(f"{args.model}, train mode, batch {args.batch} at {args.size}², float32; eager saves {eager / 2**20:.1f} MiB")
    for budget in (float(b) for b in args.budgets.split(",")):
        optimized = fxfuse.optimize(copy.deepcopy(model), (x,), memory_budget=budget)
        measured = measure.saved_activation_bytes(optimized, (x,)) / eager
        verdict = next((n for n in optimized.fxfuse_report.notes if n.startswith("memory budget")), "")
        print(f"budget {budget}: measured {measured:.3f}x; report: {verdict}")
    return 0


if __name__ == "__main__":
    torch.set_num_threads(2)
    sys.exit(main())
