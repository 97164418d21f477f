"""Measuring what fxfuse changes, the same way everywhere (tests, benchmarks, CLI, examples).

* saved activations: unique storages packed by autograd during one forward
  (`torch.autograd.graph.saved_tensors_hooks`), excluding parameters, buffers and inputs;
* memory held at the end of forward and the peak of a train step: the allocator's own count
  (`forward_allocated_bytes`, `step_allocated_peak_bytes`, from the profiler's memory events),
  which does not depend on what the C allocator keeps resident; the resident-set readings
  (`forward_resident_bytes`, `step_peak_bytes`) need MALLOC_MMAP_THRESHOLD_=65536 in the
  environment at process start, so that freed blocks go back to the OS;
* time: median train step, reported as a ratio against eager measured in the same process,
  with the minor page faults of a step beside it where the platform counts them.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import gc
import os
import random
import statistics
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake, unset_fake_temporarily

try:
    import resource
except ImportError:  # Windows
    resource = None  # type: ignore[assignment]


def storage_key(t: torch.Tensor):
    storage = t.untyped_storage()
    if t.device.type == "meta" or is_fake(t):  # no data pointers: the storage object itself is the identity
        return ("meta", storage._cdata, storage.nbytes())
    return (t.device.type, storage.data_ptr(), storage.nbytes())


def tensors(obj) -> list[torch.Tensor]:
    leaves, _ = torch.utils._pytree.tree_flatten(obj)
    return [x for x in leaves if isinstance(x, torch.Tensor)]


def saved_activation_bytes(model: nn.Module, inputs: Sequence[Any]) -> int:
    """Bytes of the distinct storages autograd keeps for backward during one forward."""
    exclude = {storage_key(t) for t in (*model.parameters(), *model.buffers(), *tensors(inputs))}
    seen: dict[tuple, int] = {}

    def pack(t: torch.Tensor):
        key = storage_key(t)
        if key not in exclude and key[1] != 0 and key[2] > 0:
            seen[key] = key[2]
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(*inputs)
    del out
    return sum(seen.values())


@dataclass(frozen=True)
class Autocast:
    """The autocast a count runs under: `torch.autocast(device_type, dtype)`."""

    device_type: str
    dtype: torch.dtype

    def __str__(self) -> str:
        return f"{str(self.dtype).replace('torch.', '')} autocast on {self.device_type}"


def autocast_in_effect(inputs: Sequence[Any]) -> Optional[Autocast]:
    """The autocast enabled here for the device type of `inputs` (their first tensor's; CPU without one)."""
    device_type = next((t.device.type for t in tensors(inputs)), "cpu")
    if device_type == "meta" or not torch.is_autocast_enabled(device_type):
        return None
    return Autocast(device_type, torch.get_autocast_dtype(device_type))


# Set by `counting_under`: the autocast meta-device counts run under, and the fake-tensor mode that stands in
# for the meta device while they do.
_COUNTING: contextvars.ContextVar[Optional[tuple[Autocast, FakeTensorMode]]] = contextvars.ContextVar(
    "fxfuse_counting", default=None
)


@contextlib.contextmanager
def counting_under(autocast: Optional[Autocast]) -> Iterator[None]:
    """Meta-device counts made inside this block (`meta_copy`, `to_meta` and a forward inside `counted_run`)
    count what eager keeps under `autocast`: the casted copies, the low-precision activations, the float32
    statistics. The meta device has no autocast, so the copies are fake tensors on `autocast.device_type`
    (shapes only, no data, no compute, as on meta) and the forward runs under `torch.autocast` there.
    None: plain meta-device counts (no autocast applies to them, whatever is enabled around)."""
    token = _COUNTING.set(None if autocast is None else (autocast, FakeTensorMode(allow_non_fake_inputs=True)))
    try:
        yield
    finally:
        _COUNTING.reset(token)


def counting_autocast() -> Optional[Autocast]:
    """The autocast `counting_under` set for the counts made here, if any."""
    counting = _COUNTING.get()
    return None if counting is None else counting[0]


@contextlib.contextmanager
def counted_run() -> Iterator[None]:
    """Around a forward (and backward) of `meta_copy`'s copy on `to_meta`'s inputs: under `counting_under`'s
    fake-tensor mode and autocast, if set."""
    counting = _COUNTING.get()
    if counting is None:
        yield
        return
    autocast, fake_mode = counting
    with fake_mode, torch.autocast(autocast.device_type, dtype=autocast.dtype):
        yield


def _shape_only(t: torch.Tensor) -> torch.Tensor:
    """A fresh data-free tensor like `t`: on meta, or a fake tensor under `counting_under`. Fresh even for a
    model already on meta (`to` would return the same object, and the copy would share its buffers: tracing
    would then take the copy's buffers for the model's)."""
    counting = _COUNTING.get()
    if counting is None:
        return torch.empty_like(t, device="meta") if t.is_meta else t.to("meta")
    autocast, fake_mode = counting
    with fake_mode:
        return torch.empty_like(t, device=autocast.device_type)


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` whose parameters and buffers live on the meta device (no data is copied),
    its hooks silenced (`silence_hooks`); under `counting_under`, fake tensors stand in for meta."""
    memo: dict[int, Any] = {}
    for t in (*model.parameters(), *model.buffers()):
        if isinstance(t, nn.Parameter):
            memo[id(t)] = nn.Parameter(_shape_only(t.detach()), requires_grad=t.requires_grad)
        elif t.dim() == 0 and not t.is_floating_point():
            # Counters stay real (copied): BatchNorm(momentum=None) reads float(num_batches_tracked).
            memo[id(t)] = t.clone()
        else:
            memo[id(t)] = _shape_only(t)
    with unset_fake_temporarily():  # the model's other attributes are copied as they are
        return silence_hooks(copy.deepcopy(model, memo))


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def _no_op_hook(*args: Any, **kwargs: Any) -> None:
    return None


def silence_hooks(model: nn.Module) -> nn.Module:
    """Make every module hook of `model` do nothing; each module keeps as many hooks, of the same
    kinds, so fxfuse traces and fuses it as it does the model. For meta-device copies: the user's
    hooks must not see meta tensors, nor count fxfuse's shape-only forwards as calls. (Hooks that
    compute a module's weight, like torch.nn.utils.prune's, leave a tensor attribute that such a
    copy cannot be made of anyway.)"""
    for m in model.modules():
        for name in _HOOK_DICTS:
            hooks = getattr(m, name)
            if hooks:
                setattr(m, name, OrderedDict.fromkeys(hooks, _no_op_hook))
    return model


def to_meta(inputs: Sequence[Any]) -> tuple:
    """Data-free stand-ins for `inputs`: meta tensors, or fake tensors under `counting_under`."""
    counting = _COUNTING.get()
    if counting is None:
        return tuple(
            torch.empty_like(x, device="meta").requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
            for x in inputs
        )
    autocast, fake_mode = counting
    with fake_mode:
        return tuple(
            torch.empty_like(x, device=autocast.device_type).requires_grad_(x.requires_grad)
            if isinstance(x, torch.Tensor)
            else x
            for x in inputs
        )


def saved_activation_bytes_meta(
    model: nn.Module, inputs: Sequence[Any], prepare: Callable[[nn.Module], Any] | None = None
) -> int:
    """`saved_activation_bytes` without real compute: one forward of a meta-device copy.

    Counts the same storages (meta tensors have the real shapes, dtypes and strides),
    and nothing the user owns runs or changes. `prepare` runs on the copy first
    (e.g. to optimize it with a candidate selection).
    """
    copy_ = meta_copy(model)
    with counted_run():
        if prepare is not None:
            prepare(copy_)
        return saved_activation_bytes(copy_, to_meta(inputs))


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def forward_resident_bytes(model: nn.Module, inputs: Sequence[Any]) -> int:
    """Growth of resident memory from before forward to the end of forward (graph alive)."""
    gc.collect()
    before = rss_bytes()
    out = model(*inputs)
    after = rss_bytes()
    del out
    gc.collect()
    return after - before


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmHWM in /proc/self/status")


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def step_peak_bytes(step: Callable[[], None]) -> int | None:
    """Peak resident-memory growth during one call of `step` (None where the OS cannot tell).

    Linux only: resets the process's resident high-water mark (VmHWM) before the step.
    """
    gc.collect()
    if not _reset_peak_rss():
        return None
    before = rss_bytes()
    step()
    return _peak_rss_bytes() - before


def _allocator_deltas(fn: Callable[[], Any], device: torch.device) -> list[int]:
    """Every allocation (+bytes) and free (-bytes) on `device`'s allocator during `fn()`, in order.

    From the profiler's memory events, which the CPU allocator and CUDA's caching allocator
    report for every tensor, including the temporaries inside C++ ops (fxfuse's too).
    """
    kind = torch.autograd.DeviceType.CUDA if device.type == "cuda" else torch.autograd.DeviceType.CPU
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    with _without_stderr():  # the profiler logs every start and stop there
        prof.__enter__()
    try:
        fn()
    finally:
        with _without_stderr():
            prof.__exit__(None, None, None)
            events = [
                (e.start_ns(), e.nbytes())
                for e in prof.profiler.kineto_results.events()
                if e.name() == "[memory]" and e.device_type() == kind
            ]
    return [nbytes for _, nbytes in sorted(events, key=lambda e: e[0])]


@contextlib.contextmanager
def _without_stderr():
    """File descriptor 2 to /dev/null for the block (C++ logging bypasses sys.stderr)."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def step_allocated_peak_bytes(step: Callable[[], None], device: torch.device = torch.device("cpu")) -> int:
    """Peak growth of the bytes held by `device`'s allocator during one call of `step`.

    Counts tensors, not pages: the same for any state of the C allocator underneath (glibc's
    resident memory depends on what earlier steps left in its free lists). On CUDA the bench
    reads torch.cuda.max_memory_allocated instead (this path is untested on a GPU).
    """
    gc.collect()
    held = peak = 0
    for nbytes in _allocator_deltas(step, device):
        held += nbytes
        peak = max(peak, held)
    return peak


def forward_allocated_bytes(model: nn.Module, inputs: Sequence[Any]) -> int:
    """Bytes allocated during forward and still held at its end (graph alive), per the allocator."""
    device = next((t.device for t in tensors(inputs)), torch.device("cpu"))
    gc.collect()
    outputs: list = []  # the output (and with it the graph) stays alive until the count is taken
    deltas = _allocator_deltas(lambda: outputs.append(model(*inputs)), device)
    outputs.clear()
    gc.collect()
    return sum(deltas)


def train_step(
    model: nn.Module,
    inputs: Sequence[Any],
    optimizer: torch.optim.Optimizer | None = None,
    keep_grads: bool = False,
) -> None:
    out = model(*inputs)
    loss = sum(t.float().square().mean() for t in tensors(out))
    loss.backward()
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    elif not keep_grads:
        model.zero_grad(set_to_none=True)


def synchronize() -> None:
    """Wait for every CUDA device this process has used, so that a host clock read after it counts
    the device's work and not only the launches (a no-op where CUDA was never initialized)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for device in range(torch.cuda.device_count()):
            torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any]) -> float:
    """Seconds one call of `fn` takes, device work included."""
    synchronize()
    start = time.perf_counter()
    fn()
    synchronize()
    return time.perf_counter() - start


def python_calls(fn: Callable[[], Any]) -> int:
    """Python function calls one run of `fn` makes (the profiler's "call" events): what a host-cost
    test can count where a time would move with the machine's load."""
    calls = 0

    def profile(frame, event, arg):
        nonlocal calls
        calls += event == "call"

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(previous)
    return calls


def minor_faults() -> Optional[int]:
    """Minor page faults of this process so far (every thread), or None where getrusage has no count.

    On CPU most are memory the kernel hands over: with glibc's defaults, blocks above its mmap
    threshold (which adapts, up to 32 MiB) go back to the OS when freed and the next step faults
    them in again, which can cost several percent of a step and can differ between variants that
    keep different amounts."""
    if resource is None:
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def median_step_times(
    steps: dict[str, Callable[[], None]],
    repeats: int = 5,
    warmup: int = 1,
    faults: Optional[dict[str, float]] = None,
    spread: Optional[dict[str, float]] = None,
) -> dict[str, float]:
    """Median seconds per call of each function, calls interleaved so drift hits all alike.

    Each round runs the functions in a new order (a fixed seed, so a rerun repeats it): in a
    fixed order each variant always follows the same one and inherits what that one left in
    the allocator and caches. With `faults` (a dict), it also gets each function's median minor
    page faults per call (`minor_faults`), where the platform counts them; with `spread`, the
    interquartile range of each function's timed calls over their median (from three repeats)."""
    for fn in steps.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in steps}
    counts: dict[str, list[int]] = {name: [] for name in steps}
    order = list(steps)
    shuffle = random.Random(0).shuffle
    for _ in range(repeats):
        for name in order:
            before = minor_faults() if faults is not None else None
            times[name].append(timed(steps[name]))
            if before is not None:
                counts[name].append(minor_faults() - before)
        shuffle(order)
    if faults is not None:
        faults.update({name: statistics.median(c) for name, c in counts.items() if c})
    if spread is not None and repeats >= 3:
        for name, ts in times.items():
            q1, _, q3 = statistics.quantiles(ts, n=4, method="inclusive")
            spread[name] = (q3 - q1) / statistics.median(ts)
    return {name: statistics.median(ts) for name, ts in times.items()}
