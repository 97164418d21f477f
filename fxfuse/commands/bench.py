"""`fxfuse bench MODEL_SPEC --input-shape ... [--modes ...] [--budget ...] [--with ...] [--json]`."""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys

import torch

from .. import bench, measure, plot
from ..errors import ConfigurationError
from ..fusion import MODES
from ..measure import fit
from ._common import add_model_arguments, load_model, parse_dtype

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _amp(args: argparse.Namespace):
    """The autocast every variant is prepared and measured under (--amp), else no context."""
    if args.amp is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(args.device).type, dtype=AMP_DTYPES[args.amp])


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _budgets(text: str) -> list[float]:
    try:
        return [float(part) for part in _csv(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"budgets are fractions like 0.7 or 0.5,0.7, got {text!r}") from None


def _size(text: str) -> int:
    try:
        return fit.parse_size(text)
    except ConfigurationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="measure eager, fxfuse modes and peers side by side (memory and step time)",
        description="Train-step benchmark of one model, every variant in this process, each row a ratio to eager: "
        "bytes saved for backward (saved_tensors_hooks), bytes the allocator holds at the end of forward, "
        "the allocator's peak during a train step, and median train-step time (interleaved repeats). "
        "Random weights and inputs.",
        epilog="Ratios are to the faster eager baseline of the run: eager NCHW or eager channels_last "
        "(4-D inputs). example: fxfuse bench torchvision:resnet50 --input-shape 8,3,224,224 "
        "--modes memory,auto --budget 0.5 --with checkpoint,compile-budget --plot frontier.svg",
    )
    add_model_arguments(parser)
    parser.add_argument(
        "--modes",
        type=_csv,
        default=["memory"],
        metavar="M[,M...]",
        help=f"fxfuse modes to run besides eager: {', '.join(MODES)} (default: memory)",
    )
    parser.add_argument(
        "--budget",
        type=_budgets,
        default=[],
        metavar="B[,B...]",
        help="also run fxfuse with memory_budget=B (fraction of eager's saved activations)",
    )
    parser.add_argument(
        "--frontier",
        nargs="?",
        const=list(bench.FRONTIER_BUDGETS),
        type=_budgets,
        default=None,
        metavar="B[,B...]",
        help="sweep memory_budget over B (default: "
        + ",".join(f"{b:g}" for b in bench.FRONTIER_BUDGETS)
        + ") on top of --budget, and mark each row on or off the Pareto front of (saved, peak, time); "
        "with --with compile-budget, torch.compile runs at the same budgets",
    )
    parser.add_argument(
        "--peak-budget",
        type=_budgets,
        default=[],
        metavar="P[,P...]",
        help="also run fxfuse with peak_budget=P (fraction of eager's peak during a train step)",
    )
    parser.add_argument(
        "--budget-peak",
        type=float,
        default=None,
        metavar="P",
        help="also run each --budget B with peak_budget=P as well (fxfuse spends the peak left under P on "
        "speed: chained regions recompute in one pass)",
    )
    parser.add_argument(
        "--with",
        dest="peers",
        type=_csv,
        default=[],
        metavar="PEER[,PEER...]",
        help=f"peers to compare against: {', '.join(bench.PEERS)} "
        "(checkpoint: torch.utils.checkpoint on each top-level block; compile-budget: "
        "torch.compile with activation_memory_budget at each --budget; compile-budget-fxfuse: "
        "torch.compile(fxfuse.optimize(model, mode=M)) with activation_memory_budget at each --budget B, for "
        "each --modes M; compile-fxfuse: "
        "torch.compile(fxfuse.optimize(model, mode=M)) for each --modes M and "
        "torch.compile(fxfuse.optimize(model, memory_budget=B)) for each --budget B; compile-fxfuse-composed: the same "
        "with fxfuse.ops.compiled.enabled, the fused ops as ATen compositions inductor fuses)",
    )
    parser.add_argument(
        "--fit-cap",
        type=_size,
        default=None,
        metavar="SIZE",
        help="also find each variant's largest batch within SIZE (e.g. 2GiB): the model's parameters and "
        "buffers, the inputs and a train step's peak (no optimizer state); the batch is --input-shape's first "
        "dimension. On CUDA the measured search runs under torch.cuda.set_per_process_memory_fraction",
    )
    parser.add_argument(
        "--fit-by",
        choices=("counted", "measured", "both"),
        default="both",
        help="counted: the step peak counted on a meta-device copy (no compute; not for torch.compile variants); "
        "measured: real train steps at each batch tried, started from the counted answer (default: both)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed train steps per variant (default: 5)")
    parser.add_argument("--dtype", type=parse_dtype, default=torch.float32, help="float32 (default) or float64")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument(
        "--amp",
        choices=tuple(AMP_DTYPES),
        default=None,
        help="run every variant and peer (preparation, fxfuse's plans, the measured steps) under "
        "torch.autocast(--device, bf16 or fp16), as mixed-precision training does; weights stay in --dtype",
    )
    parser.add_argument(
        "--memory-format",
        choices=("channels_last", "contiguous"),
        default="channels_last",
        help="layout of the model and input for every variant but the eager baselines "
        "(4-D inputs; default: channels_last, the faster eager layout for CNNs on CPU)",
    )
    parser.add_argument(
        "--channels-last", dest="memory_format", action="store_const", const="channels_last", help=argparse.SUPPRESS
    )  # the flag before --memory-format
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument(
        "--plot",
        metavar="PATH",
        help="also draw the memory/time plane to PATH (.svg, .png; needs matplotlib: pip install 'fxfuse[plot]')",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    four_d = len(args.input_shape) == 4
    fmt = (
        (torch.channels_last if args.memory_format == "channels_last" else torch.contiguous_format) if four_d else None
    )
    budgets = list(args.budget)
    budgets += [b for b in args.frontier or () if b not in budgets]
    names = bench.parse_variants(
        args.modes,
        budgets,
        args.peers,
        channels_last_baseline=four_d,
        peak_budgets=args.peak_budget,
        budget_peak=args.budget_peak,
    )

    def log(message: str) -> None:
        print(f"[fxfuse bench] {message}", file=sys.stderr, flush=True)

    torch.manual_seed(0)
    model = load_model(args.model).to(device=args.device, dtype=args.dtype).train()
    x = torch.randn(*args.input_shape, device=args.device, dtype=args.dtype)
    variants, reports = {}, {}
    with _amp(args):
        for name in names:
            log(f"preparing {name}")
            variants[name] = bench.make_variant(name, model, (x,), memory_format=fmt)
            report = getattr(variants[name], "fxfuse_report", None)
            if report is not None:
                reports[name] = report
        del model
        rows = bench.compare(variants, (x,), repeats=args.repeats, log=log, memory_format=fmt)
        if args.fit_cap is not None:
            ways = bench.FIT_WAYS if args.fit_by == "both" else (args.fit_by,)
            counted_under = None
            if args.amp is not None:
                counted_under = measure.Autocast(torch.device(args.device).type, AMP_DTYPES[args.amp])
            with measure.counting_under(counted_under):
                bench.add_fit(rows, variants, (x,), args.fit_cap, ways=ways, log=log, memory_format=fmt)
    if args.plot:
        title = f"{args.model}, input {'x'.join(map(str, args.input_shape))}, {args.memory_format}, {args.device}"
        if args.amp:
            title += f", {args.amp} autocast"
        plot.plot_fronts([(title, rows)], args.plot)
        log(f"frontier plot written to {args.plot}")
    if args.json:
        print(
            json.dumps(
                {
                    "model": args.model,
                    "input_shape": list(args.input_shape),
                    "dtype": str(args.dtype),
                    "amp": args.amp,
                    "device": args.device,
                    "memory_format": args.memory_format if four_d else None,
                    "threads": torch.get_num_threads(),
                    "torch": torch.__version__,
                    "machine": platform.machine(),
                    "fit_cap_bytes": args.fit_cap,
                    "rows": bench.to_json(rows),
                    "reports": {name: r.to_dict() for name, r in reports.items()},
                },
                indent=2,
            )
        )
        return 0
    layout = f", variants in {args.memory_format}" if four_d else ""
    amp = f" under {args.amp} autocast" if args.amp else ""
    print(
        f"{args.model}, input {'x'.join(map(str, args.input_shape))}, {str(args.dtype).replace('torch.', '')}{amp}, "
        f"{args.device}{layout}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    print(bench.render(rows, frontier=args.frontier is not None))
    if args.fit_cap is not None:
        print(
            f"batch in cap: the largest batch whose parameters, buffers, inputs and train-step peak fit "
            f"{args.fit_cap / 2**30:.2f} GiB (no optimizer state)"
        )
    for line in bench.compile_comparison(rows):
        print(line)
    for name, report in reports.items():
        fused = len(report.fused)
        recomputed = sum(1 for s in report.fused if s.recomputes)
        line = f"{name}: {fused} sites fused, {recomputed} recompute a conv/linear"
        if report.budget_met is not None:
            line += f"; budget {report.budget:g} {'met' if report.budget_met else 'NOT met'}"
        if report.peak_budget_met is not None:
            line += f"; peak budget {report.peak_budget:g} {'met' if report.peak_budget_met else 'NOT met'}"
        if report.regions:
            line += f"; recomputed regions/links: {', '.join(r.name for r in report.regions)}"
        print(line)
    return 0
