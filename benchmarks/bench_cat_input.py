"""Concatenations rebuilt in backward (passes/cat_input.py): fxfuse mode="memory" with and without.

    python benchmarks/bench_cat_input.py [--models timm:densenet121,torchvision:densenet121]
        [--batch 8] [--size 224] [--repeats 3] [--saved-only]

For each model (random weights, train mode, float32, model and input channels_last): eager
channels_last, fxfuse `mode="memory"` without the cat_input pass ("memory, cats kept": fxfuse
before it) and with it ("memory"), measured in one process by fxfuse.bench.compare (saved bytes,
step peak, median step time over interleaved repeats), as ratios to eager channels_last.
`--saved-only` measures the saved bytes alone (one forward each); `--min-of N` times N interleaved
train steps per variant and prints each variant's fastest and median step (on a loaded machine the
fastest step says more than the median). Models: `timm:NAME`,
`torchvision:NAME`, or `wild:NAME` from tests/support/wild_zoo.py (e.g. wild:yolov8n).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402

import fxfuse  # noqa: E402
from fxfuse import bench, measure  # noqa: E402
from fxfuse.fusion import passes  # noqa: E402
from fxfuse.fusion.passes import cat_input  # noqa: E402

KEPT = "memory, cats kept"


def build(spec: str) -> torch.nn.Module:
    where, name = spec.split(":", 1)
    if where == "timm":
        import timm

        return timm.create_model(name)
    if where == "torchvision":
        import torchvision

        return torchvision.models.get_model(name, weights=None)
    if where == "wild":
        from support.wild_zoo import BY_NAME

        return BY_NAME[name].build()
    raise SystemExit(f"unknown model spec {spec!r}: timm:NAME, torchvision:NAME or wild:NAME")


def optimized(model: torch.nn.Module, x: torch.Tensor, with_cats: bool) -> torch.nn.Module:
    saved = passes.PASSES
    if not with_cats:
        passes.PASSES = tuple(p for p in saved if p.run is not cat_input.run)
    try:
        return fxfuse.optimize(copy.deepcopy(model), (x,), mode="memory")
    finally:
        passes.PASSES = saved


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="timm:densenet121,torchvision:densenet121")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--saved-only", action="store_true")
    parser.add_argument("--min-of", type=int, default=0)
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    cl = torch.channels_last
    for spec in args.models.split(","):
        torch.manual_seed(0)
        model = build(spec).train().to(memory_format=cl)
        x = torch.randn(args.batch, 3, args.size, args.size).contiguous(memory_format=cl)
        variants = {
            bench.EAGER_CHANNELS_LAST: model,
            KEPT: optimized(model, x, False),
            "memory": optimized(model, x, True),
        }
        sites = [s for s in variants["memory"].fxfuse_report.fused if s.pattern == cat_input.PATTERN]
        moved = sum(s.recompute_bytes or 0 for s in sites)
        print(f"\n{spec}, batch {args.batch} at {args.size}², float32, channels_last, train mode")
        print(f"{len(sites)} concatenations rebuilt in backward, {moved / 2**20:.1f} MiB moved per step")
        if args.saved_only:
            eager = measure.saved_activation_bytes(model, (x,))
            for name in (KEPT, "memory"):
                saved = measure.saved_activation_bytes(variants[name], (x,))
                print(f"{name}: saved {saved / 2**20:.1f} MiB, {saved / eager:.3f}x eager's {eager / 2**20:.1f} MiB")
            continue
        if args.min_of:
            times: dict = {name: [] for name in variants}
            for variant in variants.values():
                measure.train_step(variant, (x,))  # warm-up
            for _ in range(args.min_of):
                for name, variant in variants.items():
                    start = time.perf_counter()
                    measure.train_step(variant, (x,))
                    times[name].append(time.perf_counter() - start)
            fastest = min(times[bench.EAGER_CHANNELS_LAST])
            for name, ts in times.items():
                ts.sort()
                median = ts[len(ts) // 2]
                print(f"{name}: fastest {ts[0] * 1e3:.0f} ms ({ts[0] / fastest:.3f}x), median {median * 1e3:.0f} ms")
            continue
        rows = bench.compare(variants, (x,), repeats=args.repeats, log=lambda s: print(s, file=sys.stderr))
        print(bench.render(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
