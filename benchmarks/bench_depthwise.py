"""Depthwise conv backward, float32, CPU: ATen's convolution_backward (oneDNN) against
fxfuse::conv2d_backward (fxfuse's weight-gradient kernel), per call, on the depthwise layers of
ConvNeXt-T (batch 4) and EfficientNet-B0 (batch 8) at 224x224, channels_last and NCHW, with each
side's error against a float64 run.

    python benchmarks/bench_depthwise.py [--repeats 20]

Times are medians of interleaved calls, so drift hits both sides alike. Kernels under 5x5 (the
3x3 rows) are ATen's on both sides in float32: fxfuse routes them to ATen (measured as fast).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from tabulate import tabulate

import fxfuse  # noqa: F401 - loads torch.ops.fxfuse

# (model, batch, channels, spatial size, kernel, stride)
LAYERS = [
    ("convnext_tiny stage 1", 4, 96, 56, 7, 1),
    ("convnext_tiny stage 2", 4, 192, 28, 7, 1),
    ("convnext_tiny stage 3", 4, 384, 14, 7, 1),
    ("convnext_tiny stage 4", 4, 768, 7, 7, 1),
    ("efficientnet_b0 3x3, 112²", 8, 32, 112, 3, 1),
    ("efficientnet_b0 5x5 s2, 28²", 8, 240, 28, 5, 2),
    ("efficientnet_b0 5x5, 14²", 8, 672, 14, 5, 1),
]


def _rel_error(got, ref):
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


def measure(name, n, c, size, k, stride, channels_last, repeats):
    pad = k // 2
    x64 = torch.randn(n, c, size, size, dtype=torch.float64)
    w64 = torch.randn(c, 1, k, k, dtype=torch.float64)
    gy64 = torch.randn_like(F.conv2d(x64, w64, None, stride, pad, 1, c))
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x, gy, w = x64.float().contiguous(memory_format=fmt), gy64.float().contiguous(memory_format=fmt), w64.float()
    b = torch.zeros(c)
    conv = ([stride, stride], [pad, pad], [1, 1])

    def eager():
        return torch.ops.aten.convolution_backward(gy, x, w, [c], *conv, False, [0, 0], c, [True, True, True])

    def fused():
        return torch.ops.fxfuse.conv2d_backward(gy, x, w, b, *conv, c, [True, True, True])

    ref = torch.ops.aten.convolution_backward(gy64, x64, w64, [c], *conv, False, [0, 0], c, [True, True, True])
    errors = [_rel_error(fn()[1], ref[1]) for fn in (eager, fused)]
    times = {eager: [], fused: []}
    for _ in range(3):
        eager(), fused()
    for _ in range(repeats):
        for fn in (eager, fused):
            start = time.perf_counter()
            fn()
            times[fn].append(time.perf_counter() - start)
    t_eager, t_fused = (statistics.median(times[fn]) * 1e3 for fn in (eager, fused))
    layout = "channels_last" if channels_last else "NCHW"
    return [name, layout, f"{t_eager:.2f}", f"{t_fused:.2f}", f"{t_fused / t_eager:.3f}", *(f"{e:.1e}" for e in errors)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = [measure(*layer, cl, args.repeats) for layer in LAYERS for cl in (True, False)]
    print(f"float32, cpu, {torch.get_num_threads()} threads, torch {torch.__version__}; times in ms per call")
    headers = ["layer", "layout", "eager", "fxfuse", "ratio", "weight-grad error eager", "fxfuse"]
    print(tabulate(rows, headers=headers))


if __name__ == "__main__":
    main()
