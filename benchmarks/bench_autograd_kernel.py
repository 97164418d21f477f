"""What an fxfuse op's Autograd kernel costs a call: torch.library.register_autograd's against
fxfuse/ops/autograd_kernel.py's, in one process.

    python benchmarks/bench_autograd_kernel.py [--op bn_act_conv|cat_bn_act_conv] [--calls 500] [--rounds 7]

Both kernels wrap the same op: two copies of the op's schema (fxfuse::bn_act_conv: 24 arguments;
cat_bn_act_conv: the same with a `Tensor[]` of pieces first, four pieces here) in a scratch
library, whose kernel is fxfuse's, registered with the op's own setup_context and backward, one
through each function. A kernel's cost is a call's time with grad enabled less
its time without (the no-grad path skips the autograd.Function), on small tensors so that the
kernel's overhead is not lost in the op's work; median of the rounds, rounds interleaved.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import fxfuse  # noqa: F401  (registers fxfuse's ops)
from fxfuse.ops import cat_input
from fxfuse.ops.autograd_kernel import register_autograd
from fxfuse.ops.bn_act_conv import _backward as _base_backward
from fxfuse.ops.bn_act_conv import _setup as _base_setup


def _define(lib: torch.library.Library, opname: str) -> dict[str, object]:
    target = getattr(torch.ops.fxfuse, opname).default
    schema = str(target._schema).split("(", 1)[1]
    if opname == "cat_bn_act_conv":
        _setup, _backward = cat_input._autograd("bn_act_conv")
    else:
        _setup, _backward = _base_setup, _base_backward
    ops = {}
    for name, register in (
        (
            "torch_library",
            lambda q: torch.library.register_autograd(q, _backward, setup_context=_setup, lib=lib),
        ),
        ("fxfuse", lambda q: register_autograd(q, _backward, _setup, lib=lib)),
    ):
        lib.define(f"{name}({schema}")
        lib.impl(name, target, "CompositeExplicitAutograd")
        register(f"{lib.ns}::{name}")
        ops[name] = getattr(getattr(torch.ops, lib.ns), name)
    return ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", choices=("bn_act_conv", "cat_bn_act_conv"), default="bn_act_conv")
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    lib = torch.library.Library("fxfuse_bench_autograd", "DEF")
    ops = _define(lib, args.op)
    pieces = [torch.randn(2, 2, 4, 4, requires_grad=True) for _ in range(4)]
    x = torch.cat(pieces, 1).detach() if args.op == "cat_bn_act_conv" else torch.randn(2, 8, 4, 4, requires_grad=True)
    w = torch.randn(8, 8, 3, 3, requires_grad=True)
    g, b = torch.ones(8, requires_grad=True), torch.zeros(8, requires_grad=True)
    rm, rv = torch.zeros(8), torch.ones(8)
    call_args = (x, g, b, rm, rv, True, 1e-5, "relu", 0.0, w, None, [1, 1], [1, 1], [1, 1], 1, False,
                 None, None, None, None, False, 1e-5, "none", 0.0)  # fmt: skip
    if args.op == "cat_bn_act_conv":
        call_args = (pieces, *call_args)

    def per_call(op, grad: bool) -> float:
        with torch.set_grad_enabled(grad):
            start = time.perf_counter()
            for _ in range(args.calls):
                op(*call_args)
            return (time.perf_counter() - start) / args.calls

    def with_backward(op) -> float:
        start = time.perf_counter()
        for _ in range(args.calls):
            op(*call_args)[0].sum().backward()
        return (time.perf_counter() - start) / args.calls

    for op in ops.values():  # warm-up
        per_call(op, True)
        per_call(op, False)
        with_backward(op)
    costs: dict[str, list[float]] = {name: [] for name in ops}
    steps: dict[str, list[float]] = {name: [] for name in ops}
    for _ in range(args.rounds):
        for name, op in ops.items():
            costs[name].append(per_call(op, True) - per_call(op, False))
            steps[name].append(with_backward(op))
    for name in ops:
        print(
            f"{name:14s} autograd kernel: {statistics.median(costs[name]) * 1e6:6.1f} us a call; "
            f"a call with its backward: {statistics.median(steps[name]) * 1e6:6.1f} us"
        )


if __name__ == "__main__":
    main()
