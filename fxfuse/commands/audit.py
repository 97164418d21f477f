"""`fxfuse audit MODEL_SPEC --input-shape N,C,H,W`: report the ops that lose channels_last.

Exit status: 0 when no op loses the format, 1 when some do, 2 on usage errors and on
models that reject the example input.
"""

from __future__ import annotations

import argparse

import torch

from ..audit import audit_channels_last
from ..errors import FxFuseError
from ._common import add_model_arguments, load_model


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "audit",
        help="find the ops that silently turn channels_last tensors back into NCHW",
        description="Run MODEL_SPEC in channels_last (forward and backward) on a random input and "
        "report every aten op whose output lost the channels_last memory format. "
        "Exit status: 0 clean, 1 losses found, 2 usage error or model rejected the input.",
    )
    add_model_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--fake", action="store_true", help="run on fake tensors: no compute, strides from meta kernels"
    )
    parser.add_argument("--no-backward", dest="backward", action="store_false", help="audit the forward pass only")
    parser.add_argument("--eval", action="store_true", help="audit in eval mode (default: train mode)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.fake:
        model, example = _build_for_fake(args.model, args.input_shape)
    else:
        model, example = load_model(args.model), torch.randn(args.input_shape)
    report = audit_channels_last(
        model, example, backward=args.backward, fake=args.fake, train=False if args.eval else None
    )
    print(report.to_json() if args.json else report)
    return 0 if report.ok else 1


def _build_for_fake(spec: str, shape: tuple[int, ...]) -> tuple[torch.nn.Module, torch.Tensor]:
    """Build on the meta device, so that fake mode never allocates or initializes weights."""
    try:
        with torch.device("meta"):
            model = load_model(spec)
    except FxFuseError:
        raise
    except Exception:  # a factory that needs real tensors (loads a checkpoint, say)
        return load_model(spec), torch.empty(shape)
    return model, torch.empty(shape, device="meta")
