"""What a GPU run of fxfuse checks and measures, one section per subcommand (tools/gpu_check.sh runs them all).

    python tools/gpu_check.py env | exact | autocast | kernels | step | fit | profile | speed | frontier
                              | plot [--out DIR]

Each section prints a short table and writes it into --out (default: gpu-check-out/) as JSON and
as the markdown table the README's GPU section takes (SECTION.json, SECTION.md).
Needs a CUDA GPU; without one it stops at once with a one-line message. speed, frontier and fit are
time-boxed (--budget-s) and run on the CPU with tiny models under --dry-run; plot draws
frontier.svg from frontier.json anywhere.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch


def _require_gpu() -> None:
    if not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA GPU here (torch.cuda.is_available() is False); run it on a GPU machine")


def _markdown(data, header=None) -> str:
    """A markdown table of rows (dicts, or lists under `header`); key: value lines for a dict."""
    if isinstance(data, dict):
        return "".join(f"* {k}: {v}\n" for k, v in data.items())
    if not data:
        return ""
    if isinstance(data[0], dict):
        header = list(data[0])
        data = [[row.get(k, "") for k in header] for row in data]
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(map(str, row)) + " |" for row in data]) + "\n"


def _write(out: str, name: str, data, header=None) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, name + ".json"), "w") as f:
        json.dump(data, f, indent=1, default=str)
    with open(os.path.join(out, name + ".md"), "w") as f:
        f.write(_markdown(data, header))


def env(args) -> None:
    import fxfuse
    from fxfuse import _extension

    p = torch.cuda.get_device_properties(0)
    data = {
        "device": p.name,
        "multiprocessors": p.multi_processor_count,
        "memory_GiB": round(p.total_memory / 2**30, 1),
        "peak_GB/s": _peak_bandwidth(),
        "driver": _driver(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "fxfuse": fxfuse.__version__ if hasattr(fxfuse, "__version__") else "?",
        "extension": _extension.build_summary() if hasattr(_extension, "build_summary") else None,
        "cuda_kernels": torch._C._dispatch_has_kernel_for_dispatch_key("fxfuse::bn_act", "CUDA"),
    }
    for k, v in data.items():
        print(f"{k:16} {v}")
    _write(args.out, "env", data)


def _peak_bandwidth() -> float | None:
    """The device's memory bandwidth from its clock and bus width (double data rate), GB/s."""
    p = torch.cuda.get_device_properties(0)
    clock_khz, bus_bits = getattr(p, "memory_clock_rate", 0), getattr(p, "memory_bus_width", 0)
    return round(2 * clock_khz * 1e3 * bus_bits / 8 / 1e9) if clock_khz and bus_bits else None


def _driver() -> str:
    import subprocess

    try:
        run = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
        )
        return run.stdout.strip() or "?"
    except OSError:
        return "?"


def _models():
    import timm
    import torchvision

    return {
        "resnet50": (lambda: torchvision.models.resnet50(), (2, 3, 64, 64)),
        "efficientnet_b0": (lambda: torchvision.models.efficientnet_b0(), (2, 3, 64, 64)),
        "convnext_tiny": (lambda: torchvision.models.convnext_tiny(), (2, 3, 64, 64)),
        "vit_b_16": (lambda: torchvision.models.vit_b_16(), (2, 3, 224, 224)),
        "timm_resnet50d": (lambda: timm.create_model("resnet50d"), (2, 3, 64, 64)),
    }


def exact(args) -> None:
    """float64 on the GPU: fxfuse.optimize against eager, two SGD steps plus eval, every tensor compared."""
    import fxfuse
    from fxfuse.testing import assert_equivalent

    rows = []
    for name, (make, shape) in _models().items():
        torch.manual_seed(0)
        model = make().cuda().double()
        x = torch.randn(shape, device="cuda", dtype=torch.double)
        for mode in ("memory", "fast"):
            start = time.perf_counter()
            optimized = fxfuse.optimize(copy.deepcopy(model), (x,), mode=mode)
            fused = len(optimized.fxfuse_report.fused)
            try:
                assert_equivalent(model, optimized, x)
                verdict = "exact"
            except AssertionError as exc:
                verdict = "FAIL: " + str(exc).splitlines()[0][:200]
            rows.append([name, mode, fused, verdict, round(time.perf_counter() - start, 1)])
            print(rows[-1], flush=True)
    _write(args.out, "exact", rows, ["model", "mode", "fused sites", "float64 vs eager", "seconds"])
    if any(r[3] != "exact" for r in rows):
        sys.exit("gpu_check exact: some models differ from eager")


def _relative_error(got, truth) -> float:
    num = sum((g - t).norm() ** 2 for g, t in zip(got, truth))
    return (num / sum(t.norm() ** 2 for t in truth)).sqrt().item()


