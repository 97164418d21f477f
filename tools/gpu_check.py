"""What a GPU run of fxfuse checks and measures, one section per subcommand (tools/gpu_check.sh runs them all).

    python tools/gpu_check.py env | exact | autocast | kernels | step | fit | profile [--out DIR]

Each section prints a short table and writes it into --out (default: gpu-check-out/) as JSON and
as the markdown table the README's GPU section takes (SECTION.json, SECTION.md).
Needs a CUDA GPU; without one it stops at once with a one-line message.
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


class _Autocast(torch.nn.Module):
    """`model` run under CUDA bfloat16 autocast (AMP), for the largest-batch search."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return self.model(x)


def fit(args) -> None:
    """Largest training batch within a memory cap, eager vs fxfuse (mode="memory"), float32 and
    bf16 AMP: what `fxfuse bench --fit-cap` reports for float32, with AMP too."""
    import torchvision

    import fxfuse
    from fxfuse.measure import fit as fitting

    cap = int(args.cap_gib * 2**30)
    rows = []
    for name, make in (
        ("resnet50", torchvision.models.resnet50),
        ("efficientnet_b0", torchvision.models.efficientnet_b0),
    ):
        for amp in (False, True):
            torch.manual_seed(0)
            x = torch.randn(8, 3, 224, 224, device="cuda")
            batches = {}
            for label in ("eager", "fxfuse memory"):
                model = make().cuda()
                if label != "eager":
                    model = fxfuse.optimize(model, (x,), mode="memory")
                # counted on the meta device first (seconds), so the measured search starts near its
                # answer; the count cannot see autocast, the search then walks from there
                start = fitting.largest_batch(model, (x,), cap)
                model = _Autocast(model) if amp else model
                batches[label] = fitting.largest_batch(model, (x,), cap, how="measured", start=start)
                del model
                torch.cuda.empty_cache()
            rows.append(
                {
                    "model": name,
                    "amp": "bf16" if amp else "fp32",
                    "cap GiB": args.cap_gib,
                    "eager batch": batches["eager"],
                    "fxfuse batch": batches["fxfuse memory"],
                    "x": round(batches["fxfuse memory"] / max(batches["eager"], 1), 2),
                }
            )
            print(rows[-1], flush=True)
    _write(args.out, "fit", rows)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("section", choices=("env", "exact", "autocast", "kernels", "step", "fit", "profile"))
    parser.add_argument("--out", default="gpu-check-out")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--cap-gib", type=float, default=16.0, help="fit: the memory cap (GiB)")
    args = parser.parse_args()
    _require_gpu()
    globals()[args.section](args)


if __name__ == "__main__":
    main()
