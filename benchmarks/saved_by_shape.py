"""What each variant keeps for backward, by activation shape: where fxfuse's saved bytes differ from compile's.

    python benchmarks/saved_by_shape.py [--model timm.models.dla:dla34] [--budget 0.45] [--compile-budget 0.5]
        [--batch 8] [--size 224]

Variants, model and input channels_last, float32, train mode: eager; fxfuse `mode="fast"`; fxfuse
`memory_budget=BUDGET`; torch.compile with `activation_memory_budget=COMPILE_BUDGET`. One forward of each
under `saved_tensors_hooks`, counted as `fxfuse.measure` counts (unique storages, less parameters, buffers
and the input), by the saved tensor's shape without the batch. For the fxfuse variants it also names the op
that wrote each tensor (compile writes its own inside one graph, so they go by shape only).
"""

from __future__ import annotations

import argparse
import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fxfuse import bench
from fxfuse.commands._common import load_model
from fxfuse.measure import memory


class _Producers(TorchDispatchMode):
    """The op that first wrote each storage during a forward (in-place ops keep the first writer's name)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_storage: dict[tuple, str] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.by_storage.setdefault(memory.storage_key(t), func.__name__.split(".")[0])
        return out


def saved_by_shape(model: torch.nn.Module, x: torch.Tensor, producers: bool) -> collections.Counter:
    """Bytes saved for backward by one forward, keyed by (shape without the batch, producing op or ""); tensors
    of one dimension (per-channel statistics) keep their shape."""
    model(x).sum().backward()  # compile's first call compiles; fxfuse's first call settles its layouts
    exclude = {memory.storage_key(t) for t in (*model.parameters(), *model.buffers(), x)}
    saved: dict[tuple, tuple] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = memory.storage_key(t)
        if key not in exclude and key[1] != 0 and key[2] > 0:
            saved.setdefault(key, tuple(t.shape[1:] if t.dim() > 1 else t.shape))
        return t

    mode = _Producers() if producers else None
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if mode is None:
            model(x)
        else:
            with mode:
                model(x)
    found: collections.Counter = collections.Counter()
    for key, shape in saved.items():
        found[(shape, mode.by_storage.get(key, "?") if mode else "")] += key[2]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="timm.models.dla:dla34")
    parser.add_argument("--budget", type=float, default=0.45)
    parser.add_argument("--compile-budget", type=float, default=0.5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=224)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = load_model(args.model).train()
    cl = torch.channels_last
    x = torch.randn(args.batch, 3, args.size, args.size)
    xs = x.contiguous(memory_format=cl)
    specs = {
        "eager": "eager-channels_last",
        "fxfuse fast": "fast",
        f"fxfuse budget {args.budget}": f"budget={args.budget}",
        f"compile budget {args.compile_budget}": f"compile-budget={args.compile_budget}",
    }
    tables = {
        name: saved_by_shape(bench.make_variant(spec, model, (x,), cl), xs, producers=name.startswith("fxfuse"))
        for name, spec in specs.items()
    }
    by_shape = {name: collections.Counter() for name in tables}
    for name, table in tables.items():
        for (shape, _), nbytes in table.items():
            by_shape[name][shape] += nbytes
    shapes = sorted({s for t in by_shape.values() for s in t}, key=lambda s: -max(t[s] for t in by_shape.values()))
    mib = 2.0**20
    print(f"{args.model}, {args.batch}x3x{args.size}x{args.size} channels_last: MiB saved for backward by shape")
    print(f"{'shape':18s}" + "".join(f"{name:>26s}" for name in tables))
    for shape in shapes:
        if max(t[shape] for t in by_shape.values()) >= 0.05 * mib:
            print(f"{str(shape):18s}" + "".join(f"{by_shape[n][shape] / mib:26.1f}" for n in tables))
    print(f"{'total':18s}" + "".join(f"{sum(t.values()) / mib:26.1f}" for t in by_shape.values()))
    for name, table in tables.items():
        if name.startswith("fxfuse"):
            print(f"\n{name}, by the op that wrote each saved tensor:")
            for (shape, op), nbytes in table.most_common():
                if nbytes >= 0.05 * mib:
                    print(f"  {nbytes / mib:8.1f} MiB  {str(shape):18s} {op}")


if __name__ == "__main__":
    main()
