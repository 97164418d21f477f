"""How many times one `fxfuse.optimize` call enters each module of fxfuse.fusion (issue 56).

An entry is a call into a function of a module from another fusion module, the nearest fusion
frame up the stack being the caller (torch, measure and the model's own code in between are
passed through): a call within the module does not count, nor does one of its callbacks that
torch runs. Following the call through the code means returning to that module once per entry.
Counted with sys.setprofile over the optimize call only, not the model's later calls; the table
lists the pipeline's stage modules (--all: every fusion module).

    PYTHONPATH=. python benchmarks/stage_entries.py                      # ResNet-18, memory_budget=0.3
    PYTHONPATH=. python benchmarks/stage_entries.py --model resnet50 --budget none --functions
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch
import torchvision

import fxfuse

FUSION = os.path.join(os.path.dirname(os.path.abspath(fxfuse.__file__)), "fusion")
# The pipeline's stages (fusion/optimize.py) and the modules they call by name.
STAGES = ("optimize", "roots", "capture", "apply", "policy", "counts", "install", "report")


def _module_of(filename: str) -> str | None:
    """`install` for fxfuse/fusion/install.py, `regions.costs` for fusion/regions/costs.py; None outside."""
    path = os.path.abspath(filename)
    if not path.startswith(FUSION + os.sep) or not path.endswith(".py"):
        return None
    return os.path.relpath(path, FUSION)[: -len(".py")].replace(os.sep, ".")


def count_entries(fn) -> tuple[collections.Counter, collections.Counter]:
    """Entries per module, and per module:function."""
    entries: collections.Counter = collections.Counter()
    functions: collections.Counter = collections.Counter()
    modules: dict[str, str | None] = {}

    def module(code) -> str | None:
        name = code.co_filename
        if name not in modules:
            modules[name] = _module_of(name)
        return modules[name]

    def profile(frame, event, arg):
        if event != "call":
            return
        callee = module(frame.f_code)
        if callee is None:
            return
        caller = frame.f_back
        while caller is not None and module(caller.f_code) is None:
            caller = caller.f_back
        if caller is None or module(caller.f_code) != callee:
            entries[callee] += 1
            functions[f"{callee}:{frame.f_code.co_name}"] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return entries, functions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet18", help="a torchvision model name")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--budget", default="0.3", help="memory_budget, or none")
    parser.add_argument("--no-inputs", action="store_true", help="optimize(model) without example inputs")
    parser.add_argument("--functions", action="store_true", help="also list the functions entered")
    parser.add_argument("--all", action="store_true", help="every fusion module, not only the stages")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = getattr(torchvision.models, args.model)()
    x = torch.randn(2, 3, args.size, args.size)
    kwargs = {} if args.budget == "none" else {"memory_budget": float(args.budget)}
    inputs = () if args.no_inputs else (x,)
    entries, functions = count_entries(lambda: fxfuse.optimize(model, *inputs, **kwargs))
    print(f"fxfuse.optimize({args.model}{'' if args.no_inputs else ', x'}, {kwargs}): entries per fusion module")
    shown = sorted(entries) if args.all else [m for m in STAGES if m in entries or m == "roots"]
    for name in shown:
        print(f"  {name:32} {entries[name]:6}")
    if args.functions:
        for name, n in sorted(functions.items(), key=lambda kv: (-kv[1], kv[0])):
            if args.all or name.split(":")[0] in STAGES:
                print(f"  {name:60} {n:6}")


if __name__ == "__main__":
    main()
