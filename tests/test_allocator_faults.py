"""benchmarks/allocator_faults.py: step time and page faults under each CPU allocator setting."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "allocator_faults.py"


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
