"""Higher-order autograd and torch.func for fxfuse's ops.

Each op's backward calls C++ backward ops that autograd cannot differentiate, so a backward
run with `create_graph=True` (a gradient penalty, a Hessian-vector product, MAML) would give
gradients that are silently not functions of what they depend on. When grad mode is on in a
backward and something it reads requires grad, the backward instead recomputes the op's forward
as eager ATen ops from what it saved and differentiates that with `create_graph=True`: eager's
own first- and second-order formulas, through any order. A normal backward runs grad mode off
and keeps the fast C++ path. The recompute never touches running statistics: BatchNorm runs
on the batch (`training=True` without running buffers) or on the saved statistics.

Forward-mode AD and torch.func transforms (`grad`, `vmap`, `jvp`, `hessian`, ...) do not pass
through the C++ ops: forward AD drops the tangent (the ops have no forward formula, and a dual
tensor does not require grad, so no autograd formula runs either), and functorch rejects
`register_autograd`'s function. Under either, `transformed()` is true and the op wrappers and
the optimized forward run eager's ops instead (fusion/optimize.py).

`needed` and `gradients_at` map an op's arguments to the gradients its backward computes, the
same way for both paths.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.autograd.forward_ad as forward_ad
from torch import Tensor

__all__ = ["composed_gradients", "differentiating", "gradients_at", "needed", "transformed"]


_functorch_active = torch._C._are_functorch_transforms_active


def transformed() -> bool:
    """Whether a torch.func transform or a forward-AD dual level is active: eager ops must run.
    About 0.2 us: the op wrappers ask it on every call."""
    return forward_ad._current_level >= 0 or _functorch_active()


def differentiating(*tensors: Optional[Tensor]) -> bool:
    """Whether a backward reading `tensors` runs for a graph of its own (create_graph=True)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def composed_gradients(
    compose: Callable[..., Tensor], tensors: Sequence[Optional[Tensor]], needed: Sequence[bool], grad_out: Tensor
) -> list[Optional[Tensor]]:
    """Gradients of `compose(*tensors)` against `grad_out` for the tensors `needed` marks (None
    elsewhere), themselves differentiable in `tensors` and `grad_out`."""
    wanted = [i for i, (t, need) in enumerate(zip(tensors, needed)) if need and t is not None]
    result: list[Optional[Tensor]] = [None] * len(tensors)
    if not wanted:
        return result
    with torch.enable_grad():
        out = compose(*tensors)
        grads = torch.autograd.grad(out, [tensors[i] for i in wanted], grad_out, create_graph=True, allow_unused=True)
    for i, grad in zip(wanted, grads):
        result[i] = grad
    return result


def needed(ctx, positions: Sequence[int]) -> list[bool]:
    """The output mask of a C++ backward op: whether autograd needs the gradient of the forward
    op's argument at each of `positions`."""
    return [ctx.needs_input_grad[i] for i in positions]


def gradients_at(positions: Sequence[int], grads: Sequence[Optional[Tensor]], count: int) -> tuple:
    """What an autograd formula returns for an op of `count` arguments: `grads` at `positions`, None elsewhere."""
    result: list[Optional[Tensor]] = [None] * count
    for index, grad in zip(positions, grads):
        result[index] = grad
    return tuple(result)
