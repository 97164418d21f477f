"""fusion/regions/time_model.py: seconds from FLOPs, bytes moved and ops, with measured constants."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from torch import nn

import fxfuse
from fxfuse.fusion.regions import time_model
from fxfuse.measure.traffic import OpCost, OpCosts

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


# ------------------------------------------------------------------ the time model of a device

PER_FLOP, PER_BYTE, PER_OP = 1e-13, 5e-12, 8e-6  # a made-up GPU: 10 TFLOP/s, 200 GB/s, 8 us per launch


def _fake_gpu_timer(probe: time_model.Probe) -> float:
    """What a device with the made-up rates would take for the probe, and the op run once for real (on CPU)."""
    probe.run()
    return probe.flops * PER_FLOP + probe.moved * PER_BYTE + PER_OP


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(time_model.CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(time_model.ENV, raising=False)
    monkeypatch.setattr(time_model, "_CACHE", {})
    return tmp_path


def test_measuring_a_faked_device_recovers_its_rates():
    rates = time_model.measure(
        torch.device("cuda"), torch.bfloat16, timer=_fake_gpu_timer, name="Fake GPU", probe_device=torch.device("cpu")
    )
    assert (rates.seconds_per_flop, rates.seconds_per_byte, rates.op_seconds) == pytest.approx(
        (PER_FLOP, PER_BYTE, PER_OP), rel=1e-6
    )
    assert (rates.device, rates.dtype) == ("Fake GPU", "bfloat16")
    assert rates.source.startswith("measured")


def test_the_probes_count_what_their_ops_move_and_compute():
    """The probes' FLOPs and bytes are measure.traffic's counts of the same ops (what the ranking prices)."""
    for probe in time_model.probes(torch.device("cpu"), torch.float32):
        with torch.no_grad(), OpCosts() as costs:
            out = probe.run()
        assert len(costs.ops) == 1, probe.kind
        assert costs.flops == probe.flops, probe.kind
        # traffic counts an out= argument as read too; the op only writes it.
        out_argument = 0 if probe.kind == "conv" else out.nbytes
        assert costs.moved == probe.moved + out_argument, probe.kind


def test_the_cuda_timer_reads_cuda_events_around_the_calls():
    clock = {"ms": 0.0, "synced": 0}

    class Event:
        def __init__(self, enable_timing):
            assert enable_timing
            self.at = None

        def record(self):
            self.at = clock["ms"]

        def elapsed_time(self, end):
            return end.at - self.at

    def run():
        clock["ms"] += 2.5  # each call: 2.5 ms of device time

    seconds = time_model.cuda_timer(
        time_model.Probe("matmul", 1, 1, run, calls=4),
        event=Event,
        synchronize=lambda: clock.update(synced=clock["synced"] + 1),
    )
    assert seconds == pytest.approx(2.5e-3)
    assert clock["synced"] == 4  # after the warm-up call and after each of the three timed runs


def test_a_device_is_measured_once_then_cached_in_process_and_on_disk(cache_dir):
    calls = []

    def measurer(device, dtype):
        calls.append((device, dtype))
        return time_model.Rates(PER_FLOP, PER_BYTE, PER_OP, "Fake GPU", "bfloat16", "measured today")

    device = torch.device("cuda")
    first = time_model.for_device(device, torch.bfloat16, measurer, name="Fake GPU")
    assert time_model.for_device(device, torch.bfloat16, measurer, name="Fake GPU") is first
    assert len(calls) == 1
    stored = json.loads((cache_dir / "time_model.json").read_text())
    key = time_model.cache_key("Fake GPU", torch.bfloat16)
    assert torch.__version__ in key and "bfloat16" in key and set(stored) == {key}
    time_model._CACHE.clear()  # a new process: read back from disk, not measured again
    again = time_model.for_device(device, torch.bfloat16, measurer, name="Fake GPU")
    assert len(calls) == 1
    assert (again.seconds_per_flop, again.seconds_per_byte, again.op_seconds) == (PER_FLOP, PER_BYTE, PER_OP)
    assert again.source.startswith("cached measured today")
    time_model.for_device(device, torch.float16, measurer, name="Fake GPU")  # another dtype: measured
    assert len(calls) == 2


def test_resolve_keeps_the_builtin_constants_on_cpu_and_measures_another_device(cache_dir, monkeypatch):
    monkeypatch.setattr(time_model, "device_name", lambda device: "Fake GPU")
    assert time_model.resolve(None, torch.device("cpu"), torch.float32) == time_model.builtin()
    assert time_model.resolve(None, torch.device("cpu"), torch.bfloat16) == time_model.builtin()
    faked = time_model.Rates(PER_FLOP, PER_BYTE, PER_OP, "cuda", "float32", "measured")
    got = time_model.resolve(None, torch.device("cuda"), torch.float32, measurer=lambda d, t: faked)
    assert got == faked


def test_a_pin_is_inline_json_a_file_or_a_dict_and_wins_over_the_device(cache_dir, tmp_path, monkeypatch):
    spec = {"seconds_per_flop": 1e-12, "seconds_per_byte": 2e-11, "op_seconds": 5e-6}
    path = tmp_path / "rates.json"
    path.write_text(json.dumps({**spec, "device": "NVIDIA H100", "dtype": "bfloat16"}))
    inline = time_model.resolve(json.dumps(spec), torch.device("cpu"), torch.float32)
    from_file = time_model.resolve(str(path), torch.device("cuda"), torch.float32, measurer=_no_measuring)
    from_dict = time_model.resolve(spec, torch.device("cuda"), torch.float32, measurer=_no_measuring)
    for rates in (inline, from_file, from_dict):
        assert (rates.seconds_per_flop, rates.seconds_per_byte, rates.op_seconds) == (1e-12, 2e-11, 5e-6)
        assert rates.source.startswith("pinned")
    assert (from_file.device, from_file.dtype) == ("NVIDIA H100", "bfloat16")
    monkeypatch.setenv(time_model.ENV, str(path))
    assert time_model.resolve(None, torch.device("cuda"), torch.float32, measurer=_no_measuring) == from_file
    monkeypatch.setenv(time_model.ENV, "builtin")
    assert time_model.resolve(None, torch.device("cuda"), torch.float32, measurer=_no_measuring).source == (
        time_model.BUILTIN_SOURCE
    )
    with pytest.raises(ValueError, match="missing op_seconds"):
        time_model.pinned({"seconds_per_flop": 1e-12, "seconds_per_byte": 1e-11})
    with pytest.raises(ValueError, match="positive"):
        time_model.pinned({**spec, "seconds_per_flop": -1})


def _no_measuring(device, dtype):
    raise AssertionError("a pinned time model is not measured")


def test_using_prices_with_the_rates_given_and_restores_the_builtin():
    rates = time_model.Rates(1e-10, 1e-9, 1e-5)
    with time_model.using(rates):
        assert time_model.seconds(10, 100, 1) == pytest.approx(10 * 1e-10 + 100 * 1e-9 + 1e-5)
        assert time_model.seconds_per_flop() == 1e-10
    assert time_model.in_use() == time_model.builtin()


def _net():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
    )


def test_the_report_shows_the_time_model_and_its_dict_reproduces_the_plan(cache_dir):
    x = torch.randn(2, 3, 24, 24)
    report = fxfuse.explain(_net(), x, memory_budget=0.4)
    assert report.time_model == time_model.builtin()  # CPU: the built-in constants, as before
    # The report wraps its lines at 100 columns.
    assert f"time model: {time_model.builtin().describe()}" in " ".join(str(report).split())
    assert "450 GFLOP/s" in str(report)
    pin = report.to_dict()["time_model"]
    again = fxfuse.explain(_net(), x, memory_budget=0.4, time_model=pin)
    assert [s.name for s in again.fused] == [s.name for s in report.fused]
    assert again.time_model.seconds_per_byte == time_model.SECONDS_PER_BYTE
    # A pin other than the built-in rates prices the ranking's estimates with its own rates.
    slow = {**pin, "seconds_per_flop": 100 * pin["seconds_per_flop"]}
    assert (
        fxfuse.explain(_net(), x, memory_budget=0.4, time_model=slow).time_model.seconds_per_flop
        == (slow["seconds_per_flop"])
    )
    with pytest.raises(fxfuse.errors.ConfigurationError, match="time_model"):
        fxfuse.explain(_net(), x, memory_budget=0.4, time_model="/nonexistent/rates.json")


def test_without_a_budget_nothing_is_measured_and_no_time_model_is_reported(cache_dir, monkeypatch):
    monkeypatch.setattr(time_model, "measure", _no_measuring)
    report = fxfuse.explain(_net(), torch.randn(2, 3, 24, 24), time_model="measure")
    assert report.time_model is None and "time model:" not in str(report)
