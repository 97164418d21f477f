"""GELU family, float32, CPU: eager vs fxfuse side by side in one process, with the issue's targets.

    python benchmarks/bench_gelu.py [--only convnext,vit,bn_gelu,efficientnet,gelu] [--repeats 5]

Sections (each prints a table and its targets):
  convnext      convnext_tiny, batch 4, 224x224, mode="memory": saved activations <= 0.75x eager
  vit           vit_b_16, batch 2, 224x224, mode="memory": saved activations <= 0.85x eager
  bn_gelu       BatchNorm2d(64) -> GELU on [16, 64, 56, 56], forward + backward, mode="fast": <= 0.75x eager time
  efficientnet  efficientnet_b0, batch 4, 224x224, mode="fast": <= 0.85x eager saved bytes at <= 1.0x step time
  gelu          standalone GELU: fxfuse.ops.gelu vs F.gelu, forward + backward, by layout, approximation, size
                (where the standalone-GELU pass's choice comes from)
Times are medians of interleaved repeats, so drift hits eager and fxfuse alike.
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch
import torch.nn.functional as F
import torchvision
from tabulate import tabulate
from torch import nn

import fxfuse
from fxfuse import bench, measure

SECTIONS = ("convnext", "vit", "bn_gelu", "efficientnet", "gelu")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def target(label: str, value: float, limit: float) -> str:
    return f"target {label} <= {limit:.2f}x: {value:.3f}x -> {'met' if value <= limit else 'NOT met'}"


def model_section(name: str, batch: int, size: int, mode: str, repeats: int) -> list:
    torch.manual_seed(0)
    model = torchvision.models.get_model(name, weights=None)
    x = torch.randn(batch, 3, size, size)
    variants = {"eager": model, mode: fxfuse.optimize(copy.deepcopy(model), x, mode=mode)}
    report = variants[mode].fxfuse_report
    ops = sorted({s.op for s in report.fused})
    log(f"{name}: {len(report.fused)} sites fused ({', '.join(ops)}), {len(report.skipped)} skipped")
    rows = bench.compare(variants, (x,), repeats=repeats, log=log)
    print(f"\n{name}, batch {batch}, {size}x{size}, mode={mode!r}: {len(report.fused)} sites fused")
    print(bench.render(rows))
    return rows


def bn_gelu_section(repeats: int, channels_last: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm2d(64), nn.GELU())
    x = torch.randn(16, 64, 56, 56, requires_grad=True)
    if channels_last:
        x = x.detach().to(memory_format=torch.channels_last).requires_grad_()
    fast = fxfuse.optimize(copy.deepcopy(model), x, mode="fast")
    assert [s.op for s in fast.fxfuse_report.fused] == ["fxfuse::batch_norm_act"], fast.fxfuse_report
    grad = torch.randn_like(x)

    def step(m):
        def run():
            x.grad = None
            m(x).backward(grad)

        return run

    times = measure.median_step_times({"eager": step(model), "fast": step(fast)}, repeats=repeats, warmup=2)
    ratio = times["fast"] / times["eager"]
    layout = "channels_last" if channels_last else "contiguous"
    print(f"\nBatchNorm2d(64) -> GELU, [16, 64, 56, 56] {layout}, forward + backward ({repeats} repeats)")
    print(
        tabulate(
            [
                ("eager", f"{times['eager'] * 1e3:.2f} ms", "1"),
                ("fxfuse fast", f"{times['fast'] * 1e3:.2f} ms", f"{ratio:.3f}"),
            ],
            headers=["variant", "time", "ratio"],
        )
    )
    print(target("time", ratio, 0.75))


def gelu_section(repeats: int) -> None:
    cases = [
        ((16, 64, 56, 56), fmt, approximate)
        for fmt in ("contiguous", "channels_last")
        for approximate in ("none", "tanh")
    ]
    cases += [((2, 197, 3072), "contiguous", "none")]
    cases += [
        (shape, "channels_last", "none")
        for shape in ((4, 384, 28, 28), (4, 64, 64, 64), (2, 64, 28, 28), (2, 64, 14, 14))
    ]
    rows = []
    for shape, fmt, approximate in cases:
        x = torch.randn(shape)
        if fmt == "channels_last":
            x = x.to(memory_format=torch.channels_last)
        x.requires_grad_()
        grad = torch.randn_like(x)

        def step(fn, approximate=approximate, x=x, grad=grad):
            def run():
                x.grad = None
                fn(x, approximate).backward(grad)

            return run

        times = measure.median_step_times(
            {"eager": step(lambda t, a: F.gelu(t, approximate=a)), "fxfuse": step(fxfuse.ops.gelu)},
            repeats=repeats,
            warmup=2,
        )
        rows.append(
            (
                str(list(shape)),
                fmt,
                approximate,
                f"{times['eager'] * 1e3:.3f} ms",
                f"{times['fxfuse'] * 1e3:.3f} ms",
                f"{times['fxfuse'] / times['eager']:.3f}",
            )
        )
        log(f"gelu {rows[-1]}")
    print(f"\nstandalone GELU, forward + backward ({repeats} interleaved repeats)")
    print(tabulate(rows, headers=["shape", "layout", "approximate", "F.gelu", "fxfuse.ops.gelu", "ratio"]))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[3:]),
    )
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {SECTIONS}")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved timing repeats per section")
    parser.add_argument("--micro-repeats", type=int, default=31, help="repeats of the bn_gelu and gelu timings")
    parser.add_argument("--channels-last", action="store_true", help="bn_gelu section on a channels_last input")
    args = parser.parse_args()
    only = args.only.split(",")
    unknown = set(only) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections: {', '.join(sorted(unknown))}")
    log(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32 CPU")

    if "convnext" in only:
        rows = model_section("convnext_tiny", 4, 224, "memory", args.repeats)
        print(target("saved activations", rows[1].saved_ratio, 0.75))
    if "vit" in only:
        rows = model_section("vit_b_16", 2, 224, "memory", args.repeats)
        print(target("saved activations", rows[1].saved_ratio, 0.85))
    if "bn_gelu" in only:
        bn_gelu_section(args.micro_repeats, args.channels_last)
    if "efficientnet" in only:
        rows = model_section("efficientnet_b0", 4, 224, "fast", args.repeats)
        print(target("saved activations", rows[1].saved_ratio, 0.85))
        print(target("step time", rows[1].time_ratio, 1.0))
    if "gelu" in only:
        gelu_section(args.micro_repeats)


if __name__ == "__main__":
    main()
