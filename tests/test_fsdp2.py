"""FSDP2 (`torch.distributed.fsdp.fully_shard`) over an fxfuse-optimized model trains like over the eager model.

Two ranks, gloo, CPU, float64: both ranks build the same model, each trains the eager
and the optimized copy, each wrapped with fully_shard, for two SGD steps on its own
data; the full (unsharded) gradients and parameters must match to 1e-9.
"""

from __future__ import annotations

import copy
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import fxfuse

fully_shard = pytest.importorskip("torch.distributed.fsdp").fully_shard


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _train(model: nn.Module, rank: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Two SGD steps on rank-specific data; the full gradients of the last step and the full parameters."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(rank + 1)
    for _ in range(2):
        opt.zero_grad()
        x = torch.randn(4, 3, 8, 8, generator=data, dtype=torch.float64)
        model(x).square().sum().backward()
        grads = [_full(p.grad).clone() for p in model.parameters()]
        opt.step()
    return grads, [_full(p.detach()).clone() for p in model.parameters()]


def _worker(rank: int, world: int, init_file: str, order: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        base = small_cnn().double()
        eager = fully_shard(copy.deepcopy(base))
        if order == "optimize_then_shard":
            optimized = fully_shard(fxfuse.optimize(copy.deepcopy(base)))
        else:
            optimized = fxfuse.optimize(fully_shard(copy.deepcopy(base)))
        fused = len(optimized.fxfuse_report.fused)
        (g_eager, p_eager), (g_opt, p_opt) = _train(eager, rank), _train(optimized, rank)
        worst = max(
            (a - b).abs().max().item() / max(a.abs().max().item(), 1e-300)
            for a, b in zip(g_eager + p_eager, g_opt + p_opt)
        )
        results[rank] = (fused, worst, isinstance(optimized, torch.distributed.fsdp.FSDPModule))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("order", ["optimize_then_shard", "shard_then_optimize"])
def test_fully_shard_over_the_optimized_model_matches_eager_fsdp(order):
    with tempfile.TemporaryDirectory() as tmp:
        results = mp.Manager().dict()
        mp.spawn(_worker, args=(2, os.path.join(tmp, "init"), order, results), nprocs=2, join=True)
        results = dict(results)
    assert set(results) == {0, 1}
    for rank, (fused, worst, is_fsdp) in results.items():
        assert fused == 2, (rank, fused)
        assert is_fsdp
        assert worst <= 1e-9, (rank, worst)
