"""Helpers shared by the CLI sub-commands: model specs, input shapes, dtypes."""

from __future__ import annotations

import argparse
import importlib

import torch

from ..errors import ConfigurationError


def load_model(spec: str) -> torch.nn.Module:
    """Build a model from `torchvision:NAME` or `package.module:factory` (random weights)."""
    if ":" not in spec:
        raise ConfigurationError(
            f"model spec {spec!r} must look like 'torchvision:resnet50' or 'package.module:factory'"
        )
    where, name = spec.split(":", 1)
    if where == "torchvision":
        try:
            import torchvision
        except ImportError as exc:
            raise ConfigurationError("torchvision is not installed; `pip install torchvision`") from exc
        try:
            return torchvision.models.get_model(name, weights=None)
        except (ValueError, KeyError) as exc:
            raise ConfigurationError(
                f"torchvision has no model {name!r}; see torchvision.models.list_models()"
            ) from exc
    try:
        module = importlib.import_module(where)
    except ImportError as exc:
        raise ConfigurationError(f"cannot import {where!r} from model spec {spec!r}: {exc}") from exc
    factory = getattr(module, name, None)
    if factory is None:
        raise ConfigurationError(f"module {where!r} has no attribute {name!r} (model spec {spec!r})")
    model = factory() if callable(factory) and not isinstance(factory, torch.nn.Module) else factory
    if not isinstance(model, torch.nn.Module):
        raise ConfigurationError(f"{spec!r} did not produce an nn.Module (got {type(model).__name__})")
    return model


def parse_shape(text: str) -> tuple[int, ...]:
    """'8,3,224,224' -> (8, 3, 224, 224); argparse type for --input-shape."""
    try:
        shape = tuple(int(part) for part in text.replace("x", ",").split(",") if part.strip())
    except ValueError:
        shape = ()
    if not shape or any(d <= 0 for d in shape):
        raise argparse.ArgumentTypeError(f"input shape must be positive integers like 8,3,224,224, got {text!r}")
    return shape


DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(text: str) -> torch.dtype:
    if text not in DTYPES:
        raise argparse.ArgumentTypeError(f"dtype must be one of {', '.join(DTYPES)}, got {text!r}")
    return DTYPES[text]


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL_SPEC", help="torchvision:NAME or package.module:factory")
    parser.add_argument("--input-shape", required=True, type=parse_shape, metavar="N,C,H,W", help="example input shape")
