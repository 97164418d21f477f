"""Fake kernels and autograd for fxfuse::gelu and fxfuse::gelu_backward.

(Named gelu_op, not gelu, so that it does not collide with the `gelu` function
fxfuse.ops may export from act_functional.)

The fake kernels run ATen's own meta functions, so shapes, dtypes (type promotion
and broadcasting in gelu_backward) and strides are exactly those of the real
kernels, which allocate their outputs the way ATen's TensorIterator does.
"""
from __future__ import annotations

import torch

_APPROXIMATE = ("none", "tanh")


def _check_approximate(approximate: str) -> None:
    # The same RuntimeError the kernels (and F.gelu) raise.
    torch._check(
        approximate in _APPROXIMATE,
        lambda: f"fxfuse::gelu: approximate argument must be either none or tanh, got {approximate!r}",
    )


@torch.library.register_fake("fxfuse::gelu")
def _gelu_fake(self, *, approximate="none"):
    _check_approximate(approximate)
    return torch.ops.aten.gelu.default(self, approximate=approximate)


@torch.library.register_fake("fxfuse::gelu_backward")
def _gelu_backward_fake(grad_output, self, *, approximate="none"):
    _check_approximate(approximate)
    return torch.ops.aten.gelu_backward.default(grad_output, self, approximate=approximate)


def _gelu_setup(ctx, inputs, keyword_only_inputs, output):
    (self,) = inputs
    ctx.save_for_backward(self)
    ctx.approximate = keyword_only_inputs.get("approximate", "none")


def _gelu_bwd(ctx, grad_out):
    (self,) = ctx.saved_tensors
    return torch.ops.fxfuse.gelu_backward(grad_out, self, approximate=ctx.approximate)


torch.library.register_autograd("fxfuse::gelu", _gelu_bwd, setup_context=_gelu_setup)
