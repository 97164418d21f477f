"""What one fused DenseNet layer costs beyond its kernels: eager against fxfuse's runtime call, on
tensors small enough that the per-call Python and dispatch dominate.

    python benchmarks/bench_layer_overhead.py [--pieces 8] [--calls 300] [--rounds 5]

The layer: `relu(bn2(conv(relu(bn(cat(pieces, 1))))))`, eight channels_last pieces of 2×32×4×4, a
1×1 conv to 128 channels, train mode, float32. fxfuse runs it as DenseNet-121's plan does
(fxfuse.fusion.runtime.bn_act_conv_module with the pieces: fxfuse::cat_bn_act_conv with the
epilogue). Prints the median over interleaved rounds of a train step (forward, `.sum().backward()`)
and of a forward with and without grad, in microseconds a call, and the time of the C++ op alone
(fxfuse::bn_act_conv on the concatenation, without grad): the rest of fxfuse's forward is the
path to it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import fxfuse  # noqa: F401  (registers fxfuse's ops)
from fxfuse.fusion import runtime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pieces", type=int, default=8)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    torch.manual_seed(0)
    pieces = [
        torch.randn(2, 32, 4, 4).contiguous(memory_format=torch.channels_last).requires_grad_()
        for _ in range(args.pieces)
    ]
    channels = 32 * args.pieces
    bn, conv, bn2 = nn.BatchNorm2d(channels), nn.Conv2d(channels, 128, 1, bias=False), nn.BatchNorm2d(128)

    def eager():
        return torch.relu(bn2(conv(torch.relu(bn(torch.cat(pieces, 1))))))

    def fxfuse_layer():
        x = torch.cat(pieces, 1)
        return runtime.bn_act_conv_module(x, bn, "relu", 0.0, conv, bn2, "relu", 0.0, pieces=pieces)

    def per_call(fn) -> float:
        start = time.perf_counter()
        for _ in range(args.calls):
            fn()
        return (time.perf_counter() - start) / args.calls * 1e6

    x = torch.cat(pieces, 1).detach()
    op_args = (x, bn.weight, bn.bias, bn.running_mean, bn.running_var, True, bn.eps, "relu", 0.0, conv.weight, None,
               [1, 1], [0, 0], [1, 1], 1, True, bn2.weight, bn2.bias, bn2.running_mean, bn2.running_var, True,
               bn2.eps, "relu", 0.0)  # fmt: skip

    def op_alone():
        return torch.ops.fxfuse.bn_act_conv.default(*op_args)[0]

    measures = {
        "train step": lambda layer: lambda: layer().sum().backward(),
        "forward": lambda layer: layer,
    }
    layers = {"eager": eager, "fxfuse": fxfuse_layer}
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds + 1):  # the first round warms up
        for what, make in measures.items():
            for name, layer in layers.items():
                times.setdefault((what, name), []).append(per_call(make(layer)))
                if what == "forward":
                    with torch.no_grad():
                        times.setdefault(("forward, no grad", name), []).append(per_call(layer))
        with torch.no_grad():
            times.setdefault(("forward, no grad", "the op"), []).append(per_call(op_alone))
    for (what, name), values in times.items():
        print(f"{what:17s} {name:7s} {statistics.median(values[1:]):8.1f} us")


if __name__ == "__main__":
    main()