def _without_dropout(model):
    """Dropout and stochastic depth off: each of the three runs would draw its own masks."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout) or type(module).__name__ in ("StochasticDepth", "DropPath"):
            module.p = 0.0
            if hasattr(module, "drop_prob"):
                module.drop_prob = 0.0
    return model


def autocast(args) -> None:
    """fp16/bf16 autocast training: fxfuse against eager autocast, both against a float64 run."""
    import fxfuse

    rows = []
    for name, (make, shape) in _models().items():
        if name == "vit_b_16":
            continue
        for dtype in (torch.float16, torch.bfloat16):
            torch.manual_seed(0)
            model = _without_dropout(make().cuda())
            # batch 8 at 96²: at batch 2, 64² the last stage's BN normalizes over 8 values, and eager
            # autocast's own gradients were as far from float64 as their own size (error 1.0-1.6)
            x = torch.randn(8, *shape[1:-2], 96, 96, device="cuda")
            ref64 = copy.deepcopy(model).double()
            optimized = fxfuse.optimize(copy.deepcopy(model), (x,))
            grads = {}
            for label, m in (("eager", model), ("fxfuse", optimized)):
                with torch.autocast("cuda", dtype=dtype):
                    out = m(x)
                out.float().square().mean().backward()
                grads[label] = [p.grad.double() for p in m.parameters()]
            ref64(x.double()).square().mean().backward()
            truth = [p.grad for p in ref64.parameters()]

            e_eager, e_fx = _relative_error(grads["eager"], truth), _relative_error(grads["fxfuse"], truth)
            rows.append([name, str(dtype), f"{e_eager:.2e}", f"{e_fx:.2e}", f"{e_fx / e_eager:.2f}"])
            print(rows[-1], flush=True)
    header = ["model", "autocast", "eager grad error vs float64", "fxfuse grad error", "fxfuse / eager"]
    _write(args.out, "autocast", rows, header)


def _bench(fn, repeats: int = 50) -> float:
    """Median milliseconds of fn() by CUDA events, after warm-up."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _kernel_row(shape, dtype, fmt) -> dict:
    x = torch.randn(shape, device="cuda", dtype=dtype).contiguous(memory_format=fmt)
    dy = torch.randn_like(x)
    y = torch.empty_like(x)
    nbytes = x.numel() * x.element_size()
    mean, var, _ = torch.ops.fxfuse.bn_stats(x)
    w = torch.rand(shape[1], device="cuda") + 0.5
    b = torch.randn(shape[1], device="cuda")
    copy_ms = _bench(lambda: y.copy_(x))
    stats_ms = _bench(lambda: torch.ops.fxfuse.bn_stats(x))
    fwd_ms = _bench(lambda: torch.ops.fxfuse.bn_act(x, mean, var, w, b, 1e-5, "relu", 0.0))
    bwd_ms = _bench(
        lambda: torch.ops.fxfuse.bn_act_backward(dy, x, mean, var, w, b, 1e-5, "relu", 0.0, True, [True] * 3)
    )
    eager_ms = _bench(lambda: torch.relu(torch.nn.functional.batch_norm(x, None, None, w, b, True)))
    peak = _peak_bandwidth()
    # The fewest bytes each must move: read x (and dy), write the output once.
    return {
        "dtype": str(dtype).replace("torch.", ""),
        "layout": "nhwc" if fmt is torch.channels_last else "nchw",
        "device GB/s": peak,
        "bn_act % of device": round(100 * 2 * nbytes / fwd_ms / 1e6 / peak) if peak else None,
        "bn_act_backward % of device": round(100 * 3 * nbytes / bwd_ms / 1e6 / peak) if peak else None,
        "copy GB/s": round(2 * nbytes / copy_ms / 1e6),
        "bn_stats GB/s": round(nbytes / stats_ms / 1e6),
        "bn_act GB/s": round(2 * nbytes / fwd_ms / 1e6),
        "bn_act_backward GB/s": round(3 * nbytes / bwd_ms / 1e6),
        "bn_act ms": round(fwd_ms, 3),
        "eager bn+relu ms": round(eager_ms, 3),
        "bn_act_backward ms": round(bwd_ms, 3),
    }


def kernels(args) -> None:
    """GB/s of the fused pointwise kernels against a device-to-device copy of the same tensor."""
    import fxfuse  # noqa: F401  (registers the ops)

    rows = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for fmt in (torch.contiguous_format, torch.channels_last):
            rows.append(_kernel_row((64, 256, 56, 56), dtype, fmt))
            print(rows[-1], flush=True)
    _write(args.out, "kernels", rows)


def _step_stats(model, x, amp, repeats):
    from fxfuse import measure

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            out = model(x)
        out.float().sum().backward()
        model.zero_grad(set_to_none=True)

    step()
    torch.cuda.synchronize()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
        saved = measure.saved_activation_bytes(model, (x,))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return saved, peak, _bench(step, repeats)


