"""The time-model ranking against the FLOP-only one it replaced, timed in one process.

    python benchmarks/ranking_ab.py MODEL BUDGETS [ROUNDS]
    python benchmarks/ranking_ab.py torchvision:efficientnet_b0 0.45,0.4,0.35,0.3 7
    python benchmarks/ranking_ab.py timm.models.dla:dla34 0.45,0.4 7

MODEL is a spec as `fxfuse bench` takes it (`torchvision:NAME` or `package.module:factory`; random
weights, batch 8, 224², channels_last).
For each budget, fxfuse.optimize(memory_budget=B) twice: with the time model's constants
("time"), and with bytes and ops priced at zero and regions weighted 2.6 ("flops"), which ranks
exactly as the FLOP-only cost did. Where both select the same plan it is timed once ("both").
Prints each variant's saved activations and its median and fastest train step, as ratios to
eager's, over ROUNDS interleaved rounds.
"""

from __future__ import annotations

import copy
import statistics
import sys
import time

import torch

import fxfuse
from fxfuse.commands._common import load_model
from fxfuse.fusion.regions import ranking, time_model
from fxfuse.measure import saved_activation_bytes, train_step


def _constants(per_byte: float, per_op: float, region: float) -> None:
    time_model.SECONDS_PER_BYTE, time_model.OP_SECONDS, ranking.REGION_TIME_COST = per_byte, per_op, region


def _plan(model) -> tuple:
    report = model.fxfuse_report
    upgrades = (f.name for f in report.fused if "FLOP/B" in f.reason and "inside" not in f.reason)
    return tuple(sorted(r.name for r in report.regions)), tuple(sorted(upgrades))


def main(argv: list[str]) -> None:
    spec, budgets = argv[0], [float(b) for b in argv[1].split(",")]
    rounds = int(argv[2]) if len(argv) > 2 else 5
    torch.manual_seed(0)
    eager = load_model(spec).to(memory_format=torch.channels_last)
    x = torch.randn(8, 3, 224, 224).to(memory_format=torch.channels_last)
    current = (time_model.SECONDS_PER_BYTE, time_model.OP_SECONDS, ranking.REGION_TIME_COST)
    variants = [("eager", eager)]
    for budget in budgets:
        made = []
        for label, constants in (("flops", (0.0, 0.0, 2.6)), ("time", current)):
            _constants(*constants)
            made.append((f"{label} {budget}", fxfuse.optimize(copy.deepcopy(eager), x, memory_budget=budget)))
        _constants(*current)
        if _plan(made[0][1]) == _plan(made[1][1]):
            variants.append((f"both {budget}", made[0][1]))
        else:
            variants.extend(made)
    times: dict[str, list[float]] = {label: [] for label, _ in variants}
    for _, model in variants:
        train_step(model, (x,))
    for _ in range(rounds):
        for label, model in variants:
            start = time.perf_counter()
            train_step(model, (x,))
            times[label].append(time.perf_counter() - start)
    base = saved_activation_bytes(eager, (x,))
    median, fastest = statistics.median(times["eager"]), min(times["eager"])
    for label, model in variants:
        saved = saved_activation_bytes(model, (x,)) / base
        print(
            f"{spec} {label:12s} saved {saved:.3f}  median {statistics.median(times[label]) / median:.3f}  "
            f"fastest {min(times[label]) / fastest:.3f}  ({statistics.median(times[label]) * 1e3:.0f} ms)",
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv[1:])
