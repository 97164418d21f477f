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


def _gpu_check_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "tools", "gpu_check.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_covers_the_issue_32_checklist():
    """Every item a first GPU run needs is a phase of tools/gpu_check.sh: the CUDA build, the CUDA
    tests, float64 exactness on the four models, autocast, kernel GB/s, train steps, the
    largest batch in fp32 and AMP, fxfuse bench --fit-cap on ResNet-50 and EfficientNet-B0."""
    script = open(os.path.join(ROOT, "tools", "gpu_check.sh")).read()
    default = next(line for line in script.splitlines() if line.startswith("PHASES="))
    phases = default.split(":-", 1)[1].rstrip("}").split()
    assert phases == [
        "build",
        "env",
        "tests",
        "exact",
        "autocast",
        "kernels",
        "step",
        "profile",
        "fit",
        "bench",
        "bench-effnet",
    ]
    assert "torchvision:resnet50 --input-shape 64,3,224,224 --device cuda" in script
    assert "torchvision:efficientnet_b0 --input-shape 64,3,224,224 --device cuda" in script
    assert script.count("--fit-cap 16GiB") == 2
    gpu_check = _gpu_check_module()
    assert {"resnet50", "efficientnet_b0", "convnext_tiny", "vit_b_16"} <= set(gpu_check._models())
    for phase in phases:
        assert phase in ("build", "tests", "bench", "bench-effnet") or callable(getattr(gpu_check, phase)), phase


def test_gpu_check_writes_markdown_tables(tmp_path):
    gpu_check = _gpu_check_module()
    gpu_check._write(str(tmp_path), "rows", [{"model": "resnet50", "x": 1.5}, {"model": "vit", "x": 2}])
    gpu_check._write(str(tmp_path), "lists", [["a", 1]], ["name", "n"])
    gpu_check._write(str(tmp_path), "env", {"device": "H100"})
    assert (tmp_path / "rows.md").read_text() == "| model | x |\n|---|---|\n| resnet50 | 1.5 |\n| vit | 2 |\n"
    assert (tmp_path / "lists.md").read_text() == "| name | n |\n|---|---|\n| a | 1 |\n"
    assert (tmp_path / "env.md").read_text() == "* device: H100\n"
    assert (tmp_path / "rows.json").exists()


def test_gpu_check_phases_import_fxfuse_from_the_checkout(tmp_path):
    """The first GPU run lost every Python phase to `No module named 'fxfuse'`: fxfuse was built in
    place, not installed, and tools/gpu_check.py's sys.path starts at tools/. A stand-in python that
    claims a GPU records the PYTHONPATH each phase gets."""
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\n[ "$1" = "-c" ] && exit 0\necho "$PYTHONPATH" >> "$(dirname "$0")/seen"\n')
    fake.chmod(0o755)
    run = subprocess.run(
        [os.path.join(ROOT, "tools", "gpu_check.sh"), str(tmp_path / "out"), "env", "kernels"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHON": str(fake), "PYTHONPATH": "/elsewhere"},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    seen = (tmp_path / "seen").read_text().split()
    assert seen == [f"{ROOT}:/elsewhere"] * 2
