"""audit_channels_last: run a model in channels_last and report every aten op that returns NCHW."""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Optional

import torch
from torch._subclasses import fake_tensor
from torch.utils._pytree import tree_leaves, tree_map_only

from ..errors import AuditError, ConfigurationError, FxFuseError
from .attribution import AutogradOrigins, ModuleTracker, SourceLocator
from .mode import FormatAuditMode
from .report import BACKWARD, ChannelsLastReport
from .rules import AMBIGUOUS, CAVEAT, INFO, LOSS

_FAKE_UNSUPPORTED = (
    fake_tensor.DataDependentOutputException,
    fake_tensor.DynamicOutputShapeException,
    fake_tensor.UnsupportedOperatorException,
    fake_tensor.UnsupportedFakeTensorException,
)


def audit_channels_last(
    model: torch.nn.Module,
    *example_inputs: Any,
    backward: bool = True,
    fake: bool = False,
    train: Optional[bool] = None,
) -> ChannelsLastReport:
    """Run `model` in channels_last on `example_inputs` and report the ops that lose the format.

    The audit runs a copy of the model converted to channels_last, on copies of the inputs
    (4-D tensors converted to channels_last), so `model` itself is never changed: no
    parameter, buffer, gradient or training flag. Every aten op is seen through a
    TorchDispatchMode, Tensor operators and (with `backward=True`) the backward pass included.

    Args:
        model: the module to audit. Inputs may be nested tuples/lists/dicts with non-tensors.
        backward: also run backward, seeding each output that requires grad with ones.
        fake: run under FakeTensorMode: no real compute, so large models and batches are
            audited in seconds. Output strides then come from meta kernels and decompositions;
            findings on (or downstream of) ops whose fake strides are known to differ from the
            real kernel's carry a `note`, and such ops that look fine on fake tensors are listed
            in `report.caveats`. A model built on the meta device (no weights allocated) is
            audited as a CPU model in this mode; pass meta inputs too.
        train: force train (True) or eval (False) mode on the copy; None keeps the model's mode.

    Raises:
        AuditError: the model failed on the example inputs (the message names their shapes).
    """
    if not isinstance(model, torch.nn.Module):
        raise ConfigurationError(f"audit_channels_last needs an nn.Module, got {type(model).__name__}")
    fake_mode = fake_tensor.FakeTensorMode(allow_non_fake_inputs=True) if fake else None
    copier = _ChannelsLastCopier(fake_mode)
    audited = copier.copy_model(model)
    if train is not None:
        audited.train(train)
    inputs = tree_map_only(torch.Tensor, copier.copy_tensor, example_inputs)
    input_shapes = [tuple(t.shape) for t in tree_leaves(example_inputs) if isinstance(t, torch.Tensor)]
    describe = f"{type(model).__name__} on example input(s) of shape {_shapes(input_shapes)}"

    tracker = ModuleTracker(audited)
    origins = None
    if backward:
        origins = AutogradOrigins({id(p): name for name, p in audited.named_parameters()})
    mode = FormatAuditMode(tracker, SourceLocator({_run_forward.__code__, _run_backward.__code__}), origins, fake=fake)
    backward_skipped = None
    try:
        with fake_mode if fake_mode is not None else contextlib.nullcontext():
            outputs = _run_forward(audited, inputs, mode, backward, describe, fake)
            if backward:
                backward_skipped = _run_backward(outputs, mode, describe, fake)
    finally:
        tracker.remove()

    results = mode.results()
    return ChannelsLastReport(
        model=type(model).__name__,
        input_shapes=input_shapes,
        training=audited.training,
        fake=fake,
        backward=backward and backward_skipped is None,
        findings=results[LOSS],
        info=results[INFO],
        ambiguous=results[AMBIGUOUS],
        caveats=results[CAVEAT],
        ops_seen=dict(mode.ops_seen),
        ops_checked=dict(mode.ops_checked),
        saw_4d_tensors=mode.saw_4d_tensors,
        backward_skipped=backward_skipped,
    )


class _ChannelsLastCopier:
    """Copies tensors (and models, tensor by tensor) into channels_last, real or fake."""

    def __init__(self, fake_mode: Optional[fake_tensor.FakeTensorMode]):
        self._fake_mode = fake_mode

    def copy_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._fake_mode is not None:
            copied = self._fake_copy(tensor)
        elif tensor.dim() == 4:
            copied = tensor.detach().clone(memory_format=torch.channels_last)
        else:
            copied = tensor.detach().clone()
        if isinstance(tensor, torch.nn.Parameter):
            return torch.nn.Parameter(copied, requires_grad=tensor.requires_grad)
        if tensor.requires_grad:
            copied.requires_grad_()
        return copied

    def _fake_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A fake tensor with `tensor`'s metadata (4-D ones in channels_last); values are never needed."""
        if tensor.dim() == 4:
            meta = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta", memory_format=torch.channels_last)
        else:
            meta = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")
        # Meta tensors carry no real device: fake them as CPU tensors, so that kernels pick
        # their CPU memory formats (on the meta device, convolution returns NCHW).
        device = torch.device("cpu") if tensor.is_meta else tensor.device
        return self._fake_mode.fake_tensor_converter.from_meta_and_device(self._fake_mode, meta, device)

    def copy_model(self, model: torch.nn.Module) -> torch.nn.Module:
        # Seeding deepcopy's memo swaps every parameter and buffer for its channels_last copy,
        # so no tensor is copied twice and in fake mode no real memory is allocated at all.
        memo: dict[int, Any] = {}
        for tensor in [*model.parameters(), *model.buffers()]:
            if id(tensor) not in memo:
                memo[id(tensor)] = self.copy_tensor(tensor)
        try:
            return copy.deepcopy(model, memo)
        except Exception as exc:
            raise AuditError(
                f"the audit runs a copy of the model, but copy.deepcopy({type(model).__name__}) failed: {exc}"
            ) from exc


def _run_forward(model, inputs: tuple, mode: FormatAuditMode, grad: bool, describe: str, fake: bool):
    try:
        with torch.set_grad_enabled(grad), mode:
            return model(*inputs)
    except FxFuseError:
        raise
    except Exception as exc:
        raise _model_failed(exc, describe, "forward", fake) from exc


def _run_backward(outputs: Any, mode: FormatAuditMode, describe: str, fake: bool) -> Optional[str]:
    """Backpropagate ones from every output that requires grad; return why not, if nothing does."""
    roots = [t for t in tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not roots:
        return "no output requires grad"
    seeds = [torch.ones_like(t) for t in roots]  # ones_like keeps each output's memory format
    mode.phase = BACKWARD
    try:
        with mode:
            torch.autograd.backward(roots, seeds)
    except Exception as exc:
        raise _model_failed(exc, describe, "backward", fake) from exc
    return None


def _model_failed(exc: Exception, describe: str, phase: str, fake: bool) -> AuditError:
    if fake and isinstance(exc, _FAKE_UNSUPPORTED):
        return AuditError(f"fake mode cannot run {describe} ({type(exc).__name__}: {exc}); audit with fake=False")
    return AuditError(f"{describe} failed in {phase}: {type(exc).__name__}: {exc}")


def _shapes(shapes: list[tuple[int, ...]]) -> str:
    return ", ".join("(" + ", ".join(map(str, s)) + ")" for s in shapes) or "(no tensors)"
