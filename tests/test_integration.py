"""fxfuse inside the stack users train with: torch.compile, export, DDP, SyncBatchNorm, determinism."""

import copy
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import fxfuse
from fxfuse.fusion import runtime
from fxfuse.testing import assert_equivalent


def small_cnn():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False),
        nn.BatchNorm2d(8),
        nn.GELU(),
        nn.BatchNorm2d(8),
        nn.SiLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )


def test_torch_compile_fullgraph_matches_eager_in_train_and_eval():
    torch._dynamo.reset()
    model = small_cnn()
    optimized = fxfuse.optimize(copy.deepcopy(model))
    compiled = torch.compile(optimized, fullgraph=True, backend="aot_eager")
    x = torch.randn(4, 3, 8, 8)
    out, ref = compiled(x), model(x)
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(ref)
    out.backward(grad)
    ref.backward(grad)
    for (name, p), q in zip(model.named_parameters(), optimized.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)
    for a, b in zip(model.buffers(), optimized.buffers()):
        torch.testing.assert_close(a, b)
    compiled.eval(), model.eval()
    torch.testing.assert_close(compiled(x), model(x))


def test_export_in_eval_mode():
    model = small_cnn().eval()
    optimized = fxfuse.optimize(copy.deepcopy(model))
    x = torch.randn(2, 3, 8, 8)
    exported = torch.export.export(optimized, (x,))
    assert any("fxfuse" in str(n.target) for n in exported.graph.nodes)
    torch.testing.assert_close(exported.module()(x), model(x))


def test_sync_batchnorm_is_skipped_with_a_reason(monkeypatch):
    # ATen's kernels as on an AVX2 CPU, where the GELU pass rewrites a standalone GELU.
    monkeypatch.setattr(runtime, "aten_cpu_capability", lambda: "AVX2")
    model = nn.SyncBatchNorm.convert_sync_batchnorm(small_cnn())
    report = fxfuse.explain(model)
    # The GELU after the SyncBatchNorm is then standalone: the GELU pass takes it (layout known at run time).
    assert [s.op for s in report.fused] == ["fxfuse::gelu"]
    assert report.skipped and all("SyncBatchNorm" in s.reason for s in report.skipped)


def test_deterministic_training_is_bitwise_repeatable():
    def run():
        torch.manual_seed(0)
        model = fxfuse.optimize(small_cnn())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(4, 3, 8, 8)
        for _ in range(2):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    torch.use_deterministic_algorithms(True)
    try:
        first, second = run(), run()
    finally:
        torch.use_deterministic_algorithms(False)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def _ddp_worker(rank, world, init_file, results):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.manual_seed(0)
    base = small_cnn().double()
    grads = {}
    for name, model in (("eager", copy.deepcopy(base)), ("fxfuse", fxfuse.optimize(copy.deepcopy(base)))):
        ddp = nn.parallel.DistributedDataParallel(model)
        torch.manual_seed(rank + 1)  # each rank sees different data
        x = torch.randn(4, 3, 8, 8, dtype=torch.double)
        ddp(x).square().sum().backward()
        grads[name] = [p.grad.clone() for p in model.parameters()]
    ok = all(torch.allclose(a, b, rtol=1e-9, atol=1e-12) for a, b in zip(grads["eager"], grads["fxfuse"]))
    results[rank] = ok
    dist.destroy_process_group()


def test_ddp_gradients_match_eager_ddp():
    with tempfile.TemporaryDirectory() as tmp:
        manager = mp.Manager()
        results = manager.dict()
        mp.spawn(_ddp_worker, args=(2, os.path.join(tmp, "init"), results), nprocs=2, join=True)
        assert dict(results) == {0: True, 1: True}


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_autocast_matches_eager_autocast(dtype):
    model = small_cnn()
    optimized = fxfuse.optimize(copy.deepcopy(model))
    x = torch.randn(4, 3, 8, 8)
    with torch.autocast("cpu", dtype=dtype):
        out, ref = optimized(x), model(x)
    assert out.dtype == ref.dtype
    torch.testing.assert_close(out, ref)


def test_verify_helper_on_the_small_cnn():
    model = small_cnn()
    optimized = fxfuse.optimize(copy.deepcopy(model))
    assert_equivalent(model, optimized, torch.randn(4, 3, 8, 8), dtype=torch.float64)
