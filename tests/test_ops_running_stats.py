"""fxfuse::update_running_stats_ and `update_running_stats` (fxfuse/ops/running_stats.py): the running
statistics the BN ops leave, against eager batch_norm's."""

import importlib

import pytest
import torch
import torch.nn.functional as F

from fxfuse import _extension

pytestmark = pytest.mark.skipif(not _extension.loaded(), reason="fxfuse._C is not built")

if _extension.loaded():
    from fxfuse.ops import generic_path


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("momentum", [0.1, 0.3, 1 / 3])
def test_update_running_stats_in_cpp_and_in_python(dtype, momentum, monkeypatch):
    """fxfuse::update_running_stats_ (eager: its CPU kernel, or its device-generic ATen calls) and
    the same ATen calls from Python (what tracing runs) give the same bits, bump the buffers'
    versions and add no history. In float32 and float64 those are eager batch_norm's bits; in
    half, eager's to an ulp (eager's statistics are its own kernel's) and no farther from the
    float64 value. bfloat16: eager's to an ulp, not its bits (eager rounds its batch statistics
    to bfloat16 in a way not reproduced here; over 200 random cases fxfuse's were the nearer to
    float64 in 726 elements, eager's in 327)."""
    module = importlib.import_module("fxfuse.ops.running_stats")
    torch.manual_seed(0)
    x = torch.randn(4, 6, 5, 5, dtype=dtype) * 3 + 1
    running = (torch.randn(6, dtype=dtype), torch.rand(6, dtype=dtype) + 0.5)
    eager = tuple(t.clone() for t in running)
    F.batch_norm(x, *eager, training=True, momentum=momentum)
    mean, _, unbiased_var = torch.ops.fxfuse.bn_stats(x)
    mean.requires_grad_()
    results = []
    # The CPU kernel, the op's device-generic form (ATen calls from C++), the same calls from Python.
    for native, generic in ((True, False), (True, True), (False, False)):
        op = torch.ops.fxfuse.update_running_stats_.default if native else None
        monkeypatch.setattr(module, "_native_update", lambda op=op: op)
        updated = tuple(t.clone() for t in running)
        version = updated[0]._version, updated[1]._version
        with generic_path(generic):
            module.update_running_stats(*updated, mean, unbiased_var, momentum)
        assert updated[0]._version > version[0] and updated[1]._version > version[1]
        assert not updated[0].requires_grad
        results.append(updated)
    assert all(torch.equal(a, b) for other in results[1:] for a, b in zip(results[0], other))
    if dtype in (torch.float32, torch.float64):
        assert all(torch.equal(a, b) for a, b in zip(results[0], eager))
        return
    x64 = x.double()
    exact = (momentum * x64.mean((0, 2, 3)), momentum * x64.var((0, 2, 3)))
    exact = tuple(e + (1 - momentum) * r.double() for e, r in zip(exact, running))
    for ours, theirs, value in zip(results[0], eager, exact):
        ulp = 2**-10 if dtype == torch.float16 else 2**-7
        torch.testing.assert_close(ours, theirs, rtol=ulp, atol=0)
        if dtype == torch.float16:
            assert (ours.double() - value).abs().sum() <= (theirs.double() - value).abs().sum()
