"""Checking that eager PyTorch accepts the example inputs, before fxfuse sizes anything with them.

Example inputs that do not fit the model (wrong channel count, wrong number of
arguments) must stop `optimize`/`explain` with one clear line, not make every size
estimate fail and the rewrite quietly fall back. The check runs the model as it is,
first on a meta-device copy (shapes only), else with fake tensors (ops without meta
kernels), and only where both fail, for real under no_grad on a deep copy: a failure
there is eager's own error. The user's model is not touched. The check runs in eval
mode: example inputs size the model, and a batch of one, which training-mode
BatchNorm rejects after global pooling, is a fine size.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from .. import measure
from ..errors import ConfigurationError
from .tracing import first_line


def check_accepted(model: nn.Module, inputs: Sequence[Any]) -> None:
    """Raise ConfigurationError, quoting eager's error, when `model(*inputs)` raises."""
    for run in (_meta_forward, _fake_forward):
        try:
            run(model, inputs)
            return
        except Exception:  # noqa: BLE001 - a gap in meta/fake coverage: the real forward decides
            pass
    try:
        with torch.no_grad():
            copy.deepcopy(model).eval()(*inputs)
    except Exception as exc:  # noqa: BLE001 - eager's own error, re-raised as one line
        raise ConfigurationError(
            f"example_inputs do not fit {type(model).__name__}: eager PyTorch raises "
            f"{type(exc).__name__}: {first_line(exc)} (pass arguments that model(*example_inputs) accepts)"
        ) from exc


def _meta_forward(model: nn.Module, inputs: Sequence[Any]) -> None:
    with torch.no_grad():
        measure.meta_copy(model).eval()(*measure.to_meta(inputs))


def _fake_forward(model: nn.Module, inputs: Sequence[Any]) -> None:
    flags = [m.training for m in model.modules()]
    try:
        model.eval()
        with FakeTensorMode(allow_non_fake_inputs=False) as mode, torch.no_grad():
            state = {name: mode.from_tensor(t) for name, t in (*model.named_parameters(), *model.named_buffers())}
            fake_inputs = [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in inputs]
            torch.func.functional_call(model, state, tuple(fake_inputs))
    finally:
        for m, flag in zip(model.modules(), flags):
            m.training = flag
