"""benchmarks/allocator_faults.py: step time and page faults under each CPU allocator setting."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from fxfuse import measure

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "allocator_faults.py"


def _benchmark():
    spec = importlib.util.spec_from_file_location("allocator_faults_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_child_gets_its_setting_and_no_inherited_allocator_setting():
    bench = _benchmark()
    environ = {
        "PATH": "/bin",
        "MALLOC_ARENA_MAX": "2",
        "GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1",
        "LD_PRELOAD": "x.so",
    }
    assert bench.child_env("default", environ) == {"PATH": "/bin"}
    assert bench.child_env("thp", environ) == {"PATH": "/bin", "THP_MEM_ALLOC_ENABLE": "1"}
    no_trim = bench.child_env("no-trim", {**environ, "THP_MEM_ALLOC_ENABLE": "1"})
    assert set(no_trim) == {"PATH", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"}


def test_each_setting_runs_in_a_process_of_its_own():
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", "tests.test_bench:small_net", "--shape", "2,3,16,16"]
        + ["--repeats", "1", "--budget", "0.5", "--no-compile", "--settings", "default,no-trim"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)},
    )
    system, *lines = [line for line in run.stdout.splitlines() if line.strip()]
    assert system.startswith("libc ")
    rows = [line.split() for line in lines]
    assert [row[0] for row in rows] == ["default"] * 3 + ["no-trim"] * 3
    assert [row[1] for row in rows[:3]] == ["eager-channels_last", "fast", "budget=0.5"]
    counted = measure.minor_faults() is not None
    assert all(row[-1] == "faults" and (row[-2].isdigit() if counted else row[-2] == "-") for row in rows)


def test_unknown_settings_and_a_hand_given_setting_are_refused():
    bad = subprocess.run(
        [sys.executable, str(SCRIPT), "--settings", "default,jemalloc"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "jemalloc" in bad.stderr
    by_hand = subprocess.run(
        [sys.executable, str(SCRIPT), "--setting", "thp"], capture_output=True, text=True, env={"PATH": "/usr/bin"}
    )
    assert by_hand.returncode == 2 and "child processes" in by_hand.stderr
