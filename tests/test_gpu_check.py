"""tools/gpu_check.sh (`make gpu-check`): on a machine without a GPU it stops at once with one line."""

import os
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: make gpu-check runs for real here")
def test_gpu_check_stops_in_seconds_with_one_line_without_a_gpu(tmp_path):
    start = time.perf_counter()
    run = subprocess.run(
        [os.path.join(ROOT, "tools", "gpu_check.sh"), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert run.returncode == 2
    assert run.stdout.strip().count("\n") == 0 and "no CUDA GPU" in run.stdout
    assert not (tmp_path / "out").exists()
    assert time.perf_counter() - start < 30


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_each_gpu_check_section_refuses_without_a_gpu():
    run = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "gpu_check.py"), "kernels"], capture_output=True, text=True
    )
    assert run.returncode == 1 and "no CUDA GPU" in run.stderr
