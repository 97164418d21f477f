"""What a recompute costs in time: FLOPs for convs and matmuls, bytes moved for everything else.

    seconds = flops * SECONDS_PER_FLOP + moved * SECONDS_PER_BYTE + ops * OP_SECONDS

`flops` are FlopCounterMode's counts, `moved` the bytes every op reads and writes
(measure/traffic.py), `ops` how many ops run. A FLOP count alone prices every pointwise op,
copy, pooling and BN-apply at zero, so a region of 16-channel convs at 224² (DLA's stem), whose
BN statistics, BN-apply and ReLU move as much time as its convs compute, looked as cheap as its
convs; the bytes term prices them. The constants were measured on the 2-core CPU machine these
docs are measured on, by timing every op of ResNet-50 and DLA-34 train steps (eager and fxfuse)
and fitting this formula (docs/memory_budgets.md#the-time-model); rerun with

    python benchmarks/time_model.py

Only the ranking's order and the report's estimates use them: what is chosen still meets the
budget, whatever the machine.

On another device (the example inputs on CUDA, say) the three rates are the device's own:
`for_device` measures them in well under a second (a conv and a matmul for the FLOP rate, a large
add for the bytes, a run of tiny adds for the cost of one op, each timed on the device with its
clock: CUDA events), caches them per device name, dtype and torch version, in this process and on
disk ($FXFUSE_CACHE_DIR, else ~/.cache/fxfuse/time_model.json), and the report shows them. On CPU
the constants below stay the default, so CPU plans are what they were. A plan is reproduced by
pinning the rates: `optimize(..., time_model=...)` or FXFUSE_TIME_MODEL, each a path to a JSON file
or inline JSON with `seconds_per_flop`, `seconds_per_byte` and `op_seconds` (what the report's
`to_dict()["time_model"]` holds), or "measure" (measure on the inputs' device, CPU too) or
"builtin" (the constants below).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

import torch

# benchmarks/time_model.py, 2026-11-26, 2 threads of an AVX-512 AMD EPYC, float32, channels_last, batch 8 at
# 224²: the fit priced the four train steps it was fitted on (ResNet-50 and DLA-34, eager and fxfuse) at
# 0.95-1.07x of their ops' measured time (three runs: 435-450 GFLOP/s, 53-61 GB/s). A byte moved costs
# about 7.5 FLOPs. EfficientNet-B0's ops run slower than priced (0.61x: its depthwise convs and
# broadcast multiplies do not stream at these rates); regions.ranking.REGION_TIME_COST covers part.
SECONDS_PER_FLOP = 2.22e-12  # 450 GFLOP/s
SECONDS_PER_BYTE = 1.655e-11  # 60 GB/s read and written
OP_SECONDS = 3.4e-6

ENV = "FXFUSE_TIME_MODEL"
CACHE_ENV = "FXFUSE_CACHE_DIR"
BUILTIN_SOURCE = "built in: benchmarks/time_model.py on a 2-core AMD EPYC, float32"


@dataclass(frozen=True)
class Rates:
    """The time model's three rates, and where they come from."""

    seconds_per_flop: float
    seconds_per_byte: float
    op_seconds: float
    device: str = "cpu"  # the device's name (torch.cuda.get_device_name on CUDA)
    dtype: str = "float32"
    source: str = BUILTIN_SOURCE

    def seconds(self, flops: float, moved: float = 0, ops: float = 0) -> float:
        return flops * self.seconds_per_flop + moved * self.seconds_per_byte + ops * self.op_seconds

    def describe(self) -> str:
        return (
            f"{1e-9 / self.seconds_per_flop:.0f} GFLOP/s, {1e-9 / self.seconds_per_byte:.1f} GB/s moved, "
            f"{self.op_seconds * 1e6:.1f} us per op ({self.device}, {self.dtype}; {self.source})"
        )

    def to_dict(self) -> dict:
        return asdict(self)


def builtin() -> Rates:
    """The module's constants (read at call time: benchmarks/ranking_ab.py sets them to try others)."""
    return Rates(SECONDS_PER_FLOP, SECONDS_PER_BYTE, OP_SECONDS)


_IN_USE: contextvars.ContextVar[Optional[Rates]] = contextvars.ContextVar("fxfuse_time_model", default=None)


@contextlib.contextmanager
def using(rates: Optional[Rates]) -> Iterator[None]:
    """`seconds` and `seconds_per_flop` price with `rates` inside this block (None: the built-in constants)."""
    token = _IN_USE.set(rates)
    try:
        yield
    finally:
        _IN_USE.reset(token)


