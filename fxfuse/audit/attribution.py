"""Where an op call came from: the innermost module, the user's source line, the autograd node.

Forward ops are attributed through module forward hooks (a stack of qualified names) and a
walk up the Python stack. Backward ops run inside the autograd engine, with no user frame
and no module on the stack, so each forward op's origin is logged against the autograd
sequence number: a node created by an op's autograd kernel takes the number just before the
one visible when the op reaches the dispatch mode, and in backward
`torch._C._current_autograd_node()._sequence_nr()` finds that forward op again.
"""

from __future__ import annotations

import bisect
import os
import sys
from dataclasses import dataclass
from types import CodeType
from typing import Optional

import torch

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_FXFUSE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_ACCUMULATE_GRAD = "torch::autograd::AccumulateGrad"


@dataclass(frozen=True)
class Origin:
    module: Optional[str]
    location: Optional[str]
    autograd_node: Optional[str] = None


class ModuleTracker:
    """Keeps the stack of running modules through forward pre/post hooks on every submodule."""

    def __init__(self, model: torch.nn.Module):
        self._stack: list[str] = []
        self._handles = []
        for name, module in model.named_modules():
            self._handles.append(module.register_forward_pre_hook(self._enter(name)))
            self._handles.append(module.register_forward_hook(self._leave, always_call=True))

    @property
    def current(self) -> Optional[str]:
        return self._stack[-1] if self._stack else None

    def _enter(self, name: str):
        def hook(module, args):
            self._stack.append(name)

        return hook

    def _leave(self, module, args, output):
        self._stack.pop()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class SourceLocator:
    """Finds the first Python frame outside torch and fxfuse: the line of model code that ran an op.

    Walking stops at `boundary` (the audit's own call into the model): an op issued only from
    torch's own modules (say, nn.Sequential running a Conv2d) has no user line.
    """

    def __init__(self, boundary: set[CodeType]):
        self._boundary = boundary
        self._internal: dict[CodeType, bool] = {}
        self._short_paths: dict[str, str] = {}

    def __call__(self) -> Optional[str]:
        frame = sys._getframe(1)
        while frame is not None:
            code = frame.f_code
            if code in self._boundary:
                return None
            internal = self._internal.get(code)
            if internal is None:
                internal = self._internal[code] = code.co_filename.startswith((_TORCH_DIR, _FXFUSE_DIR))
            if not internal:
                return f"{self._short_path(code.co_filename)}:{frame.f_lineno}"
            frame = frame.f_back
        return None

    def _short_path(self, filename: str) -> str:
        short = self._short_paths.get(filename)
        if short is None:
            short = self._short_paths[filename] = _shorten(filename)
        return short


def _shorten(filename: str) -> str:
    """Path relative to the working directory, else to the sys.path entry it was imported from."""
    path = os.path.abspath(filename)
    if not os.path.exists(path):
        return filename  # generated code such as torch.fx's '<eval_with_key>.3'
    roots = [os.getcwd()] + [os.path.abspath(p) for p in sys.path if p]
    best = max((r for r in roots if path.startswith(r + os.sep)), key=len, default=None)
    return os.path.relpath(path, best) if best else path


class AutogradOrigins:
    """Maps autograd nodes created during forward back to the forward op that created them."""

    def __init__(self, parameter_names: dict[int, str]):
        self._sequence_numbers: list[int] = []
        self._origins: list[Origin] = []
        self._parameter_names = parameter_names

    def log_forward_op(self, origin: Origin) -> None:
        self._sequence_numbers.append(torch.autograd._get_sequence_nr())
        self._origins.append(origin)

    def of_current_node(self) -> Origin:
        """Origin of the autograd node now running backward (module None when unknown)."""
        node = torch._C._current_autograd_node()
        if node is None:
            return Origin(None, None)
        name = node.name()
        if name == _ACCUMULATE_GRAD:
            # Gradient accumulation into a parameter: attribute it to the parameter's module.
            parameter = self._parameter_names.get(id(node.variable))
            module = parameter.rpartition(".")[0] if parameter is not None else None
            return Origin(module, None, "AccumulateGrad")
        index = bisect.bisect_right(self._sequence_numbers, node._sequence_nr())
        if index == len(self._origins):
            return Origin(None, None, name)
        forward = self._origins[index]
        return Origin(forward.module, forward.location, name)