def step(args) -> None:
    """ResNet-50 / EfficientNet-B0 train steps on the GPU: saved bytes, step peak and time, eager vs fxfuse."""
    import torchvision

    import fxfuse

    rows = []
    for name, make, batch in (
        ("resnet50", torchvision.models.resnet50, 64),
        ("efficientnet_b0", torchvision.models.efficientnet_b0, 64),
    ):
        for amp in (False, True):
            torch.manual_seed(0)
            base = make().cuda()
            x = torch.randn(batch, 3, 224, 224, device="cuda")
            results = {}
            for label in ("eager nchw", "eager channels_last", "fxfuse memory", "fxfuse budget 0.5"):
                model = copy.deepcopy(base)
                xi = x
                if "nchw" not in label:
                    model = model.to(memory_format=torch.channels_last)
                    xi = x.contiguous(memory_format=torch.channels_last)
                if label == "fxfuse memory":
                    model = fxfuse.optimize(model, (xi,), mode="memory")
                elif label == "fxfuse budget 0.5":
                    model = fxfuse.optimize(model, (xi,), memory_budget=0.5)
                results[label] = _step_stats(model, xi, amp, args.repeats)
                del model
                torch.cuda.empty_cache()
            best = min(("eager nchw", "eager channels_last"), key=lambda k: results[k][2])
            s0, p0, t0 = results[best]
            for label, (s, p, t) in results.items():
                rows.append(
                    {
                        "model": name,
                        "amp": "bf16" if amp else "fp32",
                        "variant": label,
                        "saved MiB": round(s / 2**20),
                        "saved x": round(s / s0, 3),
                        "peak x": round(p / p0, 3),
                        "time ms": round(t, 2),
                        "time x best eager": round(t / t0, 3),
                    }
                )
                print(rows[-1], flush=True)
    _write(args.out, "step", rows)


# ------------------------------------------------------------------ time-boxed phases: speed, frontier, fit
#
# Each runs its measurements in priority order within a time budget (--budget-s): before each one it
# guesses how long it takes (the median of its kind so far, else --compile-guess-s or --variant-guess-s)
# and skips it, with a line in the log, when the budget left is shorter. The JSON and markdown are
# rewritten after every row, so a phase cut short (or killed by gpu_check.sh's timeout) still leaves
# its table. With --dry-run they run on the CPU: tiny stand-ins for the models, tiny batches and
# torch.compile's aot_eager_decomp_partition backend (it partitions as inductor does, budget
# included), so every code path runs in seconds without a GPU (tests/test_gpu_check.py).

EAGER = "eager-channels_last"
COMPILE_BACKENDS = ("inductor", "aot_eager_decomp_partition", "eager")


class Clock:
    """A phase's time budget: what is left of it, and whether a task of a guessed length still fits."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def refuses(self, what: str, need: float) -> str | None:
        """None if `need` seconds are left, else the line that says `what` is skipped."""
        if self.left() >= need:
            return None
        return f"skipped {what}: {max(self.left(), 0):.0f} s of the phase's budget left, needs ~{need:.0f} s"


class _Setup:
    """Where a phase runs: the device, the card's name (on every row), the compile backend."""

    def __init__(self, args) -> None:
        self.dry_run = args.dry_run
        self.device = torch.device("cpu" if args.dry_run else "cuda")
        if args.dry_run:
            import platform

            # one thread: on a CPU that other work shares, more threads made a tiny step 100x slower
            torch.set_num_threads(1)
            self.card = f"cpu dry run ({platform.machine()}, {torch.get_num_threads()} threads)"
        else:
            self.card = torch.cuda.get_device_name(0)
        self.backend = args.compile_backend or ("aot_eager_decomp_partition" if args.dry_run else "inductor")
        self.plan_in_autocast = not args.plan_outside_autocast
        self.sleep_rate = None
        if not args.dry_run:
            try:
                self.sleep_rate = _sleep_cycles_per_ms()
            except Exception as exc:  # no torch.cuda._sleep: the host time is then timed from an idle device
                print(f"no torch.cuda._sleep ({type(exc).__name__}: {exc})", flush=True)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def autocast(self, precision: str):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=precision == "bf16")

    def cleanup(self) -> None:
        import gc

        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _tiny_models() -> dict:
    """CPU stand-ins for the dry run, with the layers the real models' fusions and checkpoint meet."""
    from torch import nn
    from torchvision.models.convnext import CNBlock
    from torchvision.models.resnet import BasicBlock

    def cba(i, o, act=nn.ReLU, groups=1):
        return nn.Sequential(nn.Conv2d(i, o, 3, padding=1, groups=groups, bias=False), nn.BatchNorm2d(o), act())

    def head(c):
        return [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 10)]

    return {
        "resnet50": lambda: nn.Sequential(cba(3, 16), nn.Sequential(BasicBlock(16, 16), BasicBlock(16, 16)), *head(16)),
        "efficientnet_b0": lambda: nn.Sequential(
            cba(3, 16, nn.SiLU), nn.Sequential(cba(16, 16, nn.SiLU, groups=16), cba(16, 24, nn.SiLU)), *head(24)
        ),
        "convnext_tiny": lambda: nn.Sequential(
            nn.Conv2d(3, 16, 4, stride=4), nn.Sequential(CNBlock(16, 1e-6, 0.0), CNBlock(16, 1e-6, 0.0)), *head(16)
        ),
    }


def _phase_models(setup: _Setup) -> tuple[dict, int]:
    """{name: constructor} and the image size."""
    if setup.dry_run:
        return _tiny_models(), 32
    import torchvision

    names = ("resnet50", "efficientnet_b0", "convnext_tiny")
    return {name: getattr(torchvision.models, name) for name in names}, 224


