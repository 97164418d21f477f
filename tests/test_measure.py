"""Memory is measured, not assumed: saved activation bytes fall when fxfuse fuses."""

import copy
import os
import platform
import subprocess
import sys

import pytest
import torch
import torchvision
from torch import nn

import fxfuse
from fxfuse import measure
from fxfuse.measure import memory


def test_saved_bytes_fall_on_resnet18():
    model = torchvision.models.resnet18(num_classes=10)
    x = torch.randn(2, 3, 64, 64)
    eager = measure.saved_activation_bytes(model, (x,))
    fused = measure.saved_activation_bytes(fxfuse.optimize(copy.deepcopy(model)), (x,))
    assert fused < 0.6 * eager


def test_saved_bytes_match_the_conv_output_the_report_predicts():
    model = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.GELU(), nn.Conv2d(16, 4, 1))
    x = torch.randn(4, 8, 16, 16)
    eager = measure.saved_activation_bytes(model, (x,))
    optimized = fxfuse.optimize(copy.deepcopy(model), x)
    fused = measure.saved_activation_bytes(optimized, (x,))
    # Eager keeps the conv output (BN input) and the BN output (GELU input); fxfuse keeps neither.
    assert eager - fused == optimized.fxfuse_report.saved_bytes == 2 * 4 * 16 * 16 * 16 * 4


def test_parameters_and_inputs_are_not_counted():
    model = nn.Linear(1000, 1)
    x = torch.randn(2, 1000)
    assert measure.saved_activation_bytes(model, (x,)) == 0


def test_median_step_times_runs_every_variant():
    calls = []
    times = measure.median_step_times({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeats=3)
    assert set(times) == {"a", "b"} and calls.count("a") == 4  # one warm-up + three timed


_FRESH_MEMORY = """
import torch
from fxfuse import measure

def fresh():  # 64 MiB: above the 32 MiB ceiling of glibc's default mmap threshold, so each call maps it anew
    torch.empty(16 * 2**20).fill_(1.0)

faults = {}
measure.median_step_times({"fresh": fresh, "nothing": lambda: None}, repeats=3, faults=faults)
print(faults["fresh"], faults["nothing"])
"""


@pytest.mark.skipif(measure.minor_faults() is None, reason="no page-fault count on this platform")
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="another libc's allocator may keep freed memory")
def test_median_step_times_counts_the_page_faults_of_fresh_memory():
    # In a process of its own with glibc's defaults: the suite's own process may have an allocator
    # that keeps freed memory by now (a full run once counted no faults here).
    untuned = {
        k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "LD_PRELOAD")
    }
    run = subprocess.run([sys.executable, "-c", _FRESH_MEMORY], capture_output=True, text=True, env=untuned, check=True)
    fresh, nothing = map(float, run.stdout.split())
    assert fresh > nothing >= 0


def test_median_step_times_counts_no_faults_unless_asked_or_counted(monkeypatch):
    assert set(measure.median_step_times({"a": lambda: None}, repeats=1)) == {"a"}
    monkeypatch.setattr(memory, "resource", None)
    assert measure.minor_faults() is None
    faults: dict = {}
    measure.median_step_times({"a": lambda: None}, repeats=1, faults=faults)
    assert faults == {}


def test_median_step_times_gives_the_rounds_interquartile_range_over_the_median(monkeypatch):
    seconds = iter([1.0, 5.0, 2.0, 4.0, 3.0])
    monkeypatch.setattr(memory, "timed", lambda fn: next(seconds))
    spread: dict = {}
    times = measure.median_step_times({"a": lambda: None}, repeats=5, spread=spread)
    assert times == {"a": 3.0} and spread["a"] == pytest.approx((4.0 - 2.0) / 3.0)
    monkeypatch.setattr(memory, "timed", lambda fn: 1.0)
    measure.median_step_times({"a": lambda: None}, repeats=2, spread=(fewer := {}))
    assert fewer == {}  # no quartiles from two rounds


def test_timed_waits_for_the_device_work_it_times(monkeypatch):

    calls = []
    monkeypatch.setattr(memory, "synchronize", lambda: calls.append("sync"))
    seconds = memory.timed(lambda: calls.append("work"))
    assert calls == ["sync", "work", "sync"] and seconds >= 0


def test_median_step_times_synchronizes_around_each_timed_call(monkeypatch):

    calls = []
    monkeypatch.setattr(memory, "synchronize", lambda: calls.append("sync"))
    memory.median_step_times({"a": lambda: calls.append("a")}, repeats=2, warmup=0)
    assert calls == ["sync", "a", "sync"] * 2


def test_meta_copy_of_a_meta_model_shares_no_tensor_with_it():
    from torch import nn

    from fxfuse.measure import meta_copy

    model = meta_copy(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)))
    again = meta_copy(model)
    ours = {id(t) for t in (*model.parameters(), *model.buffers())}
    assert not ours & {id(t) for t in (*again.parameters(), *again.buffers())}
    assert all(t.is_meta for t in again.parameters())


def test_median_step_times_varies_the_order_of_rounds_and_repeats_it():
    def run():
        calls = []
        steps = {name: (lambda name=name: calls.append(name)) for name in "abcd"}
        measure.median_step_times(steps, repeats=6, warmup=0)
        return [tuple(calls[i : i + 4]) for i in range(0, 24, 4)]

    rounds = run()
    assert all(sorted(r) == list("abcd") for r in rounds)  # every variant once per round
    assert rounds[0] == tuple("abcd") and len(set(rounds)) > 1  # not always the same order
    assert run() == rounds  # a fixed seed: a rerun times the same sequence


def test_python_calls_counts_the_python_functions_a_run_enters_and_restores_the_profiler():
    def leaf():
        return 1

    def run():
        return leaf() + leaf() + len([1])  # len is C: no "call" event

    events = []

    def outer(frame, event, arg):
        events.append(event)

    sys.setprofile(outer)
    try:
        assert measure.python_calls(run) == 3
        assert sys.getprofile() is outer
    finally:
        sys.setprofile(None)
    assert measure.python_calls(lambda: None) == 1
