"""tools/gpu_check.sh (`make gpu-check`): on a machine without a GPU it stops at once with one line;
its time-boxed phases (speed, frontier, fit) run on the CPU as a dry run with tiny models."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from support.threads import intra_op_threads

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
        "speed",
        "frontier",
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


def _dry_run(tmp_path, *args, timeout=600):
    run = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "gpu_check.py"), *args, "--dry-run", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
        timeout=timeout,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run


SPEED_FIELDS = {"model", "precision", "batch", "variant", "saved_x", "peak_x", "time_x", "step_ms"}
SPEED_FIELDS |= {"launches_per_step", "host_ms_per_step", "card"}


def test_speed_dry_run_measures_every_variant_with_every_column(tmp_path):
    _dry_run(tmp_path, "speed", "--models", "resnet50", "--precisions", "bf16", "--compile-backend", "eager")
    rows = json.loads((tmp_path / "speed.json").read_text())
    assert [r["variant"] for r in rows] == [
        "eager",
        "fast",
        "memory",
        "memory_budget=0.5",
        "compile",
        "compile(fxfuse fast)",
        "compile budget=0.5",
    ]
    for r in rows:
        assert SPEED_FIELDS <= set(r), r
        assert (r["model"], r["precision"], r["batch"]) == ("resnet50", "bf16", 4)
        assert r["card"].startswith("cpu dry run") and r["step_ms"] > 0 and r["host_ms_per_step"] > 0
        assert r["launches_per_step"] == 0  # no CUDA runtime on the CPU: counted, and none found
    by = {r["variant"]: r for r in rows}
    assert (by["eager"]["saved_x"], by["eager"]["peak_x"], by["eager"]["time_x"]) == (1.0, 1.0, 1.0)
    assert by["memory"]["saved_x"] < by["fast"]["saved_x"] < 1.0
    table = (tmp_path / "speed.md").read_text()
    assert "| compile budget=0.5 |" in table and "cpu dry run" in table


def test_frontier_dry_run_compiles_at_each_budget_reuses_rows_of_the_same_card_and_plots(tmp_path):
    gpu_check = _gpu_check_module()
    card = f"cpu dry run ({__import__('platform').machine()}, 1 threads)"
    earlier = {"model": "resnet50", "precision": "bf16", "batch": 4, "variant": "fast", "bench_variant": "fast"}
    earlier.update(saved_bytes=1, peak_bytes=2, step_ms=12345.0)
    elsewhere = {**earlier, "bench_variant": "checkpoint", "card": "NVIDIA H100 80GB HBM3"}
    (tmp_path / "speed.json").write_text(json.dumps([{**earlier, "card": card}, elsewhere]))
    _dry_run(tmp_path, "frontier", "--models", "resnet50", "--budgets", "0.5")
    rows = json.loads((tmp_path / "frontier.json").read_text())
    by = {r["variant"]: r for r in rows}
    assert list(by) == [
        "eager",
        "fxfuse fast",
        "fxfuse budget=0.5",
        "checkpoint",
        "compile budget=0.5",
        "compile(fxfuse budget=0.5)",
        "compile",
    ]
    assert gpu_check.frontier_labels((0.5,))["compile(budget=0.5)"] == "compile(fxfuse budget=0.5)"
    assert by["fxfuse fast"]["source"] == "speed.json" and by["fxfuse fast"]["step_ms"] == 12345.0
    assert by["checkpoint"]["source"] == "measured"  # the other card's row is not reused
    for r in rows:
        assert {"model", "precision", "variant", "saved_x", "peak_x", "time_x", "card"} <= set(r)
    # compile's partitioner ran under the budget: it keeps less than plain compile
    assert by["compile budget=0.5"]["saved_x"] < 0.8 * by["compile"]["saved_x"]
    assert by["fxfuse budget=0.5"]["saved_x"] <= 0.55
    assert (tmp_path / "frontier.svg").read_text().lstrip().startswith("<?xml")


def test_fit_dry_run_gives_the_largest_batch_and_time_per_sample(tmp_path):
    _dry_run(tmp_path, "fit", "--models", "resnet50", "--precisions", "fp32", "--fit-variants", "eager,memory")
    eager, memory = json.loads((tmp_path / "fit.json").read_text())
    assert (eager["variant"], memory["variant"]) == ("eager", "memory")
    assert eager["batch"] > 1 and memory["batch"] > eager["batch"]
    assert eager["batch_x"] == 1.0 and memory["batch_x"] == round(memory["batch"] / eager["batch"], 3)
    assert eager["ms_per_sample"] > 0 and memory["time_per_sample_x"] > 0


def _out_of_time_speed(out):
    """A speed dry run with no time left, in this process: it measures nothing, so a process of its own
    would only import torch again (the dry runs above take the command line's path)."""
    gpu_check = _gpu_check_module()
    args = ["speed", "--budget-s", "0", "--models", "resnet50", "--precisions", "bf16", "--dry-run"]
    with intra_op_threads(torch.get_num_threads()):  # a dry run pins one intra-op thread
        gpu_check.speed(gpu_check.parse_args([*args, "--out", str(out)]))


def test_a_phase_out_of_time_skips_each_measurement_with_a_line_and_still_writes_its_table(tmp_path):
    _out_of_time_speed(tmp_path)
    assert json.loads((tmp_path / "speed.json").read_text()) == []
    notes = (tmp_path / "speed.md").read_text()
    assert "skipped resnet50 bf16 batch 4 eager: 0 s of the phase's budget left" in notes
    assert notes.count("no eager baseline") == 6

    # a second run keeps the rows of the first on the same card, and goes on from there
    card = f"cpu dry run ({__import__('platform').machine()}, 1 threads)"
    first = {"model": "resnet50", "precision": "bf16", "batch": 4, "saved_bytes": 10, "peak_bytes": 20}
    rows = [
        {**first, "variant": "eager", "bench_variant": "eager-channels_last", "step_ms": 2.0, "source": "measured"},
        {**first, "variant": "fast", "bench_variant": "fast", "step_ms": 3.0, "saved_bytes": 5, "source": "measured"},
    ]
    (tmp_path / "speed.json").write_text(json.dumps([{**r, "card": card} for r in rows]))
    _out_of_time_speed(tmp_path)
    eager, fast = json.loads((tmp_path / "speed.json").read_text())
    assert (eager["variant"], eager["time_x"], eager["source"]) == ("eager", 1.0, "speed.json")
    assert (fast["variant"], fast["time_x"], fast["saved_x"]) == ("fast", 1.5, 0.5)
    assert "skipped resnet50 bf16 batch 4 memory: 0 s" in (tmp_path / "speed.md").read_text()


def test_speed_and_frontier_measure_the_most_wanted_first():
    gpu_check = _gpu_check_module()
    speed = gpu_check.speed_tasks(False)
    assert len(speed) == len(set(speed)) == 28
    assert speed[0] == ("resnet50", "bf16", 128, "eager-channels_last")
    # bf16's eager and fxfuse rows, ResNet-50's bf16 compile rows, fp32's eager and fxfuse rows, the rest
    kinds = [(t[1], t[3].startswith("compile"), t[0] if t[3].startswith("compile") else "") for t in speed]
    assert list(dict.fromkeys(kinds)) == [
        ("bf16", False, ""),
        ("bf16", True, "resnet50"),
        ("fp32", False, ""),
        ("bf16", True, "efficientnet_b0"),
        ("fp32", True, "resnet50"),
        ("fp32", True, "efficientnet_b0"),
    ]
    assert ("efficientnet_b0", "fp32", 64, "budget=0.5") in speed
    frontier = gpu_check.frontier_tasks(False)
    first_compile = next(i for i, t in enumerate(frontier) if t[3].startswith("compile"))
    assert {t[3] for t in frontier[:first_compile]} == {
        "eager-channels_last",
        "fast",
        "budget=0.5",
        "budget=0.3",
        "budget=0.7",
        "checkpoint",
    }
    # compile's points one budget at a time, every model at 0.5 before any at 0.3
    assert [t[3] for t in frontier[first_compile : first_compile + 6]] == [
        "compile-budget=0.5",
        "compile(budget=0.5)",
    ] * 3
    assert {t[1:3] for t in frontier} == {("bf16", 128)}


class _Event:
    def __init__(self, key, count, cuda=False):
        from torch.autograd import DeviceType

        self.key, self.count = key, count
        self.device_type = DeviceType.CUDA if cuda else DeviceType.CPU


def test_launches_count_the_runtime_and_driver_calls_per_step():
    gpu_check = _gpu_check_module()
    events = [
        _Event("cudaLaunchKernel", 1366),
        _Event("cudaLaunchKernelExC", 190),
        _Event("cuLaunchKernel", 40),
        _Event("cuLaunchKernelEx", 190),
        _Event("aten::add", 500),
        _Event("void at::native::elementwise_kernel", 1500, cuda=True),
        _Event("Memset (Device)", 100, cuda=True),
    ]
    assert gpu_check.count_launches(events, 2) == {"runtime": 778, "driver": 115, "kernels": 800}


def test_the_driver_splits_its_time_among_the_time_boxed_phases(tmp_path):
    """GPU_CHECK_SECONDS caps the run: a PHASE:SECONDS budget is cut to what is left (less 20 s) and a
    phase with under 30 s left is skipped; GPU_CHECK_ARGS_<phase> reaches its phase; a dry run skips
    the phases that need a GPU and passes --dry-run. A stand-in python records its arguments."""
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\n[ "$1" = "-c" ] && exit 0\necho "$@" >> "$(dirname "$0")/seen"\n')
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake), "GPU_CHECK_SECONDS": "200", "GPU_CHECK_ARGS_fit": "--cap-gib 8"}
    run = subprocess.run(
        [os.path.join(ROOT, "tools", "gpu_check.sh"), str(tmp_path / "out"), "speed:100", "fit:500", "frontier"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    seen = (tmp_path / "seen").read_text().splitlines()
    out = str(tmp_path / "out")
    assert seen[0] == f"tools/gpu_check.py speed --out {out} --budget-s 100"
    budget = int(seen[1].split("--budget-s ")[1].split()[0])
    assert 170 <= budget <= 180 and seen[1].endswith("--cap-gib 8") and " fit " in seen[1]
    assert len(seen) == 3 and " frontier " in seen[2]  # the stand-in took no time: frontier still had 180 s

    def driver(*phases, **more):
        return subprocess.run(
            [os.path.join(ROOT, "tools", "gpu_check.sh"), str(tmp_path / "more"), *phases],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env={**env, **more},
        )

    run = driver("speed:60", GPU_CHECK_SECONDS="40")
    assert run.returncode == 0 and run.stdout.startswith("gpu-check: speed skipped: ")
    assert run.stdout.strip().endswith("s left of GPU_CHECK_SECONDS") and run.stdout.count("\n") == 1
    run = driver("build", "tests", "fit:40", GPU_CHECK_DRY_RUN="1", GPU_CHECK_SECONDS="70")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "build skipped: a dry run runs speed, frontier and fit only" in run.stdout and "tests skipped" in run.stdout
    assert (tmp_path / "seen").read_text().splitlines()[3].endswith("--budget-s 40 --dry-run --cap-gib 8")


def test_host_time_is_taken_behind_a_sleep_unless_the_host_waited_for_it(monkeypatch):
    """On the GPU: a step that enqueues in less than the sleep is timed behind it; one that takes as
    long as the sleep waited for the device (a full launch queue, a sync) and is timed from an idle
    device. The CUDA calls are stand-ins: the decision is what is tested here."""
    from types import SimpleNamespace

    gpu_check = _gpu_check_module()
    slept = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "_sleep", slept.append)
    setup = SimpleNamespace(device=torch.device("cuda"), sleep_rate=1000.0)
    host, how = gpu_check._host_ms(lambda: None, 5.0, setup)
    assert how == "behind a sleep" and host < 5 and slept == [30_000] * 3  # 2 x 5 ms + 20 ms, in cycles
    calls = []

    def waits():  # as long as the 30 ms sleep while it is queued, then quick
        calls.append(1)
        time.sleep(0.03 if len(calls) <= 3 else 0.0)

    host, how = gpu_check._host_ms(waits, 5.0, setup)
    assert how == "waited behind a 30 ms sleep; from an idle device" and host < 25 and len(calls) == 6
    host, how = gpu_check._host_ms(lambda: None, 5.0, SimpleNamespace(device=setup.device, sleep_rate=None))
    assert how == "no sleep; from an idle device" and len(slept) == 6