def _dry_batch(batch: int, dry_run: bool) -> int:
    return max(2, batch // 32) if dry_run else batch


def _train_step(model, x, setup: _Setup, precision: str) -> None:
    with setup.autocast(precision):
        out = model(x)
    out.float().square().mean().backward()
    model.zero_grad(set_to_none=True)


def _build(variant: str, base, x, setup: _Setup, precision: str):
    """Variant `variant` (a `fxfuse.bench` name) of `base`, channels_last. A bf16 plan is made inside
    autocast, where a user calls optimize (issue 55: a plan counted in the precision it trains in),
    unless --plan-outside-autocast."""
    from fxfuse import bench

    with setup.autocast(precision if setup.plan_in_autocast else "fp32"):
        return bench.make_variant(variant, base, (x,), torch.channels_last, compile_backend=setup.backend)


def _median_ms(step, repeats: int, setup: _Setup) -> float:
    """Median milliseconds of a step: CUDA events around each on the GPU, the host clock on the CPU."""
    times = []
    for _ in range(repeats):
        if setup.device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            start = time.perf_counter()
            step()
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _step_peak(step, setup: _Setup) -> int:
    from fxfuse import measure

    if setup.device.type != "cuda":
        return measure.step_allocated_peak_bytes(step, setup.device)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def count_launches(events, steps: int) -> dict:
    """Per step, from a profile's key_averages(): `runtime` the CUDA runtime's kernel launches
    (cudaLaunchKernel, and cudaLaunchKernelExC that cuDNN uses), `driver` the driver API's
    (cuLaunchKernel*: how Triton, so torch.compile, launches; cudaLaunchKernelExC's own call one level
    down shows here too), `kernels` what the device ran (kernels, copies and fills)."""
    from torch.autograd import DeviceType

    def total(test) -> float:
        return sum(e.count for e in events if test(e)) / steps

    return {
        "runtime": total(lambda e: e.key.startswith("cudaLaunchKernel")),
        "driver": total(lambda e: e.key.startswith("cuLaunchKernel")),
        "kernels": total(lambda e: e.device_type == DeviceType.CUDA),
    }


def _launches(step, setup: _Setup, steps: int = 2) -> dict:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if setup.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        setup.sync()
    return count_launches(prof.key_averages(), steps)


def _sleep_cycles_per_ms() -> float:
    """Clock cycles of torch.cuda._sleep per millisecond on this device (the second of two tries: the
    clock ramps up in the first)."""
    for _ in range(2):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(50_000_000)
        b.record()
        b.synchronize()
    return 50_000_000 / a.elapsed_time(b)


def launch_queue_depth(limit: int = 8192) -> int | None:
    """How many launches the host can queue behind a busy device before a launch waits (None: more
    than `limit`): the host enqueue time below is only the host's while a step launches fewer."""
    torch.cuda.synchronize()
    y = torch.zeros(1, device="cuda")
    y.add_(1)
    torch.cuda._sleep(int(_sleep_cycles_per_ms() * 500))
    depth = None
    for i in range(limit):
        start = time.perf_counter()
        y.add_(1)
        if time.perf_counter() - start > 0.005:
            depth = i
            break
    torch.cuda.synchronize()
    return depth


def _host_ms(step, step_ms: float, setup: _Setup, steps: int = 3) -> tuple[float, str]:
    """Host milliseconds to enqueue one step, and how it was measured. On the GPU each step is
    enqueued behind a torch.cuda._sleep longer than the step, so no launch waits for the device; if
    the host still took as long as the sleep, a launch waited (the launch queue was full, or the step
    synchronizes), and the step is timed again from an idle device instead."""
    if setup.device.type != "cuda":
        return _median_ms(step, steps, setup), "cpu: the step's wall time"
    sleep_ms = 2 * step_ms + 20
    times = []
    for _ in range(steps if setup.sleep_rate else 0):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(setup.sleep_rate * sleep_ms))
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    if times and statistics.median(times) < 0.9 * sleep_ms:
        return statistics.median(times), "behind a sleep"
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    why = f"waited behind a {sleep_ms:.0f} ms sleep" if setup.sleep_rate else "no sleep"
    return statistics.median(times), f"{why}; from an idle device"


def _measure(model, x, setup: _Setup, precision: str, repeats: int, launches: bool) -> dict:
    from fxfuse import measure

    def step():
        _train_step(model, x, setup, precision)

    step()  # compiles, on the first call
    step()
    setup.sync()
    with setup.autocast(precision):
        saved = measure.saved_activation_bytes(model, (x,))
    out = {"saved_bytes": saved, "peak_bytes": _step_peak(step, setup), "step_ms": _median_ms(step, repeats, setup)}
    if launches:
        counts = _launches(step, setup)
        host, how = _host_ms(step, out["step_ms"], setup)
        out.update(
            launches_per_step=round(counts["runtime"]),
            driver_launches_per_step=round(counts["driver"]),
            kernels_per_step=round(counts["kernels"]),
            host_ms_per_step=round(host, 2),
            host_how=how,
        )
    return out


def _failure(what: str, exc: Exception) -> str:
    first = str(exc).splitlines()[0][:200] if str(exc) else ""
    return f"failed {what}: {type(exc).__name__}: {first}"


