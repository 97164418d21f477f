"""What the optimized forward's per-call checks cost: hooks registered or removed since the
last call (and global module hooks), against an eager train step, on ResNet-50.

    python benchmarks/bench_hook_check.py [--model resnet50] [--batch 8] [--size 224] [--threads 2] [--steps 5]

Every call of an optimized module checks that its module tree and `config` objects are those its
graphs were built from, computes its graph key (the traced modules' training flags and which
submodules have hooks) and checks the global module hooks before it runs a graph. Prints the
median time of those checks (over 20 x 1000 calls) next to the median eager train step (forward +
backward) and their ratio. Target (issue 33): under 1%.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torchvision

import fxfuse
from fxfuse.fusion.install import _STATE, _drop_stale_graphs, _global_hooks, _key


def _median_seconds(fn, calls: int, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    model = torchvision.models.get_model(args.model, weights=None)
    x = torch.randn(args.batch, 3, args.size, args.size)

    step_times = []
    for i in range(args.steps + 1):  # the first is a warm-up
        start = time.perf_counter()
        model(x).sum().backward()
        if i:
            step_times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    step = statistics.median(step_times)

    fxfuse.optimize(model)
    state = model.__dict__[_STATE]

    def check():
        if not _global_hooks():
            _drop_stale_graphs(model, state)
            state.graphs.get(_key(state, (x,)))

    per_call = _median_seconds(check, 1000, 20)
    print(
        f"{args.model} batch {args.batch} {args.size}x{args.size} float32, {args.threads} threads, "
        f"torch {torch.__version__}: {len(state.tree) - 1} submodules watched for hooks, "
        f"{len(state.key_modules)} training flags"
    )
    print(f"eager train step (median of {args.steps}): {step * 1e3:.1f} ms")
    print(f"per-call check (median of 20 x 1000): {per_call * 1e6:.1f} us = {per_call / step:.5%} of the step")


if __name__ == "__main__":
    main()