def in_use() -> Rates:
    return _IN_USE.get() or builtin()


def seconds(flops: float, moved: float = 0, ops: float = 0) -> float:
    return in_use().seconds(flops, moved, ops)


def seconds_per_flop() -> float:
    return in_use().seconds_per_flop


# ------------------------------------------------------------------ measuring a device


@dataclass(frozen=True)
class Probe:
    kind: str  # "conv", "matmul", "pointwise" or "launch"
    flops: float  # per call
    moved: float  # bytes read and written per call
    run: Callable[[], Any]
    calls: int  # calls per timing


Timer = Callable[[Probe], float]  # seconds per call of the probe's op


def host_timer(probe: Probe) -> float:
    """Seconds per call of the probe's op, by the host clock: the fastest of three runs of its `calls` calls."""
    fn, calls = probe.run, probe.calls
    fn()
    best = math.inf
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, time.perf_counter() - start)
    return best / calls


def cuda_timer(
    probe: Probe, event: Optional[Callable[..., Any]] = None, synchronize: Optional[Callable[[], None]] = None
) -> float:
    """Seconds per call of the probe's op on the current CUDA stream, by CUDA events around its `calls` calls
    (the fastest of three runs): the device's time, launches included, not the host's view of a queue."""
    fn, calls = probe.run, probe.calls
    event = event or torch.cuda.Event
    synchronize = synchronize or torch.cuda.synchronize
    fn()
    synchronize()
    best = math.inf
    for _ in range(3):
        start, end = event(enable_timing=True), event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)  # elapsed_time is in milliseconds
    return best / calls


def probes(device: torch.device, dtype: torch.dtype) -> list[Probe]:
    """The few ops whose times give the rates, sized for `device` so that each is timed in milliseconds."""
    big = device.type != "cpu"
    size = dtype.itemsize
    n = 4096 if big else 384
    a, b = torch.randn(n, n, device=device).to(dtype), torch.randn(n, n, device=device).to(dtype)
    batch, channels, side = (32, 128, 56) if big else (4, 32, 28)
    x = torch.randn(batch, channels, side, side, device=device).to(dtype).to(memory_format=torch.channels_last)
    w = torch.randn(channels, channels, 3, 3, device=device).to(dtype).to(memory_format=torch.channels_last)
    numel = (1 << 26) if big else (1 << 22)
    u, v = torch.randn(numel, device=device).to(dtype), torch.randn(numel, device=device).to(dtype)
    tiny = torch.zeros(1, device=device, dtype=dtype)
    # Outputs written in place: a fresh large output each call would be page-faulted in on CPU (glibc hands
    # large freed blocks back to the OS), timing the kernel's page faults instead of its memory traffic.
    mm_out, add_out, tiny_out = torch.empty_like(a), torch.empty_like(u), torch.empty_like(tiny)
    conv_flops = 2 * batch * channels * side * side * channels * 9
    return [
        Probe("matmul", 2 * n**3, 3 * n * n * size, lambda: torch.mm(a, b, out=mm_out), 10 if big else 2),
        Probe(
            "conv",
            conv_flops,
            (2 * x.numel() + w.numel()) * size,
            lambda: torch.nn.functional.conv2d(x, w, padding=1),
            10 if big else 2,
        ),
        Probe("pointwise", 0, 3 * numel * size, lambda: torch.add(u, v, out=add_out), 10 if big else 3),
        Probe("launch", 0, 3 * size, lambda: torch.add(tiny, tiny, out=tiny_out), 200),
    ]


def fit(timed: list[tuple[Probe, float]]) -> tuple[float, float, float]:
    """(seconds per FLOP, per byte, per op) from each probe's seconds per call: the launch probe (a few bytes)
    and the pointwise one (hundreds of MB on a GPU) give the cost per op and per byte, two equations in two
    unknowns; the conv and the matmul (together) the cost per FLOP beyond their bytes and their op."""
    (launch, tiny), (pointwise, large) = (_one(timed, "launch"), _one(timed, "pointwise"))
    per_byte = max(large - tiny, 0.0) / (pointwise.moved - launch.moved)
    per_op = max(tiny - launch.moved * per_byte, 0.0)
    heavy = [(p, s) for p, s in timed if p.kind in ("conv", "matmul")]
    rest = sum(max(s - per_op - p.moved * per_byte, 0.0) for p, s in heavy)
    return rest / sum(p.flops for p, _ in heavy), per_byte, per_op


