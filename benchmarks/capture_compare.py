"""Capture: fxfuse's concrete-shape torch.fx tracing against dynamo capture (issue 30 §2, docs/design.md).

    python benchmarks/capture_compare.py [--models a,b] [--repeats 20] [--skip-exactness] [--json out.json]

For each model of the wild zoo (tests/support/wild_zoo.py; default: the issue's table plus yolo11n and googlenet_aux),
train mode, float32, the zoo's input, one intra-op thread:

* coverage: the Conv→BN sites that exist (forward hooks on eager, tests/support/conv_bn_sites.py); how many fxfuse
  fused, and which modules it kept as leaves (report notes); how many of them lie inside one graph that dynamo
  captures (a `batch_norm` call whose input is a `conv2d` call of the same graph), its graphs and graph breaks
  (`torch._dynamo.explain`);
* capture time: `fxfuse.optimize(model, x)` (traces and rewrites the train and eval graphs) against dynamo's
  first compiled call in train mode plus the first in eval mode (a recompile), with a backend that only collects
  the graphs (`backend=collect`: the captured graphs run as they are);
* per-call overhead at batch 1 (the zoo's batch where eager rejects 1): fxfuse's key check and dispatch (the
  optimized model's call minus a direct call of its compiled graph) and dynamo's guards and frame handling
  (`torch.compile(model, backend=collect)`'s call minus direct calls of the graphs it captured, where it captured
  one graph); eager, dynamo and fxfuse forwards for scale. Minimum of `--repeats` interleaved calls;
* composition: dynamo over the optimized model (`torch._dynamo.explain(fxfuse.optimize(m))`: graphs, breaks; and
  float64 exactness of `torch.compile(fxfuse.optimize(m), backend="aot_eager")` against eager over two train
  steps plus eval, `fxfuse.testing.assert_equivalent`), and fxfuse run on a graph dynamo captured
  (`fxfuse.optimize(gm, example_inputs)` inside the backend): the sites it fuses there, and whether it is exact.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the zoo is defined with the tests
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from support.conv_bn_sites import coverage, existing_sites  # noqa: E402
from support.wild_zoo import BY_NAME  # noqa: E402
from tabulate import tabulate  # noqa: E402
from torch import nn  # noqa: E402

import fxfuse  # noqa: E402
from fxfuse.testing import assert_equivalent  # noqa: E402

fxfuse_install = importlib.import_module("fxfuse.fusion.install")  # the optimized forward: its key and graphs

DEFAULT_MODELS = (
    "efficientnet_pytorch_b0",
    "hf_mobilenet_v2_tf_padding",
    "smp_deeplabv3plus_efficientnet_b0",
    "yolov8n",
    "yolo11n",
    "googlenet_aux",
)
_CONVS = {torch.conv2d, F.conv2d, torch.ops.aten.conv2d.default, torch.ops.aten.convolution.default}
_BATCH_NORMS = {F.batch_norm, torch.batch_norm, torch.ops.aten.batch_norm.default}


@dataclass
class Row:
    model: str
    sites: int
    fxfuse_fused: int = 0
    fxfuse_leaves: list[str] = field(default_factory=list)
    fxfuse_specialized: bool = False
    dynamo_graphs: int = 0
    dynamo_breaks: int = 0
    dynamo_break_reasons: list[str] = field(default_factory=list)
    dynamo_pairs: int = 0  # Conv→BN pairs inside one captured graph
    optimize_s: float = 0.0
    optimize_cpu_s: float = 0.0
    dynamo_capture_s: float = 0.0  # first train call + first eval call
    dynamo_capture_cpu_s: float = 0.0
    eager_us: float = 0.0
    dynamo_us: float = 0.0
    dynamo_graphs_us: float = float("nan")  # the captured graphs called directly (one graph only)
    fxfuse_us: float = 0.0
    fxfuse_graph_us: float = float("nan")  # the optimized model's compiled graph called directly
    fxfuse_key_us: float = 0.0  # the key alone (training flags, hooks, input shapes)
    compiled_fxfuse_graphs: int = 0
    compiled_fxfuse_breaks: int = 0
    compiled_fxfuse_exact: str = "not run"
    fxfuse_on_dynamo_fused: int = 0
    fxfuse_on_dynamo_exact: str = "not run"
    fxfuse_on_dynamo_notes: list[str] = field(default_factory=list)

    @property
    def dynamo_overhead_us(self) -> float:
        return self.dynamo_us - self.dynamo_graphs_us

    @property
    def fxfuse_overhead_us(self) -> float:
        return self.fxfuse_us - self.fxfuse_graph_us


def conv_bn_pairs(graphs: list[torch.fx.GraphModule]) -> int:
    """BatchNorm calls whose input is a conv2d call of the same graph."""
    return sum(
        1
        for gm in graphs
        for node in gm.graph.nodes
        if node.op == "call_function"
        and node.target in _BATCH_NORMS
        and isinstance(node.args[0], torch.fx.Node)
        and node.args[0].op == "call_function"
        and node.args[0].target in _CONVS
    )


class Collect:
    """A dynamo backend that keeps each graph and its example inputs and runs the graph as it is."""

    def __init__(self, then: Callable[[torch.fx.GraphModule, list], Any] | None = None) -> None:
        self.graphs: list[torch.fx.GraphModule] = []
        self.inputs: list[list] = []
        self.then = then

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list):
        self.graphs.append(gm)
        self.inputs.append(list(example_inputs))
        if self.then is not None:
            self.then(gm, example_inputs)
        return gm.forward


def best_us(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """The fastest of `repeats` calls of each function, in µs; the calls interleaved, so that load on shared
    cores falls on all of them alike."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: 1e6 * min(t) for name, t in times.items()}


