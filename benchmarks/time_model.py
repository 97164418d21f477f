"""Measure the constants of the budget policy's time model (fxfuse/fusion/regions/time_model.py).

    python benchmarks/time_model.py [--models torchvision:resnet50,timm.models.dla:dla34] [--batch 8] [--size 224]
        [--region-models torchvision:resnet50,timm.models.dla:dla34,torchvision:efficientnet_b0]

Models are specs as `fxfuse bench` takes them (`torchvision:NAME` or `package.module:factory`).

Times every op of train steps (eager, and fxfuse at mode="memory", so that its fused ops are
measured too) on real tensors, channels_last, float32, with `fxfuse.measure.traffic.OpCosts`,
which also notes each op's FLOPs and bytes moved. Then fits

    seconds = flops * SECONDS_PER_FLOP + moved * SECONDS_PER_BYTE + OP_SECONDS

the per-op and per-byte terms on the ops that run no FLOP (pointwise, copies, reductions,
pooling: the smallest give the cost per op, the large ones the cost per byte), the per-FLOP term on
the rest with their bytes' and op's share taken out. Prints the constants, and for each model the
step time the model predicts against the one measured.

Then REGION_TIME_COST (fusion/regions/ranking.py): for four blocks of each --region-models model (fused
in the pointwise form a recompute region runs), the time a train step of the block takes under
fxfuse's non-reentrant checkpoint (fusion/regions/checkpointed.py, what a region runs under; until
2026-12-02 `torch.utils.checkpoint`, which the factor 1.5 was fitted with) beyond its plain step, less the
checkpoint call's fixed cost (ranking.REGION_CALL_OPS, which the ranking prices apart), against what
the time model prices its forward at; the factor is the geometric mean of those ratios. Run it with
nothing else on the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time

import torch

import fxfuse
from fxfuse.commands._common import load_model
from fxfuse.fusion.regions import ranking, time_model
from fxfuse.fusion.regions.checkpointed import checkpointed
from fxfuse.measure import train_step
from fxfuse.measure.traffic import OpCosts

_NOTHING = contextlib.nullcontext

# Blocks a budget recomputes as regions, by model (the first of each stage, and DLA's stages).
BLOCKS = {
    "torchvision:resnet50": ["layer1.1", "layer2.1", "layer3.1", "layer4.1"],
    "timm.models.dla:dla34": ["level1", "level2", "level3", "level4"],
    "torchvision:efficientnet_b0": ["features.2.1", "features.3.1", "features.4.1", "features.6.1"],
}


def _timed_ops(model: torch.nn.Module, x: torch.Tensor, steps: int) -> list:
    train_step(model, (x,))  # warm-up: first-call allocations and oneDNN primitive creation
    runs = []
    for _ in range(steps):
        mode = OpCosts(timed=True)
        with mode:
            train_step(model, (x,))
        runs.append(mode.ops)
    # The fastest of each op position over the steps: the least disturbed reading.
    return [min(ops, key=lambda op: op.seconds) for ops in zip(*runs)]


def fit(ops: list) -> tuple[float, float, float]:
    """(seconds per FLOP, seconds per byte moved, seconds per op) from timed ops. The ops that run no FLOP give
    the other two: the smallest (under 4 KiB) their fixed cost per op, the large ones (over 1 MiB) the cost per
    byte beyond it. The FLOPs then take what the heavy ops spend beyond their bytes and their op."""
    bound = [op for op in ops if op.flops == 0 and op.moved >= 1 << 20]
    tiny = [op for op in ops if op.flops == 0 and 0 < op.moved < 4096]
    per_byte = sum(op.seconds for op in bound) / sum(op.moved for op in bound)
    per_op = max(statistics.median(op.seconds - op.moved * per_byte for op in tiny), 0.0) if tiny else 0.0
    per_byte = sum(op.seconds - per_op for op in bound) / sum(op.moved for op in bound)
    heavy = [op for op in ops if op.flops > 0]
    rest = sum(max(op.seconds - per_op - op.moved * per_byte, 0.0) for op in heavy)
    return rest / sum(op.flops for op in heavy), per_byte, per_op


def predict(ops: list, per_flop: float, per_byte: float, per_op: float) -> float:
    return sum(op.flops * per_flop + op.moved * per_byte + per_op for op in ops)


def _fastest(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def region_overheads(model: torch.nn.Module, x: torch.Tensor, paths: list, repeats: int = 7) -> list:
    """(path, seconds a checkpointed step adds, the time model's price of its forward) for each block."""
    inputs = {}
    hooks = [
        model.get_submodule(p).register_forward_pre_hook(lambda m, a, p=p: inputs.setdefault(p, a[0].detach()))
        for p in paths
    ]
    with torch.no_grad():
        model(x)
    for hook in hooks:
        hook.remove()
    rows = []
    for path in paths:
        block = fxfuse.optimize(copy.deepcopy(model.get_submodule(path)), inputs[path], mode="fast")
        h = inputs[path].clone().requires_grad_()
        plain = _fastest(lambda b=block, h=h: b(h).square().mean().backward(), repeats)
        ckpt = _fastest(lambda b=block, h=h: checkpointed(b, _NOTHING, h).square().mean().backward(), repeats)
        with torch.no_grad(), OpCosts() as costs:
            block(h)
        priced = sum(time_model.seconds(op.flops, op.moved, 1 if op.moved else 0) for op in costs.ops)
        rows.append((path, ckpt - plain, priced))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="torchvision:resnet50,timm.models.dla:dla34")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--region-models", default="torchvision:resnet50,timm.models.dla:dla34,torchvision:efficientnet_b0"
    )
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    measured = {}
    for spec in args.models.split(","):
        eager = load_model(spec).to(memory_format=torch.channels_last)
        x = torch.randn(args.batch, 3, args.size, args.size).to(memory_format=torch.channels_last)
        fused = fxfuse.optimize(copy.deepcopy(eager), x, mode="memory")
        for label, model in (("eager", eager), ("fxfuse memory", fused)):
            measured[(spec, label)] = _timed_ops(model, x, args.steps)
    every = [op for ops in measured.values() for op in ops]
    per_flop, per_byte, per_op = fit(every)
    print(f"SECONDS_PER_FLOP = {per_flop:.4g}  # {1e-9 / per_flop:.1f} GFLOP/s")
    print(f"SECONDS_PER_BYTE = {per_byte:.4g}  # {1e-9 / per_byte:.2f} GB/s moved")
    print(f"OP_SECONDS = {per_op:.3g}  # {per_op * 1e6:.1f} us per op")
    print(f"a byte moved costs {per_byte / per_flop:.1f} FLOP")
    for (spec, label), ops in measured.items():
        total = sum(op.seconds for op in ops)
        model_time = predict(ops, per_flop, per_byte, per_op)
        bound = sum(op.seconds for op in ops if op.flops == 0)
        print(
            f"{spec} {label}: {len(ops)} ops, measured {total * 1e3:.0f} ms (memory-bound ops {bound * 1e3:.0f} ms), "
            f"model {model_time * 1e3:.0f} ms ({model_time / total:.2f}x)"
        )
    print(f"regions, priced with time_model.py's constants ({time_model.__file__}):")
    ratios = []
    call = time_model.seconds(0, 0, ranking.REGION_CALL_OPS)  # the ranking prices it apart from the factor
    for spec in args.region_models.split(","):
        x = torch.randn(args.batch, 3, args.size, args.size).to(memory_format=torch.channels_last)
        model = load_model(spec).to(memory_format=torch.channels_last)
        for path, extra, price in region_overheads(model, x, BLOCKS.get(spec, [])):
            ratios.append((extra - call) / price)
            print(
                f"  {spec} {path}: checkpoint adds {extra * 1e3:.1f} ms (the call {call * 1e3:.2f}), "
                f"its forward priced {price * 1e3:.1f} ms"
            )
    if ratios:
        factor = statistics.geometric_mean(max(r, 1e-3) for r in ratios)
        print(f"REGION_TIME_COST = {factor:.2f}  # geometric mean of {len(ratios)} blocks' ratios")


if __name__ == "__main__":
    main()
