"""What an fxfuse op's Autograd kernel costs a call, as registered (C++, csrc/autograd/).

    python benchmarks/bench_autograd_kernel.py [--op bn_act_conv|cat_bn_act_conv] [--calls 500] [--rounds 7]

The op is called through `torch.ops.fxfuse.<op>` on small tensors, so that the kernel's overhead
is not lost in the op's work (fxfuse::bn_act_conv: 24 arguments; cat_bn_act_conv: the same with a
`Tensor[]` of four pieces first). A kernel's cost is a call's time with grad enabled less its time
without (the no-grad path skips the autograd Function); a call with its backward is timed whole,
and the Python function calls its backward makes beyond those of a backward through one ATen op
are counted (sys.setprofile). Medians of the rounds, on one thread (the host's cost, without
OpenMP's wake-ups on a loaded machine).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import fxfuse  # noqa: F401  (registers fxfuse's ops)
from fxfuse.measure import python_calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", choices=("bn_act_conv", "cat_bn_act_conv"), default="bn_act_conv")
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    op = getattr(torch.ops.fxfuse, args.op).default
    pieces = [torch.randn(2, 2, 4, 4, requires_grad=True) for _ in range(4)]
    x = torch.cat(pieces, 1) if args.op == "cat_bn_act_conv" else torch.randn(2, 8, 4, 4, requires_grad=True)
    w = torch.randn(8, 8, 3, 3, requires_grad=True)
    g, b = torch.ones(8, requires_grad=True), torch.zeros(8, requires_grad=True)
    rm, rv = torch.zeros(8), torch.ones(8)
    call_args = (x, g, b, rm, rv, True, 1e-5, "relu", 0.0, w, None, [1, 1], [1, 1], [1, 1], 1, False,
                 None, None, None, None, False, 1e-5, "none", 0.0)  # fmt: skip
    if args.op == "cat_bn_act_conv":
        call_args = (pieces, *call_args)

    def per_call(grad: bool) -> float:
        with torch.set_grad_enabled(grad):
            start = time.perf_counter()
            for _ in range(args.calls):
                op(*call_args)
            return (time.perf_counter() - start) / args.calls

    def with_backward() -> float:
        start = time.perf_counter()
        for _ in range(args.calls):
            op(*call_args)[0].sum().backward()
        return (time.perf_counter() - start) / args.calls

    per_call(True), per_call(False), with_backward()  # warm-up
    costs, steps = [], []
    for _ in range(args.rounds):
        costs.append(per_call(True) - per_call(False))
        steps.append(with_backward())
    loss, plain = op(*call_args)[0].sum(), (w * 1).sum()
    calls = python_calls(lambda: loss.backward()) - python_calls(lambda: plain.backward())
    print(
        f"fxfuse::{args.op} autograd kernel: {statistics.median(costs) * 1e6:6.1f} us a call; "
        f"a call with its backward: {statistics.median(steps) * 1e6:6.1f} us; "
        f"Python calls in backward beyond a plain one's: {calls}"
    )


if __name__ == "__main__":
    main()
