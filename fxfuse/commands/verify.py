"""`fxfuse verify MODEL_SPEC --input-shape N,C,H,W`: exit 0 when the optimized model is equivalent, 1 when not."""

from __future__ import annotations

import argparse

import torch

from ..fusion import MODES
from ..verify import verify
from ._common import add_model_arguments, load_model, parse_dtype

INPUT_SEED = 0


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "verify",
        help="check that an fxfuse-optimized model trains exactly like the original",
        description=(
            "Optimize a copy of the model and compare it with the original over a few SGD steps "
            "(outputs, input and parameter gradients, buffers), then in eval mode. Below float64, eager also "
            "runs in float64 as the reference, and the optimized model may be off from it by a small multiple "
            "of eager's own error (the table shows both). "
            "Exit status: 0 equivalent, 1 not equivalent, 2 error."
        ),
    )
    add_model_arguments(parser)
    parser.add_argument("--mode", choices=MODES, default="memory", help="fxfuse.optimize mode (default: memory)")
    parser.add_argument(
        "--dtype",
        type=parse_dtype,
        default=None,
        help="cast model and input to this dtype first (default: the model's own)",
    )
    parser.add_argument(
        "--no-fp64-reference",
        dest="fp64_reference",
        action="store_false",
        help="compare with eager directly at fixed per-dtype tolerances instead of against a float64 reference",
    )
    parser.add_argument("--steps", type=_non_negative_int, default=2, help="SGD steps to compare (default: 2)")
    parser.add_argument(
        "--rtol", type=float, default=None, help="relative floor (the whole tolerance with --no-fp64-reference)"
    )
    parser.add_argument(
        "--atol", type=float, default=None, help="absolute floor (the whole tolerance with --no-fp64-reference)"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    model = load_model(args.model)
    example = torch.randn(args.input_shape, generator=torch.Generator().manual_seed(INPUT_SEED))
    report = verify(
        model,
        example,
        mode=args.mode,
        steps=args.steps,
        dtype=args.dtype,
        rtol=args.rtol,
        atol=args.atol,
        fp64_reference=args.fp64_reference,
    )
    print(report)
    return 0 if report.ok else 1


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"steps must be a non-negative integer, got {text!r}")
    return value