def _ratio(a, b) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def _phase_rows(results: dict, labels: dict) -> list[dict]:
    """Rows with ratios to eager channels_last of the same model, precision and batch."""
    rows = []
    for (model, precision, batch, variant), m in results.items():
        base = results.get((model, precision, batch, EAGER))
        if base is None:
            continue
        row = {"model": model, "precision": precision, "batch": batch, "variant": labels.get(variant, variant)}
        row["saved_x"] = _ratio(m["saved_bytes"], base["saved_bytes"])
        row["peak_x"] = _ratio(m["peak_bytes"], base["peak_bytes"])
        row["time_x"] = _ratio(m["step_ms"], base["step_ms"])
        row["step_ms"] = round(m["step_ms"], 2)
        row.update({k: v for k, v in m.items() if k not in row and k != "step_ms"})
        rows.append(row)
    return rows


def _write_phase(out: str, name: str, rows: list[dict], columns: list[str], notes: list[str]) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, name + ".json"), "w") as f:
        json.dump(rows, f, indent=1)
    table = _markdown([[row.get(c, "") for c in columns] for row in rows], columns) if rows else ""
    with open(os.path.join(out, name + ".md"), "w") as f:
        f.write(table + "".join(f"\n* {line}" for line in notes) + ("\n" if notes else ""))


def _reused(paths: list[str], card: str) -> dict:
    """Measurements of an earlier phase or run on the same card (rows of speed.json or frontier.json),
    by (model, precision, batch, bench variant)."""
    found = {}
    for path in paths:
        if not os.path.exists(path):
            continue
        with open(path) as f:
            for row in json.load(f):
                if row.get("card") == card and "bench_variant" in row:
                    key = (row["model"], row["precision"], row["batch"], row["bench_variant"])
                    found[key] = {k: v for k, v in row.items() if k not in ("model", "precision", "batch", "variant")}
                    found[key]["step_ms"] = row["step_ms"]
                    source = row.get("source")
                    found[key]["source"] = source if source not in (None, "measured") else os.path.basename(path)
    return found


def run_tasks(args, name: str, tasks: list, labels: dict, columns: list[str], launches: bool, reuse=()) -> list:
    """Measures `tasks` ((model, precision, batch, bench variant), in priority order) within
    args.budget_s, writing OUT/NAME.json and NAME.md after each; returns the rows."""
    import traceback

    setup = _Setup(args)
    clock = Clock(args.budget_s)
    makers, size = _phase_models(setup)
    notes = [f"card: {setup.card}; torch {torch.__version__}; compile backend {setup.backend}"]
    notes.append("bf16 plans made " + ("inside" if setup.plan_in_autocast else "outside") + " autocast")
    if launches and setup.device.type == "cuda":
        try:
            depth = launch_queue_depth()
            notes.append(f"launch queue: a launch waited after {depth or 'more than 8192'} pending ones")
        except Exception as exc:
            notes.append(f"launch queue: not measured ({type(exc).__name__}: {exc})")
    for line in notes:
        print(line, flush=True)
    results = {}
    for key, m in _reused(list(reuse), setup.card).items():
        if key in tasks:
            results[key] = m
            print(f"reused {key} from {m['source']}", flush=True)
    spent: dict[str, list[float]] = {"compile": [], "other": []}
    bases: dict = {}
    for key in tasks:
        model_name, precision, batch, variant = key
        what = f"{model_name} {precision} batch {batch} {labels.get(variant, variant)}"
        if key in results:
            continue
        if variant != EAGER and (model_name, precision, batch, EAGER) not in results:
            notes.append(f"skipped {what}: no eager baseline")
            continue
        kind = "compile" if variant.startswith("compile") else "other"
        guess = args.compile_guess_s if kind == "compile" else args.variant_guess_s
        need = 1.2 * statistics.median(spent[kind]) if spent[kind] else guess
        refused = clock.refuses(what, need)
        if refused:
            notes.append(refused)
            print(refused, flush=True)
            continue
        start = time.perf_counter()
        model = None
        try:
            if model_name not in bases:
                torch.manual_seed(0)
                bases[model_name] = makers[model_name]().to(setup.device).to(memory_format=torch.channels_last)
            torch.manual_seed(0)
            x = torch.randn(batch, 3, size, size, device=setup.device).contiguous(memory_format=torch.channels_last)
            model = _build(variant, bases[model_name], x, setup, precision)
            m = _measure(model, x, setup, precision, args.repeats, launches)
            m.update(
                setup_s=round(time.perf_counter() - start, 1), card=setup.card, bench_variant=variant, source="measured"
            )
            results[key] = m
            print(what, {k: m[k] for k in ("saved_bytes", "peak_bytes", "step_ms")}, f"{m['setup_s']} s", flush=True)
        except Exception as exc:  # a variant that fails (an OOM, a compile error) leaves the others to run
            traceback.print_exc()
            notes.append(_failure(what, exc))
            print(notes[-1], flush=True)
        finally:
            del model
            if kind == "compile":
                torch._dynamo.reset()
            setup.cleanup()
        spent[kind].append(time.perf_counter() - start)
        order = {k: i for i, k in enumerate(tasks)}
        results = dict(sorted(results.items(), key=lambda kv: order[kv[0]]))
        _write_phase(args.out, name, _phase_rows(results, labels), columns, notes)
    rows = _phase_rows(results, labels)
    _write_phase(args.out, name, rows, columns, notes)
    return rows


