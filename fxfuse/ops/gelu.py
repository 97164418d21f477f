"""`gelu`, fxfuse::gelu and fxfuse::gelu_backward.

`gelu(x, approximate)` computes `F.gelu(x, approximate=approximate)` with fxfuse's
hand-written CPU kernels (ATen's elsewhere), in its input's dtype as F.gelu does.
The fake kernels run ATen's own meta functions, so shapes, dtypes (type promotion
and broadcasting in gelu_backward) and strides are exactly those of the real
kernels, which allocate their outputs the way ATen's TensorIterator does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import compiled
from .checks import fusable, plain

__all__ = ["gelu"]

_APPROXIMATE = ("none", "tanh")


def gelu(input: Tensor, approximate: str = "none") -> Tensor:
    """`F.gelu(input, approximate=approximate)`.

    Under torch.compile with fxfuse.ops.compiled.enabled it is F.gelu itself, which
    inductor fuses with its neighbours (both keep only the input for backward)."""
    if approximate in _APPROXIMATE and plain(input) and fusable(input) and not compiled.composing():
        return torch.ops.fxfuse.gelu(input, approximate=approximate)
    return F.gelu(input, approximate=approximate)


def _check_approximate(approximate: str) -> None:
    # The same RuntimeError the kernels (and F.gelu) raise.
    torch._check(
        approximate in _APPROXIMATE,
        lambda: f"fxfuse::gelu: approximate argument must be either none or tanh, got {approximate!r}",
    )


def _gelu_fake(self, *, approximate="none"):
    _check_approximate(approximate)
    return torch.ops.aten.gelu.default(self, approximate=approximate)


def _gelu_backward_fake(grad_output, self, *, approximate="none"):
    _check_approximate(approximate)
    return torch.ops.aten.gelu_backward.default(grad_output, self, approximate=approximate)


def register() -> None:
    """Fake kernels of this module's ops (fxfuse._C defines the ops and gelu's Autograd kernel)."""
    torch.library.register_fake("fxfuse::gelu", _gelu_fake)
    torch.library.register_fake("fxfuse::gelu_backward", _gelu_backward_fake)
