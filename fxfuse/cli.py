"""`fxfuse` command line: optimize, audit, verify, bench."""

from __future__ import annotations

import argparse
import importlib
import sys

from .errors import FxFuseError

COMMANDS = ("optimize", "audit", "verify", "bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fxfuse",
        description="Memory-saving fused ops for PyTorch training, and a channels_last auditor.",
        formatter_class=argparse.RawDescriptionHelpFormatter,  # --version on one line
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"fxfuse.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"fxfuse.commands.{name}":
                raise
            continue
        module.register(sub)
    return parser


def _version() -> str:
    import torch

    from . import __version__, _extension

    return f"fxfuse {__version__} (torch {torch.__version__}); {_extension.summary()}"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except FxFuseError as exc:
        print(f"fxfuse: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
