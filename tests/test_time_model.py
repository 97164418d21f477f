"""fusion/regions/time_model.py: seconds from FLOPs, bytes moved and ops, with measured constants."""

import importlib.util
from pathlib import Path

import pytest

from fxfuse.fusion.regions import time_model
from fxfuse.measure.traffic import OpCost

ROOT = Path(__file__).resolve().parent.parent


def test_seconds_add_up_each_term():
    assert time_model.seconds(0) == 0
    assert time_model.seconds(3e9, 2e9, 10) == pytest.approx(
        3e9 * time_model.SECONDS_PER_FLOP + 2e9 * time_model.SECONDS_PER_BYTE + 10 * time_model.OP_SECONDS
    )


def test_a_byte_moved_costs_more_than_a_flop():
    # Every CPU and GPU computes several FLOPs in the time it moves one byte from memory; were it not so,
    # the pointwise ops would be the cheap ones to keep and the convs the cheap ones to recompute.
    assert time_model.SECONDS_PER_BYTE > 4 * time_model.SECONDS_PER_FLOP > 0
    assert 0 < time_model.OP_SECONDS < 1e-3


def _benchmark():
    spec = importlib.util.spec_from_file_location("time_model_bench", ROOT / "benchmarks" / "time_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_benchmark_fit_recovers_the_constants_of_timed_ops():
    """benchmarks/time_model.py's fit, on ops timed exactly by known constants, gives those constants back."""
    bench = _benchmark()
    per_flop, per_byte, per_op = 1e-11, 2e-10, 5e-6

    def op(flops, moved):
        return OpCost("op", flops, moved, flops * per_flop + moved * per_byte + per_op)

    ops = [op(0, 100), op(0, 1000), op(0, 4 << 20), op(0, 16 << 20), op(10**9, 1 << 20), op(4 * 10**9, 8 << 20)]
    fitted = bench.fit(ops)
    assert fitted == pytest.approx((per_flop, per_byte, per_op), rel=1e-3)
    assert bench.predict(ops, *fitted) == pytest.approx(sum(o.seconds for o in ops), rel=1e-3)
