"""benchmarks/saved_by_shape.py: saved bytes by shape and by the op that wrote them, as fxfuse.measure counts."""

import importlib.util
from pathlib import Path

import torch
from torch import nn

import fxfuse
from fxfuse.measure import memory

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "saved_by_shape.py"


def _benchmark():
    spec = importlib.util.spec_from_file_location("saved_by_shape_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _net():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 4, 3, stride=2), nn.BatchNorm2d(4), nn.ReLU(),
    )  # fmt: skip


def test_totals_are_fxfuse_measure_counts_and_shapes_drop_the_batch():
    bench = _benchmark()
    x = torch.randn(2, 3, 16, 16)
    eager = _net()
    found = bench.saved_by_shape(eager, x, producers=False)
    assert sum(found.values()) == memory.saved_activation_bytes(eager, (x,)) > 0
    assert {shape for shape, op in found} == {(8, 16, 16), (4, 7, 7), (8,), (4,)}
    assert {op for _, op in found} == {""}


def test_producers_name_the_fused_ops_that_wrote_each_tensor():
    bench = _benchmark()
    x = torch.randn(2, 3, 16, 16)
    optimized = fxfuse.optimize(_net(), (x,), mode="fast")
    found = bench.saved_by_shape(optimized, x, producers=True)
    assert sum(found.values()) == memory.saved_activation_bytes(optimized, (x,))
    ops = {op for _, op in found}
    assert "bn_act_conv" in ops, ops
    assert "?" not in ops
