"""Saved activation bytes with and without the max_pool2d pass, in one process.

    python benchmarks/bench_max_pool2d.py 0.5,0.45,0.4 torchvision.models:resnet50 timm.models.dla:dla34 ...

For each model (batch 8, 224², channels_last, random weights): eager's saved bytes, then for
mode="fast", mode="memory" and each memory budget, fxfuse's saved bytes as a ratio of eager's,
without the pass ("before") and with it ("after"). Saved bytes are counted by
`fxfuse.measure.saved_activation_bytes` on real tensors (unique storages, saved_tensors_hooks).
"""

from __future__ import annotations

import copy
import importlib
import sys

import torch

import fxfuse
from fxfuse.fusion import passes
from fxfuse.fusion.passes import max_pool2d
from fxfuse.measure import memory


def main(argv: list[str]) -> None:
    budgets = [float(b) for b in argv[0].split(",")]
    every = passes.PASSES
    without = tuple(p for p in every if p.run is not max_pool2d.PASS)
    for spec in argv[1:]:
        module, name = spec.rsplit(":", 1)
        torch.manual_seed(0)
        model = getattr(importlib.import_module(module), name)().to(memory_format=torch.channels_last)
        x = torch.randn(8, 3, 224, 224).to(memory_format=torch.channels_last)
        eager = memory.saved_activation_bytes(model, (x,))
        for label, chosen in (("before", without), ("after", every)):
            passes.PASSES = chosen
            cells = []
            for kw in [dict(mode="fast"), dict(mode="memory")] + [dict(memory_budget=b) for b in budgets]:
                optimized = fxfuse.optimize(copy.deepcopy(model), x, **kw)
                cells.append(f"{next(iter(kw.values()))}: {memory.saved_activation_bytes(optimized, (x,)) / eager:.3f}")
            passes.PASSES = every
            print(spec, label, " | ".join(cells), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
