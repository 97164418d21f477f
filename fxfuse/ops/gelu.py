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
from .autograd_kernel import register_autograd
from .checks import fusable, plain
from .higher_order import composed_gradients, differentiating

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


def _gelu_setup(ctx, inputs, keyword_only_inputs, output):
    (self,) = inputs
    ctx.save_for_backward(self)
    ctx.approximate = keyword_only_inputs.get("approximate", "none")


def _gelu_bwd(ctx, grad_out):
    (self,) = ctx.saved_tensors
    if differentiating(grad_out, self):
        return composed_gradients(lambda x: F.gelu(x, approximate=ctx.approximate), (self,), (True,), grad_out)[0]
    return torch.ops.fxfuse.gelu_backward(grad_out, self, approximate=ctx.approximate)


def register() -> None:
    """Fake kernels and autograd of this module's ops (fxfuse._C defines the ops)."""
    torch.library.register_fake("fxfuse::gelu", _gelu_fake)
    torch.library.register_fake("fxfuse::gelu_backward", _gelu_backward_fake)
    register_autograd("fxfuse::gelu", _gelu_bwd, setup_context=_gelu_setup)
