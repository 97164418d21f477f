"""ResNet-50, batch 8, 224x224, float32, CPU: eager vs fxfuse.optimize, side by side in one process.

    python benchmarks/bench_resnet50.py [--model resnet50] [--batch 8] [--size 224] [--repeats 5] [--modes eager,memory]

Prints saved activation bytes, resident memory at the end of forward, and median
train-step time, each with its ratio to eager. Targets (issue: core): saved <= 0.50x,
resident <= 0.55x, step time <= 1.25x.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torchvision

from fxfuse import bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--modes", default="eager,memory")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = torchvision.models.get_model(args.model, weights=None)
    x = torch.randn(args.batch, 3, args.size, args.size)
    print(
        f"{args.model} batch {args.batch} {args.size}x{args.size} float32, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads",
        file=sys.stderr,
    )
    variants = bench.variants_for(model, args.modes.split(","))
    rows = bench.compare(variants, (x,), repeats=args.repeats, log=lambda s: print(s, file=sys.stderr))
    print(bench.render(rows))


if __name__ == "__main__":
    main()
