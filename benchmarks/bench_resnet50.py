"""ResNet-50, batch 8, 224x224, float32, CPU: eager vs fxfuse.optimize, side by side in one process.

    python benchmarks/bench_resnet50.py [--batch 8] [--size 224] [--repeats 5] [--mode memory]

Prints saved activation bytes, resident memory at the end of forward, and median
train-step time, each with its ratio to eager.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys

if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":  # freed blocks must return to the OS for RSS
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    os.execv(sys.executable, [sys.executable, *sys.argv])

import torch  # noqa: E402
import torchvision  # noqa: E402
from tabulate import tabulate  # noqa: E402

import fxfuse  # noqa: E402
from fxfuse import measure  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mode", default="memory")
    args = parser.parse_args()

    torch.manual_seed(0)
    eager = torchvision.models.get_model(args.model, weights=None)
    fused = fxfuse.optimize(copy.deepcopy(eager), mode=args.mode)
    x = torch.randn(args.batch, 3, args.size, args.size)
    models = {"eager": eager, "fxfuse": fused}
    print(f"{args.model} batch {args.batch} {args.size}x{args.size} float32, mode={args.mode}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads", file=sys.stderr)

    saved = {k: measure.saved_activation_bytes(m, (x,)) for k, m in models.items()}
    rss = {}
    for k, m in models.items():
        measure.forward_resident_bytes(m, (x,))  # warm the allocator and kernels
        rss[k] = min(measure.forward_resident_bytes(m, (x,)) for _ in range(2))
    times = measure.median_step_times({k: (lambda m=m: measure.train_step(m, (x,))) for k, m in models.items()},
                                      repeats=args.repeats)
    rows = []
    for k in models:
        rows.append((k, f"{saved[k] / 2**20:.1f} MiB", f"{saved[k] / saved['eager']:.3f}",
                     f"{rss[k] / 2**20:.1f} MiB", f"{rss[k] / rss['eager']:.3f}",
                     f"{times[k] * 1e3:.0f} ms", f"{times[k] / times['eager']:.3f}"))
    print(tabulate(rows, headers=["model", "saved for backward", "ratio", "RSS end of forward", "ratio",
                                  "train step", "ratio"]))


if __name__ == "__main__":
    main()
