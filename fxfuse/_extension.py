"""Loads fxfuse._C, whose import registers the C++ operators under torch.ops.fxfuse.

A failed build or load is remembered and reported, with the fix, the first time an
op is used, instead of surfacing later as "operator fxfuse::... does not exist".
"""

from __future__ import annotations

import torch  # loads libtorch/libc10, which fxfuse._C links against

from .errors import ExtensionNotLoadedError

_load_error: BaseException | None = None
try:
    from . import _C  # noqa: F401  (import registers the ops)
except Exception as exc:  # ImportError, or an undefined-symbol OSError from a stale build
    _C = None
    _load_error = exc


def loaded() -> bool:
    return _C is not None


def built_against() -> str | None:
    """The torch version fxfuse._C was compiled against (recorded by setup.py), if known."""
    try:
        from ._build_info import TORCH_VERSION
    except ImportError:
        return None
    return TORCH_VERSION


def require() -> None:
    """Raise a clear error if the C++ extension is not available."""
    if _C is None:
        built = built_against()
        mismatch = (
            f" It was built against torch {built}, but this process runs torch {torch.__version__}."
            if built and built != torch.__version__
            else ""
        )
        raise ExtensionNotLoadedError(
            "fxfuse's C++ extension (fxfuse._C) failed to load: "
            f"{type(_load_error).__name__}: {_load_error}.{mismatch} "
            "Rebuild it against the torch you run with: `pip install --no-build-isolation .` "
            "(`-e .` for a checkout, or `make build`)."
        ) from _load_error


def generic_kernels():
    """torch.ops.fxfuse_generic: the device-generic kernels of the BN and GELU ops under their
    torch.ops.fxfuse schemas, callable on CPU, where torch.ops.fxfuse runs the hand-written
    kernels (used by the tests)."""
    require()
    return torch.ops.fxfuse_generic


def elementwise_kernels():
    """torch.ops.fxfuse_elementwise: bn_act and bn_act_backward through the CUDA kernels'
    per-element math, built for the host (used by the tests)."""
    require()
    return torch.ops.fxfuse_elementwise