SPEED_VARIANTS = {
    EAGER: "eager",
    "fast": "fast",
    "memory": "memory",
    "budget=0.5": "memory_budget=0.5",
    "compile": "compile",
    "compile(fast)": "compile(fxfuse fast)",
    "compile-budget=0.5": "compile budget=0.5",
}
SPEED_COLUMNS = [
    "model",
    "precision",
    "batch",
    "variant",
    "saved_x",
    "peak_x",
    "time_x",
    "step_ms",
    "launches_per_step",
    "driver_launches_per_step",
    "host_ms_per_step",
    "card",
]


def speed_tasks(dry_run: bool, models=("resnet50", "efficientnet_b0"), precisions=("bf16", "fp32")) -> list:
    """The speed phase's measurements, most wanted first: eager and fxfuse in bf16 (the issue's
    targets), the first model's torch.compile rows in bf16, the same eager and fxfuse rows in fp32,
    then the remaining torch.compile rows (each compile costs about a minute on an H100)."""
    groups = [(m, p, _dry_batch(128 if p == "bf16" else 64, dry_run)) for p in precisions for m in models]
    plain = [v for v in SPEED_VARIANTS if not v.startswith("compile")]
    compiled = [v for v in SPEED_VARIANTS if v.startswith("compile")]
    first = [g for g in groups if g[1] == precisions[0]]
    rest = [g for g in groups if g[1] != precisions[0]]
    tasks = [(*g, v) for g in first for v in plain] + [(*first[0], v) for v in compiled]
    tasks += [(*g, v) for g in rest for v in plain]
    return tasks + [(*g, v) for g in first[1:] + rest for v in compiled]


def speed(args) -> None:
    """Issue 54's GPU table: eager, fxfuse and torch.compile train steps of ResNet-50 and
    EfficientNet-B0, bf16 autocast (batch 128) and fp32 (batch 64), channels_last: saved, peak, step
    time, kernel launches and host enqueue time per step (speed.json, speed.md). Rows of an earlier
    speed.json in OUT on the same card are kept (a second run goes on where the first stopped) unless
    --fresh."""
    tasks = speed_tasks(args.dry_run, args.models or ("resnet50", "efficientnet_b0"), args.precisions)
    reuse = [] if args.fresh else [os.path.join(args.out, "speed.json")]
    run_tasks(args, "speed", tasks, SPEED_VARIANTS, SPEED_COLUMNS, True, reuse)


FRONTIER_BUDGETS = (0.5, 0.3, 0.7)  # in the order their compile rows are measured
FRONTIER_COLUMNS = [
    "model",
    "precision",
    "batch",
    "variant",
    "saved_x",
    "peak_x",
    "time_x",
    "step_ms",
    "source",
    "card",
]


def frontier_labels(budgets=FRONTIER_BUDGETS) -> dict:
    labels = {EAGER: "eager", "fast": "fxfuse fast", "checkpoint": "checkpoint", "compile": "compile"}
    for b in budgets:
        labels[f"budget={b:g}"] = f"fxfuse budget={b:g}"
        labels[f"compile(budget={b:g})"] = f"compile(fxfuse budget={b:g})"
        labels[f"compile-budget={b:g}"] = f"compile budget={b:g}"
    return labels


def frontier_tasks(dry_run: bool, models=("resnet50", "efficientnet_b0", "convnext_tiny"), budgets=FRONTIER_BUDGETS):
    """Most informative first: every model's eager, fxfuse (fast and each budget) and checkpoint rows
    (no compile: seconds each), then compile's points one budget at a time, torch.compile with
    activation_memory_budget beside torch.compile(fxfuse) at the same budget, for every model, then
    plain torch.compile."""
    batch = _dry_batch(128, dry_run)
    tasks = []
    for m in models:
        tasks += [(m, "bf16", batch, v) for v in (EAGER, "fast", *(f"budget={b:g}" for b in budgets), "checkpoint")]
    for b in budgets:
        for m in models:
            tasks += [(m, "bf16", batch, f"compile-budget={b:g}"), (m, "bf16", batch, f"compile(budget={b:g})")]
    return tasks + [(m, "bf16", batch, "compile") for m in models]


def frontier(args) -> None:
    """Issue 55's GPU frontier: ResNet-50, EfficientNet-B0, ConvNeXt-T, bf16 autocast, channels_last,
    batch 128: eager, fxfuse fast, fxfuse at each memory budget, eager and under torch.compile,
    torch.compile with activation_memory_budget at the same budgets, torch.utils.checkpoint on each
    top-level block (`fxfuse.bench.checkpoint_blocks`). Rows measured by the speed phase or an earlier
    frontier run on the same card in OUT are reused (their `source` says so) unless --fresh."""
    budgets = tuple(args.budgets or FRONTIER_BUDGETS)
    tasks = frontier_tasks(args.dry_run, args.models or ("resnet50", "efficientnet_b0", "convnext_tiny"), budgets)
    reuse = [] if args.fresh else [os.path.join(args.out, f) for f in ("speed.json", "frontier.json")]
    rows = run_tasks(args, "frontier", tasks, frontier_labels(budgets), FRONTIER_COLUMNS, False, reuse)
    _plot_frontier(rows, args.out)


