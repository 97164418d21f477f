"""benchmarks/allocator_faults.py: step time and page faults under each CPU allocator setting."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "allocator_faults.py"


def _benchmark():
    spec = importlib.util.spec_from_file_location("allocator_faults_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="minor page faults as Linux's getrusage counts them")
def test_rounds_count_the_faults_of_fresh_memory():
    bench = _benchmark()

    def fresh():  # 64 MiB: above glibc's largest mmap threshold, so each call maps and faults it anew
        torch.empty(16 * 2**20).fill_(1.0)

    results = bench.timed_rounds({"fresh": fresh, "nothing": lambda: None}, repeats=3)
    assert set(results) == {"fresh", "nothing"}
    seconds, faults = results["fresh"]
    assert seconds > 0
    assert faults > results["nothing"][1]


def test_each_setting_runs_in_a_process_of_its_own():
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", "torchvision:resnet18", "--shape", "2,3,32,32", "--repeats", "1"]
        + ["--budget", "0.5", "--no-compile", "--settings", "default,no-trim"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    rows = [line.split() for line in run.stdout.splitlines() if line.strip()]
    assert [row[0] for row in rows] == ["default"] * 3 + ["no-trim"] * 3
    assert all(line.rstrip().endswith("faults") for line in run.stdout.splitlines() if line.strip())
    assert "memory_budget=0.5" in run.stdout
