"""One bfloat16 autocast training step of an optimized model against eager autocast's."""

import copy

import torch

import fxfuse


def assert_trains_like_eager_autocast(model, x, exact=True):
    """Outputs equal to eager's under CPU bfloat16 autocast, and gradients equal (`exact`) or
    within bfloat16 rounding."""
    optimized = fxfuse.optimize(copy.deepcopy(model), x, mode="fast")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, ref = optimized(x), model(x)
    assert out.dtype == ref.dtype and torch.equal(out, ref)
    out.float().sum().backward()
    ref.float().sum().backward()
    for (name, p), q in zip(model.named_parameters(), optimized.parameters()):
        if exact:
            assert torch.equal(q.grad, p.grad), name
        else:
            torch.testing.assert_close(q.grad, p.grad, rtol=2e-2, atol=2e-2, msg=name)