def _plot_frontier(rows: list[dict], out: str) -> None:
    """frontier.svg: a panel per model (fxfuse.plot), from the rows of frontier.json."""
    from fxfuse.bench import Row
    from fxfuse.errors import ConfigurationError
    from fxfuse.plot import plot_fronts

    panels = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        bench_rows = [
            Row(
                r["bench_variant"],
                r["saved_bytes"],
                0,
                r["step_ms"] / 1e3,
                r["saved_x"],
                0.0,
                r["time_x"],
                r["peak_bytes"],
                r["peak_x"],
                baseline=r["bench_variant"] == EAGER,
            )
            for r in mine
        ]
        panels.append((f"{model} {mine[0]['precision']} batch {mine[0]['batch']}, {mine[0]['card']}", bench_rows))
    try:
        plot_fronts(panels, os.path.join(out, "frontier.svg"))
        print(f"plot: {os.path.join(out, 'frontier.svg')}", flush=True)
    except ConfigurationError as exc:  # no matplotlib on the GPU machine: `gpu_check.py plot` draws it later
        print(f"no plot: {exc}", flush=True)


def plot(args) -> None:
    """frontier.svg from OUT/frontier.json (where the GPU machine had no matplotlib)."""
    with open(os.path.join(args.out, "frontier.json")) as f:
        _plot_frontier(json.load(f), args.out)


class _Autocast(torch.nn.Module):
    """`model` run under bfloat16 autocast on `device_type`, for the largest-batch search."""

    def __init__(self, model, device_type: str = "cuda"):
        super().__init__()
        self.model = model
        self.device_type = device_type

    def forward(self, x):
        with torch.autocast(self.device_type, dtype=torch.bfloat16):
            return self.model(x)


def _fit_one(variant: str, base, x, cap: int, setup: _Setup, precision: str, repeats: int):
    """(largest batch within `cap`, ms per sample of a step at that batch) for one variant."""
    from fxfuse.measure import fit as fitting

    model = _build(variant, base, x, setup, precision)
    # counted on the meta device first (seconds), so that the measured search starts near its answer;
    # the count cannot see autocast, the search then walks from there
    start = fitting.largest_batch(model, (x,), cap)
    runs = _Autocast(model, setup.device.type) if precision == "bf16" else model
    n = fitting.largest_batch(runs, (x,), cap, how="measured", start=start)
    if not n:
        return 0, None
    xn = fitting.batched((x,), n)[0]

    def step():
        _train_step(model, xn, setup, precision)

    step()
    return n, _median_ms(step, repeats, setup) / n


FIT_COLUMNS = ["model", "precision", "cap_GiB", "variant", "batch", "batch_x", "ms_per_sample", "time_per_sample_x"]


def fit(args) -> None:
    """Largest training batch within a memory cap (--cap-gib), channels_last, for each precision (bf16
    first), model and variant (--fit-variants, `fxfuse.bench` names), and the time per sample of a step
    at that batch (timed without the cap: the batch fits under it). Ratios to eager's row. Issue 55's
    target: fxfuse at >= 2x eager's batch at <= 1.15x eager's time per sample (ResNet-50 bf16)."""
    setup = _Setup(args)
    clock = Clock(args.budget_s)
    makers, size = _phase_models(setup)
    cap = int(args.cap_gib * 2**30)
    variants = [v.strip() for v in args.fit_variants.split(",")]
    variants = ["eager"] + [v for v in variants if v != "eager"]
    rows, notes = [], [f"card: {setup.card}; torch {torch.__version__}; cap {args.cap_gib} GiB"]
    print(notes[0], flush=True)
    for precision in args.precisions:
        for model_name in args.models or ("resnet50", "efficientnet_b0"):
            torch.manual_seed(0)
            base = makers[model_name]().to(setup.device)
            x = torch.randn(8, 3, size, size, device=setup.device).contiguous(memory_format=torch.channels_last)
            found = {}
            for variant in variants:
                what = f"{model_name} {precision} {variant}"
                if "eager" not in found and variant != "eager":
                    notes.append(f"skipped {what}: no eager row")
                    continue
                refused = clock.refuses(what, args.variant_guess_s)
                if refused:
                    notes.append(refused)
                    print(refused, flush=True)
                    continue
                name = EAGER if variant == "eager" else variant
                try:
                    n, ms = _fit_one(name, base, x, cap, setup, precision, args.repeats)
                except Exception as exc:  # an OOM outside the search, a failed plan: the other rows still run
                    notes.append(_failure(what, exc))
                    print(notes[-1], flush=True)
                    setup.cleanup()
                    continue
                found[variant] = (n, ms)
                e_n, e_ms = found["eager"]
                rows.append(
                    {
                        "model": model_name,
                        "precision": precision,
                        "cap_GiB": args.cap_gib,
                        "variant": variant,
                        "batch": n,
                        "batch_x": _ratio(n, e_n),
                        "ms_per_sample": None if ms is None else round(ms, 4),
                        "time_per_sample_x": _ratio(ms, e_ms),
                        "card": setup.card,
                    }
                )
                print(rows[-1], flush=True)
                setup.cleanup()
                _write_phase(args.out, "fit", rows, FIT_COLUMNS + ["card"], notes)
    _write_phase(args.out, "fit", rows, FIT_COLUMNS + ["card"], notes)


