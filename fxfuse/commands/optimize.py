"""`fxfuse optimize MODEL_SPEC --input-shape N,C,H,W [--mode ...] [--json]`: print the fusion report."""

from __future__ import annotations

import argparse
import json

import torch

from ..fusion import MODES, explain
from ..fusion.layout import MEMORY_FORMATS
from ._common import add_model_arguments, load_model


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "optimize",
        help="show what fxfuse.optimize would fuse in a model, and why it skips the rest",
        description="Trace MODEL_SPEC, find Conv→BN→activation and BN→activation patterns and print the "
        "fusion report (sites, bytes saved for backward at the given input shape, skip reasons).",
    )
    add_model_arguments(parser)
    parser.add_argument(
        "--mode",
        choices=MODES,
        default="memory",
        help="memory: recompute convs/linears to keep only their inputs, wherever that frees memory (default); "
        "fast: only pointwise recompute; auto: recompute only where it is cheap per byte",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        metavar="B",
        help="memory budget: keep saved activations at or under B x eager's (e.g. 0.7) with the least recompute",
    )
    parser.add_argument(
        "--peak-budget",
        type=float,
        default=None,
        metavar="P",
        help="peak budget: keep the peak memory of a train step at or under P x eager's (e.g. 0.5), "
        "counted on a meta-device copy",
    )
    parser.add_argument(
        "--memory-format",
        choices=MEMORY_FORMATS,
        default="preserve",
        help="channels_last: run the model in channels_last; auto: only where the audit finds "
        "no format loss and it measures faster; preserve: leave layouts alone (default)",
    )
    parser.add_argument("--eval", action="store_true", help="analyse the model in eval mode")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--verbose", action="store_true", help="after the report, every site's full reason (report.explain)"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    model = load_model(args.model)
    model.train(not args.eval)
    report = explain(
        model,
        torch.randn(*args.input_shape),
        mode=args.mode,
        memory_budget=args.budget,
        memory_format=args.memory_format,
        peak_budget=args.peak_budget,
    )
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(report)
        if args.verbose:
            print("\n" + report.details())
    return 0
