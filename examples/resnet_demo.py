"""`make demo`: optimize a torchvision ResNet on synthetic data; print the fusion report and a
memory/time table against eager, measured side by side in this process.

    python examples/resnet_demo.py [--model resnet18] [--batch 8] [--size 128]
"""
from __future__ import annotations

import argparse
import copy

from fxfuse.measure.bench import ensure_malloc_env

ensure_malloc_env()

import torch  # noqa: E402
import torchvision  # noqa: E402

import fxfuse  # noqa: E402
from fxfuse.measure import bench  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=128)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = torchvision.models.get_model(args.model, weights=None)
    x = torch.randn(args.batch, 3, args.size, args.size)
    optimized = fxfuse.optimize(copy.deepcopy(model), x)
    print(optimized.fxfuse_report, end="\n\n")
    print(f"{args.model}, batch {args.batch}, {args.size}x{args.size}, float32, CPU "
          f"({torch.get_num_threads()} threads):")
    print(bench.render(bench.compare({"eager": model, "fxfuse (memory)": optimized}, (x,), repeats=3)))


if __name__ == "__main__":
    main()