def _device_us(event) -> float:
    return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)


def _kernel_us(events) -> float:
    """The GPU's busy time: its kernels and copies alone (an op's row repeats its kernels' time)."""
    from torch.autograd import DeviceType

    return sum(_device_us(e) for e in events if e.device_type == DeviceType.CUDA)


def profile(args) -> None:
    """Where a train step's time goes: ResNet-50 batch 64, bf16 AMP, channels_last, eager against
    fxfuse fast and memory. Per variant: the step's wall time, the GPU's busy time (the sum of
    its kernels; well below the wall time means the step waits on the CPU), and the ops that take
    the most GPU time and the most CPU time."""
    import torchvision
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    import fxfuse

    torch.manual_seed(0)
    base = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last)
    x = torch.randn(64, 3, 224, 224, device="cuda").contiguous(memory_format=torch.channels_last)
    rows, tops = [], {}
    for label in ("eager channels_last", "fxfuse fast", "fxfuse memory"):
        model = copy.deepcopy(base)
        if label != "eager channels_last":
            model = fxfuse.optimize(model, (x,), mode=label.split()[1])

        def step(model=model):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(x)
            out.float().sum().backward()
            model.zero_grad(set_to_none=True)

        wall = _bench(step, args.repeats)
        steps = 3
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
        events = prof.key_averages()
        busy = _kernel_us(events) / steps / 1e3
        # cudaLaunchKernel and cudaLaunchKernelExC (cuDNN); cuLaunchKernelEx is the same launch one level down
        launches = sum(e.count for e in events if e.key.startswith("cudaLaunchKernel")) // steps
        rows.append({"variant": label, "wall ms": round(wall, 2), "GPU busy ms": round(busy, 2), "launches": launches})
        print(rows[-1], flush=True)
        by_gpu = sorted(events, key=_device_us, reverse=True)[:15]
        by_cpu = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
        tops[label] = {
            "gpu": [[e.key[:90], e.count // steps, round(_device_us(e) / steps / 1e3, 3)] for e in by_gpu],
            "cpu": [[e.key[:90], e.count // steps, round(e.self_cpu_time_total / steps / 1e3, 3)] for e in by_cpu],
        }
        for kind in ("gpu", "cpu"):
            print(f"{label}: top {kind} ms per step")
            for r in tops[label][kind]:
                print("   ", r, flush=True)
        del model
        torch.cuda.empty_cache()
    _write(args.out, "profile", rows)
    with open(os.path.join(args.out, "profile_tops.json"), "w") as f:
        json.dump(tops, f, indent=1)


SECTIONS = ("env", "exact", "autocast", "kernels", "step", "fit", "profile", "speed", "frontier", "plot")


def _names(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("section", choices=SECTIONS)
    parser.add_argument("--out", default="gpu-check-out")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps (default 20; 10 in speed, frontier)")
    parser.add_argument("--cap-gib", type=float, default=None, help="fit: the memory cap (GiB; default 16)")
    parser.add_argument("--dry-run", action="store_true", help="speed, frontier, fit: on the CPU, tiny models")
    parser.add_argument("--budget-s", type=float, default=450.0, help="speed, frontier, fit: the phase's seconds")
    parser.add_argument("--compile-guess-s", type=float, default=None, help="a compiled variant's seconds, first guess")
    parser.add_argument("--variant-guess-s", type=float, default=None, help="any other variant's, first guess")
    parser.add_argument("--compile-backend", choices=COMPILE_BACKENDS, default=None)
    parser.add_argument("--plan-outside-autocast", action="store_true", help="make bf16 plans outside autocast")
    parser.add_argument("--models", type=_names, default=None, help="comma-separated: resnet50,efficientnet_b0,...")
    parser.add_argument("--precisions", type=_names, default=None, help="speed, fit: bf16,fp32 (the default)")
    parser.add_argument("--budgets", type=lambda t: [float(b) for b in _names(t)], default=None, help="frontier")
    parser.add_argument("--fresh", action="store_true", help="speed, frontier: reuse no rows of OUT's JSON")
    parser.add_argument("--fit-variants", default="eager,memory,budget=0.5", help="fit: fxfuse.bench variants")
    args = parser.parse_args(argv)
    timed_phase = args.section in ("speed", "frontier", "fit")
    if args.repeats is None:
        args.repeats = 3 if args.dry_run else 10 if timed_phase else 20
    if args.cap_gib is None:
        args.cap_gib = 0.02 if args.dry_run else 16.0
    if args.compile_guess_s is None:
        args.compile_guess_s = 10.0 if args.dry_run else 60.0
    if args.variant_guess_s is None:
        args.variant_guess_s = 3.0 if args.dry_run else 20.0
    args.precisions = args.precisions or ["bf16", "fp32"]
    for p in args.precisions:
        if p not in ("bf16", "fp32"):
            parser.error(f"a precision is bf16 or fp32, got {p!r}")
    if args.dry_run and not timed_phase:
        parser.error(f"--dry-run is for speed, frontier and fit, not {args.section}")
    return args


def main() -> None:
    args = parse_args()
    if not (args.dry_run or args.section == "plot"):
        _require_gpu()
    globals()[args.section](args)


if __name__ == "__main__":
    main()
