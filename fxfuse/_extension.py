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
    return _build_info("TORCH_VERSION")


def _build_info(name: str):
    try:
        from . import _build_info
    except ImportError:
        return None
    return getattr(_build_info, name, None)


def cuda_kernels() -> bool:
    """Whether fxfuse._C registered its CUDA kernels (built with them: see setup.py's FXFUSE_CUDA)."""
    return loaded() and torch._C._dispatch_has_kernel_for_dispatch_key("fxfuse::bn_act", "CUDA")


def summary() -> str:
    """One line on the extension: loaded or not, the torch it was built against, CUDA kernels or not, and why."""
    if not loaded():
        return f"fxfuse._C not loaded ({type(_load_error).__name__}: {_load_error})"
    reason = _build_info("CUDA_REASON")
    cuda = "with CUDA kernels" if cuda_kernels() else "CPU kernels only (CUDA runs the device-generic ATen path)"
    return f"fxfuse._C built against torch {built_against() or '?'}, {cuda}" + (f" [{reason}]" if reason else "")


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
