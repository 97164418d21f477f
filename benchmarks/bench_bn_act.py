"""Fused BatchNorm -> activation training forward against eager's BN + activation, CPU, float32.

    python benchmarks/bench_bn_act.py [--shape 8,64,56,56] [--acts silu,gelu_tanh] [--threads 1] [--repeats 30]

One line per (layout, activation): the fastest of `--repeats` interleaved forwards of
F.batch_norm + the activation (eager) and of fxfuse.ops.batch_norm_act (training mode,
running statistics updated), and their ratio. The fused forward computes the activation
with ATen's own exp/erf/tanh so that it is eager's bit for bit; on an AVX-512 CPU ATen
runs those 16 lanes wide and fxfuse's AVX2 kernels 8, which this measures.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from fxfuse.ops import batch_norm_act
from fxfuse.ops.checks import apply_activation


def eager_bn_act(x, rm, rv, w, b, act):
    return apply_activation(F.batch_norm(x, rm, rv, w, b, True, 0.1, 1e-5), act)


def fused_bn_act(x, rm, rv, w, b, act):
    return batch_norm_act(x, rm, rv, w, b, True, 0.1, 1e-5, act)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="8,64,56,56")
    p.add_argument("--acts", default="silu,gelu_tanh")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    shape = tuple(int(s) for s in args.shape.split(","))
    C = shape[1]
    print(f"{torch.backends.cpu.get_cpu_capability()}, {args.threads} thread(s), {'x'.join(map(str, shape))}")
    for fmt, layout in [(torch.channels_last, "nhwc"), (torch.contiguous_format, "nchw")]:
        x = torch.randn(shape).contiguous(memory_format=fmt)
        w, b, rm, rv = torch.randn(C), torch.randn(C), torch.zeros(C), torch.ones(C)
        for act in args.acts.split(","):
            times = {eager_bn_act: [], fused_bn_act: []}
            for _ in range(args.repeats):
                for fn, spent in times.items():
                    start = time.perf_counter()
                    fn(x, rm, rv, w, b, act)
                    spent.append(time.perf_counter() - start)
            e, f = (min(t) * 1e3 for t in times.values())
            print(f"{layout} {act}: eager {e:.2f} ms, fxfuse {f:.2f} ms, ratio {f / e:.2f}")


if __name__ == "__main__":
    main()
