"""Higher-order autograd and torch.func for fxfuse's ops.

Each op's backward calls C++ backward ops that autograd cannot differentiate, so a backward
run with `create_graph=True` (a gradient penalty, a Hessian-vector product, MAML) would give
gradients that are silently not functions of what they depend on. When grad mode is on in a
backward and something it reads requires grad, the backward instead recomputes the op's forward
as eager ATen ops from what it saved and differentiates that with `create_graph=True`: eager's
own first- and second-order formulas, through any order. A normal backward runs grad mode off
and keeps the fast C++ path. The recompute never touches running statistics: BatchNorm runs
on the batch (`training=True` without running buffers) or on the saved statistics. The
Autograd kernels are C++ (csrc/autograd/, their shared helpers in autograd/function.h).

Forward-mode AD and torch.func transforms (`grad`, `vmap`, `jvp`, `hessian`, ...) do not pass
through the C++ ops: forward AD drops the tangent (the ops have no forward formula, and a dual
tensor does not require grad, so no autograd formula runs either), and functorch rejects a
C++ autograd Function. Under either, `transformed()` is true and the op wrappers and
the optimized forward run eager's ops instead (fusion/optimize.py).
"""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as forward_ad

__all__ = ["transformed"]


_functorch_active = torch._C._are_functorch_transforms_active


def transformed() -> bool:
    """Whether a torch.func transform or a forward-AD dual level is active: eager ops must run.
    About 0.2 us: the op wrappers ask it on every call."""
    return forward_ad._current_level >= 0 or _functorch_active()