def _one(timed: list[tuple[Probe, float]], kind: str) -> tuple[Probe, float]:
    return next((p, s) for p, s in timed if p.kind == kind)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def measure(
    device: torch.device,
    dtype: torch.dtype,
    timer: Optional[Timer] = None,
    name: Optional[str] = None,
    probe_device: Optional[torch.device] = None,
) -> Rates:
    """The rates of `device` in `dtype`, timed now. `timer` defaults to CUDA events on CUDA and the host clock
    elsewhere; `name` to the device's; `probe_device` (where the probes' tensors live) to `device`: the tests
    fake a device with both."""
    timer = timer or (cuda_timer if device.type == "cuda" else host_timer)
    with torch.no_grad():
        timed = [(p, timer(p)) for p in probes(probe_device or device, dtype)]
    per_flop, per_byte, per_op = fit(timed)
    dtype_name = str(dtype).replace("torch.", "")
    when = time.strftime("%Y-%m-%d")
    return Rates(per_flop, per_byte, per_op, name or device_name(device), dtype_name, f"measured {when}")


_CACHE: dict[str, Rates] = {}


def cache_key(name: str, dtype: torch.dtype) -> str:
    return f"{name}|{str(dtype).replace('torch.', '')}|torch {torch.__version__}"


def cache_path() -> Path:
    root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "fxfuse")
    return Path(root) / "time_model.json"


def _read_disk() -> dict:
    try:
        return json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}


def _write_disk(key: str, rates: Rates) -> None:
    path = cache_path()
    entries = _read_disk()
    entries[key] = rates.to_dict()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError:  # a read-only home: the in-process cache still holds them
        pass


def for_device(
    device: torch.device,
    dtype: torch.dtype,
    measurer: Optional[Callable[[torch.device, torch.dtype], Rates]] = None,
    name: Optional[str] = None,
) -> Rates:
    """The rates of `device` in `dtype`: from this process's cache, else the disk cache, else measured
    (`measurer`, default `measure`) and cached in both."""
    key = cache_key(name or device_name(device), dtype)
    if key in _CACHE:
        return _CACHE[key]
    stored = _read_disk().get(key)
    if stored is not None:
        try:
            rates = Rates(**{**stored, "source": f"cached {stored.get('source', '')} ({cache_path()})"})
        except TypeError:
            rates = None
        if rates is not None:
            _CACHE[key] = rates
            return rates
    rates = (measurer or measure)(device, dtype)
    _CACHE[key] = rates
    _write_disk(key, rates)
    return rates


Spec = Union[None, str, dict, Rates]


def pinned(spec: Spec) -> Optional[Rates]:
    """Rates from a pin: a Rates, a dict, inline JSON or a path to a JSON file with `seconds_per_flop`,
    `seconds_per_byte` and `op_seconds` (the rest optional); None for None, "measure" and "builtin"."""
    if spec is None or isinstance(spec, Rates) or spec in ("measure", "builtin"):
        return spec if isinstance(spec, Rates) else None
    origin = "pinned"
    if isinstance(spec, str):
        text = spec.strip()
        if not text.startswith("{"):
            origin, text = f"pinned: {text}", Path(text).read_text()
        spec = json.loads(text)
    if not isinstance(spec, dict):
        raise ValueError(f"a time model is a dict of rates, got {type(spec).__name__}")
    fields = {"seconds_per_flop", "seconds_per_byte", "op_seconds"}
    missing = fields - set(spec)
    if missing:
        raise ValueError(f"a time model needs {', '.join(sorted(fields))}; missing {', '.join(sorted(missing))}")
    known = {k: spec[k] for k in ("device", "dtype") if k in spec}
    rates = {k: float(spec[k]) for k in fields}
    if not all(math.isfinite(r) and r >= 0 for r in rates.values()) or rates["seconds_per_flop"] <= 0:
        raise ValueError(f"a time model's rates are positive seconds, got {rates}")
    return Rates(**rates, **known, source=origin)


def resolve(
    spec: Spec, device: torch.device, dtype: torch.dtype, measurer: Optional[Callable[..., Rates]] = None
) -> Rates:
    """The rates a plan for inputs on `device` in `dtype` is ranked with: `spec` (optimize's time_model=), else
    FXFUSE_TIME_MODEL, else on CPU the built-in constants and elsewhere the device's measured rates (cached)."""
    if spec is None:
        spec = os.environ.get(ENV) or None
    rates = pinned(spec)
    if rates is not None:
        return rates
    if spec == "builtin" or (spec is None and device.type in ("cpu", "meta")):
        return builtin()
    return for_device(device, dtype, measurer)