def _seconds(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    """fn's result, wall seconds and process CPU seconds (what load on shared cores does not inflate)."""
    start, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - start, time.process_time() - cpu


def _build(name: str) -> tuple[nn.Module, torch.Tensor]:
    entry = BY_NAME[name]
    torch.manual_seed(0)
    return entry.build().train(), entry.example_input()


def measure_coverage(row: Row, model: nn.Module, x: torch.Tensor, census) -> None:
    optimized, row.optimize_s, row.optimize_cpu_s = _seconds(lambda: fxfuse.optimize(copy.deepcopy(model), (x,)))
    report = optimized.fxfuse_report
    row.fxfuse_fused = len(coverage(census.sites, report).fused)
    row.fxfuse_leaves = [n for n in report.notes if "not traceable" in n]
    row.fxfuse_specialized = any("computes Python values from tensor shapes" in n for n in report.notes)

    torch._dynamo.reset()
    explained = torch._dynamo.explain(copy.deepcopy(model))(x)
    row.dynamo_graphs, row.dynamo_breaks = explained.graph_count, explained.graph_break_count
    row.dynamo_break_reasons = sorted({b.reason.splitlines()[0][:160] for b in explained.break_reasons})
    row.dynamo_pairs = conv_bn_pairs(explained.graphs)

    torch._dynamo.reset()
    compiled = torch.compile(copy.deepcopy(model), backend=Collect())
    _, train_s, train_cpu = _seconds(lambda: compiled(x))
    compiled.eval()
    _, eval_s, eval_cpu = _seconds(lambda: compiled(x))
    row.dynamo_capture_s, row.dynamo_capture_cpu_s = train_s + eval_s, train_cpu + eval_cpu
    torch._dynamo.reset()


def measure_overhead(row: Row, model: nn.Module, x: torch.Tensor, repeats: int) -> None:
    try:  # batch 1, unless eager rejects it (a train-mode BN over one value per channel: smp's ASPP pooling)
        with torch.no_grad():
            copy.deepcopy(model)(x[:1])
        x = x[:1]
    except (ValueError, RuntimeError):
        pass
    eager = copy.deepcopy(model)
    collect = Collect()
    compiled = torch.compile(copy.deepcopy(model), backend=collect)
    compiled(x)
    optimized = fxfuse.optimize(copy.deepcopy(model), (x,))
    state = optimized.__dict__[fxfuse_install._STATE]
    graph = state.graphs[fxfuse_install._key(state, (x,), {})]
    fns = {
        "eager": lambda: eager(x),
        "dynamo": lambda: compiled(x),
        "fxfuse": lambda: optimized(x),
        "key": lambda: fxfuse_install._key(state, (x,), {}),
    }
    if len(collect.graphs) == 1:
        (gm,), (inputs,) = collect.graphs, collect.inputs
        fns["dynamo_graphs"] = lambda: gm(*inputs)
    if graph is not fxfuse_install._original_forward:  # the root itself runs one compiled graph
        fns["fxfuse_graph"] = lambda: graph(optimized, x)
    times = best_us(fns, repeats)
    row.eager_us, row.dynamo_us, row.fxfuse_us, row.fxfuse_key_us = (
        times["eager"],
        times["dynamo"],
        times["fxfuse"],
        times["key"],
    )
    row.dynamo_graphs_us = times.get("dynamo_graphs", float("nan"))
    row.fxfuse_graph_us = times.get("fxfuse_graph", float("nan"))
    torch._dynamo.reset()


class Holder(nn.Module):
    """`model` under the name torch.compile's OptimizedModule gives it, so state_dict keys match."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self._orig_mod = model

    def forward(self, *args):
        return self._orig_mod(*args)


def measure_composition(row: Row, model: nn.Module, x: torch.Tensor, exactness: bool) -> None:
    torch._dynamo.reset()
    explained = torch._dynamo.explain(fxfuse.optimize(copy.deepcopy(model), (x,)))(x)
    row.compiled_fxfuse_graphs, row.compiled_fxfuse_breaks = explained.graph_count, explained.graph_break_count
    if exactness:
        torch._dynamo.reset()
        candidate = torch.compile(fxfuse.optimize(copy.deepcopy(model), (x,)), backend="aot_eager")
        row.compiled_fxfuse_exact = _exact(model, candidate, x)

    def fuse(gm, example_inputs):
        try:
            report = _fxfuse_backend(gm, example_inputs).fxfuse_report
        except Exception as exc:  # noqa: BLE001
            row.fxfuse_on_dynamo_notes.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            return
        row.fxfuse_on_dynamo_fused += sum(1 for s in report.fused if s.pattern.startswith("conv2d→batch_norm2d"))
        row.fxfuse_on_dynamo_notes.extend(sorted({s.reason for s in report.skipped})[:3])

    torch._dynamo.reset()
    try:
        torch.compile(copy.deepcopy(model), backend=Collect(then=fuse))(x)
    except Exception as exc:  # noqa: BLE001 - dynamo itself may fail around fxfuse: a result
        row.fxfuse_on_dynamo_notes.append(_last_line(exc))
    if exactness:
        torch._dynamo.reset()
        candidate = torch.compile(copy.deepcopy(model), backend=_fxfuse_backend)
        row.fxfuse_on_dynamo_exact = "train: " + _exact(model, candidate, x, eval=False)
        torch._dynamo.reset()
        evaluated = torch.compile(copy.deepcopy(model).eval(), backend=_fxfuse_backend)
        try:
            with torch.no_grad():
                evaluated(x)
            row.fxfuse_on_dynamo_exact += "; eval graph: optimized"
        except Exception as exc:  # noqa: BLE001
            row.fxfuse_on_dynamo_exact += f"; eval graph: {_last_line(exc)}"
    torch._dynamo.reset()


def _fxfuse_backend(gm: torch.fx.GraphModule, example_inputs: list) -> nn.Module:
    """fxfuse as a dynamo backend: optimize the captured graph (parameters arrive as its inputs)."""
    getattr(gm, "real_recompile", gm.recompile)()  # a lazy GraphModule writes its code at its first call
    return fxfuse.optimize(gm, tuple(example_inputs))


def _last_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip() and "TORCHDYNAMO_VERBOSE" not in line]
    return f"{type(exc).__name__}: {lines[-1][:200] if lines else ''}"


def _exact(model: nn.Module, candidate: nn.Module, x: torch.Tensor, eval: bool = True) -> str:
    try:
        assert_equivalent(Holder(model), candidate, x, dtype=torch.float64, eval=eval)
        return "exact"
    except Exception as exc:  # noqa: BLE001 - reported, not raised: one model's failure is a result
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"


def run(name: str, repeats: int, exactness: bool) -> Row:
    model, x = _build(name)
    census = existing_sites(model, (x,))
    row = Row(name, len(census.sites))
    measure_coverage(row, model, x, census)
    measure_overhead(row, model, x, repeats)
    measure_composition(row, model, x, exactness)
    return row


def tables(rows: list[Row]) -> str:
    coverage_table = tabulate(
        [
            (
                r.model,
                r.sites,
                r.fxfuse_fused,
                len(r.fxfuse_leaves),
                "yes" if r.fxfuse_specialized else "no",
                r.dynamo_pairs,
                r.dynamo_graphs,
                r.dynamo_breaks,
                f"{r.optimize_s:.1f} ({r.optimize_cpu_s:.1f})",
                f"{r.dynamo_capture_s:.1f} ({r.dynamo_capture_cpu_s:.1f})",
            )
            for r in rows
        ],
        tablefmt="github",
        headers=[
            "model",
            "Conv→BN sites",
            "fxfuse fused",
            "fxfuse leaves",
            "shape-specialized",
            "pairs in dynamo graphs",
            "dynamo graphs",
            "graph breaks",
            "optimize s (CPU s)",
            "dynamo capture s, train + eval (CPU s)",
        ],
    )
    overhead_table = tabulate(
        [
            (
                r.model,
                f"{r.eager_us:.0f}",
                f"{r.fxfuse_us:.0f}",
                f"{r.fxfuse_key_us:.0f}",
                f"{r.fxfuse_overhead_us:.0f}",
                f"{r.dynamo_us:.0f}",
                f"{r.dynamo_overhead_us:.0f}",
            )
            for r in rows
        ],
        tablefmt="github",
        headers=[
            "model (batch 1)",
            "eager µs",
            "fxfuse µs",
            "fxfuse key µs",
            "fxfuse call - its graph µs",
            "dynamo (collect backend) µs",
            "dynamo call - its graph µs",
        ],
    )
    composition_table = tabulate(
        [
            (
                r.model,
                f"{r.compiled_fxfuse_graphs} / {r.compiled_fxfuse_breaks}",
                r.compiled_fxfuse_exact,
                r.fxfuse_on_dynamo_fused,
                r.fxfuse_on_dynamo_exact,
                "; ".join(r.fxfuse_on_dynamo_notes)[:200] or "-",
            )
            for r in rows
        ],
        tablefmt="github",
        headers=[
            "model",
            "dynamo over fxfuse: graphs / breaks",
            "torch.compile(fxfuse.optimize(m), aot_eager) vs eager, float64",
            "Conv→BN fused by fxfuse on dynamo's graphs",
            "torch.compile(m, backend=fxfuse.optimize)",
            "why not (fxfuse on dynamo's graphs)",
        ],
    )
    return "\n\n".join((coverage_table, overhead_table, composition_table))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help="comma-separated wild zoo models")
    parser.add_argument("--repeats", type=int, default=20, help="calls per timing (the minimum is reported)")
    parser.add_argument("--skip-exactness", action="store_true", help="skip the float64 compile exactness checks")
    parser.add_argument("--exactness-models", help="comma-separated: run the exactness checks on these only")
    parser.add_argument("--json", help="also write every row here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    exact = set(args.exactness_models.split(",")) if args.exactness_models else None
    for name in args.models.split(","):
        try:
            rows.append(run(name, args.repeats, not args.skip_exactness and (exact is None or name in exact)))
        except ImportError as exc:
            print(f"  {name}: skipped ({exc})", file=sys.stderr)
            continue
        print(f"  {name}: {json.dumps(asdict(rows[-1]))}", file=sys.stderr, flush=True)
    print(tables(rows))
    for r in rows:
        for leaf in r.fxfuse_leaves:
            print(f"{r.model}: fxfuse leaf: {leaf}")
        for reason in r.dynamo_break_reasons:
            print(f"{r.model}: dynamo graph break: {reason}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
