"""Conv→BN coverage of fxfuse.optimize on the model zoo: the "timm zoo coverage" table of docs/results.md.

    python benchmarks/zoo_coverage.py [--zoo timm|wild] [--per-model] [--models a,b] [--json out.json] [--threads 1]

--zoo wild measures the wild zoo instead (tests/support/wild_zoo.py: HF transformers, ultralytics,
segmentation_models_pytorch, efficientnet_pytorch, torchvision's auxiliary-output models); a model
whose library is not installed is skipped with a line on stderr.

For every model of the test zoo (tests/support/timm_zoo.py, tests/support/dense_zoo.py: the same models the
zoo tests check) at its zoo resolution and batch, float32, train mode, mode="memory":
BatchNorm2d layers, the Conv2d→BatchNorm2d sites that exist (forward hooks on the eager model,
tests/support/conv_bn_sites.py), how many fxfuse fused, why the others were not, the saved-for-backward
bytes of the optimized model relative to eager (fxfuse.measure.saved_activation_bytes, same
input), and optimize()'s wall and CPU time (one intra-op thread unless --threads; on shared cores the wall time
grows with the load, the process's CPU time much less). Then the slowest
optimize(), and the efficientnet_b0 memory target (batch 8, 224x224).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the zoo is defined with the tests
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from support.conv_bn_sites import coverage, existing_sites  # noqa: E402
from support.dense_zoo import DETECTION_BACKBONES, SEGMENTATION  # noqa: E402
from support.timm_zoo import BY_NAME, ZOO  # noqa: E402
from support.wild_zoo import WILD  # noqa: E402
from tabulate import tabulate  # noqa: E402

import fxfuse  # noqa: E402
from fxfuse.measure import saved_activation_bytes  # noqa: E402

MEMORY_TARGET = ("efficientnet_b0", 8, 224, 0.42)  # model, batch, resolution, max saved-bytes ratio


@dataclass
class ModelRow:
    name: str
    family: str
    input: str
    bn_layers: int
    sites: int
    fused: int
    reasons: dict[str, int] = field(default_factory=dict)  # not-fused reason -> sites
    eager_saved_bytes: int = 0
    fxfuse_saved_bytes: int = 0
    optimize_s: float = 0.0
    optimize_cpu_s: float = 0.0  # process CPU time: what load on shared cores does not inflate

    @property
    def saved_ratio(self) -> float:
        return self.fxfuse_saved_bytes / self.eager_saved_bytes if self.eager_saved_bytes else float("nan")


def _saved_bytes(model: torch.nn.Module, x: torch.Tensor) -> int:
    return saved_activation_bytes(copy.deepcopy(model).train(), (x,))  # a copy: the forward updates BN state


def measure(entry) -> ModelRow:
    torch.manual_seed(0)
    model = entry.build().train()
    x = entry.example_input()
    census = existing_sites(model, (x,))
    candidate = copy.deepcopy(model)
    start, cpu_start = time.perf_counter(), time.process_time()
    optimized = fxfuse.optimize(candidate, (x,), mode="memory")
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    cov = coverage(census.sites, optimized.fxfuse_report)
    return ModelRow(
        entry.name,
        entry.family,
        f"{x.shape[0]}x{x.shape[2]}²",
        len(census.bn_layers),
        len(census.sites),
        len(cov.fused),
        cov.reasons(),
        _saved_bytes(model, x),
        _saved_bytes(optimized, x),
        seconds,
        cpu_seconds,
    )


def _reasons(rows: list[ModelRow]) -> str:
    counts: dict[str, int] = {}
    for row in rows:
        for reason, n in row.reasons.items():
            counts[reason] = counts.get(reason, 0) + n
    return "; ".join(f"{n}: {reason}" for reason, n in counts.items()) or "-"


def _coverage(fused: int, sites: int) -> str:
    return f"{100 * fused / sites:.0f}%" if sites else "-"


_HEADERS = (
    "input",
    "BN layers",
    "Conv→BN sites",
    "fused",
    "coverage",
    "not fused (sites: reason)",
    "saved bytes vs eager",
)


def family_table(rows: list[ModelRow]) -> str:
    families: dict[str, list[ModelRow]] = {}
    for row in rows:
        families.setdefault(row.family, []).append(row)
    table = []
    for family, members in families.items():
        sites, fused = sum(r.sites for r in members), sum(r.fused for r in members)
        eager, ours = sum(r.eager_saved_bytes for r in members), sum(r.fxfuse_saved_bytes for r in members)
        inputs = ", ".join(sorted({r.input for r in members}))
        names = ", ".join(r.name for r in members)
        table.append(
            (
                family,
                names,
                inputs,
                sum(r.bn_layers for r in members),
                sites,
                fused,
                _coverage(fused, sites),
                _reasons(members),
                f"{ours / eager:.2f}x",
                f"{max(r.optimize_s for r in members):.1f}",
                f"{max(r.optimize_cpu_s for r in members):.1f}",
            )
        )
    return tabulate(
        table,
        tablefmt="github",
        headers=["family", "models", *_HEADERS, "optimize s (max)", "CPU s (max)"],
    )


def model_table(rows: list[ModelRow]) -> str:
    table = [
        (
            r.family,
            r.name,
            r.input,
            r.bn_layers,
            r.sites,
            r.fused,
            _coverage(r.fused, r.sites),
            _reasons([r]),
            f"{r.saved_ratio:.2f}x",
            f"{r.optimize_s:.1f}",
            f"{r.optimize_cpu_s:.1f}",
        )
        for r in rows
    ]
    return tabulate(
        table,
        tablefmt="github",
        headers=["family", "model", *_HEADERS, "optimize s", "CPU s"],
    )


def memory_target() -> dict:
    name, batch, size, target = MEMORY_TARGET
    entry = BY_NAME[name]
    model, x = entry.build().train(), entry.example_input(batch=batch, size=size)
    eager = _saved_bytes(model, x)
    ours = _saved_bytes(fxfuse.optimize(copy.deepcopy(model), (x,), mode="memory"), x)
    return {
        "model": name,
        "batch": batch,
        "size": size,
        "eager_saved_bytes": eager,
        "fxfuse_saved_bytes": ours,
        "ratio": ours / eager,
        "target": target,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--zoo", choices=("timm", "wild"), default="timm", help="which zoo (default: timm)")
    parser.add_argument("--per-model", action="store_true", help="one row per model instead of per family")
    parser.add_argument("--models", help="comma-separated subset of the zoo")
    parser.add_argument("--json", help="also write every model's row here")
    parser.add_argument("--no-memory-target", action="store_true", help="skip the efficientnet_b0 224² measurement")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="intra-op threads (default 1: optimize() times stay comparable on shared cores)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    entries = [*ZOO, *SEGMENTATION, *DETECTION_BACKBONES] if args.zoo == "timm" else list(WILD)
    if args.zoo == "wild":
        args.no_memory_target = True
    if args.models:
        wanted = set(args.models.split(","))
        entries = [e for e in entries if e.name in wanted]
    rows = []
    for entry in entries:
        try:
            rows.append(measure(entry))
        except ImportError as exc:
            print(f"  {entry.name}: skipped ({exc})", file=sys.stderr)
            continue
        print(
            f"  {entry.name}: {rows[-1].fused}/{rows[-1].sites} fused, optimize {rows[-1].optimize_s:.1f}s "
            f"({rows[-1].optimize_cpu_s:.1f}s CPU)",
            file=sys.stderr,
            flush=True,
        )

    print(
        'Conv→BN coverage of fxfuse.optimize(mode="memory"), float32, train mode, input batch x resolution '
        "as listed; saved bytes: saved-for-backward bytes of one forward, fxfuse / eager, per family "
        "summed over its models.\n"
    )
    print(model_table(rows) if args.per_model else family_table(rows))
    slowest = max(rows, key=lambda r: r.optimize_s)
    print(f"\nslowest optimize(): {slowest.name} {slowest.optimize_s:.1f}s ({slowest.optimize_cpu_s:.1f}s CPU)")
    total_sites, total_fused = sum(r.sites for r in rows), sum(r.fused for r in rows)
    print(f"all models: {total_fused}/{total_sites} Conv→BN sites fused ({_coverage(total_fused, total_sites)})")

    target = None
    if not args.no_memory_target:
        target = memory_target()
        verdict = "met" if target["ratio"] <= target["target"] else "NOT met"
        print(
            f'{target["model"]} batch {target["batch"]} {target["size"]}², mode="memory": saved bytes '
            f"{target['ratio']:.3f}x eager (target <= {target['target']}x: {verdict})"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "models": [{**asdict(r), "saved_ratio": r.saved_ratio} for r in rows],
                    "slowest_optimize": {"model": slowest.name, "seconds": slowest.optimize_s},
                    "memory_target": target,
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
