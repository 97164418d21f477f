"""Side-by-side measurement of eager, fxfuse and the peers users would pick instead, in one process.

Used by `fxfuse bench`, `make demo` and the benchmark scripts, so every number in the
README and docs/results.md comes from the same code. Every row is also a ratio to the baseline: the
faster of the eager variants measured in the same run (for CNNs on CPU, channels_last
eager is often 1.5x faster than NCHW eager, and it is what a careful user runs).
Memory held at the end of forward and the peak of a train step are the allocator's own
counts (`memory.forward_allocated_bytes`, `memory.step_allocated_peak_bytes`), so the bench
leaves the C allocator as a training process has it: an earlier version told glibc to
return every freed block of 64 KiB or more to the OS, for resident-set readings, and every
timed step then page-faulted its activations in (ResNet-50 batch 8 on CPU: eager 2.4 s per
step against 1.3 s). On CPU each row also has the median minor page faults of a timed step
(`memory.minor_faults`): with glibc's defaults a step faults its large blocks in again, and
variants can fault differently, which moves small time ratios. With three repeats or more, each
step time also shows the interquartile range of its rounds over its median, so that a difference
smaller than the noise of the run reads as such.

Variants: "eager" (NCHW) and "eager-channels_last"; fxfuse modes "fast", "memory",
"auto"; "budget=0.7" (fxfuse with memory_budget=0.7), "peak-budget=0.5" (fxfuse with
peak_budget=0.5), "budget=0.3,peak=0.5" (both); peers "checkpoint"
(torch.utils.checkpoint, non-reentrant, on each top-level child block), "compile"
(torch.compile) and "compile-budget=0.7" (torch.compile with AOTAutograd's
activation_memory_budget=0.7, its knapsack over which activations to recompute); and
fxfuse under torch.compile, for each fxfuse mode M run: "compile(M)"
(`torch.compile(fxfuse.optimize(model, mode=M))`, the fused ops as opaque calls) and,
with the peer "compile-fxfuse-composed", "compile(M,composed)" (the same with
fxfuse.ops.compiled.enabled: ATen compositions under a selective-checkpoint policy); the
same for each fxfuse budget B: "compile(budget=B)", "compile(budget=B,composed)"; and, with the peer
"compile-budget-fxfuse", "compile-budget=B(M)": `torch.compile(fxfuse.optimize(model, mode=M))` under
activation_memory_budget=B, so compile's knapsack recomputes the ops between fxfuse's (which it
treats as opaque and never recomputes) while fxfuse's ops keep only what they need.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from tabulate import tabulate
from torch import nn
from torch.utils.checkpoint import checkpoint

from .errors import ConfigurationError
from .fusion import MODES, optimize
from .measure import fit, memory

PEERS = (
    "checkpoint",
    "compile",
    "compile-budget",
    "compile-budget-fxfuse",
    "compile-fxfuse",
    "compile-fxfuse-composed",
)
EAGER_CHANNELS_LAST = "eager-channels_last"


@dataclass
class Row:
    variant: str
    saved_bytes: int
    resident_bytes: int  # held by the allocator at the end of forward (the name predates the allocator count)
    step_seconds: float
    saved_ratio: float = 1.0
    resident_ratio: float = 1.0
    time_ratio: float = 1.0
    peak_bytes: Optional[int] = None  # peak growth of the allocator's bytes during a train step
    peak_ratio: Optional[float] = None
    baseline: bool = False  # the row the ratios are to
    fit_counted: Optional[int] = None  # largest batch within the --fit-cap, counted on the meta device
    fit_measured: Optional[int] = None  # the same by real train steps on the device
    fit_ratio: Optional[float] = None  # fit_measured (else fit_counted) over the baseline's
    step_faults: Optional[float] = None  # median minor page faults of a timed step (CPU, where counted)
    step_spread: Optional[float] = None  # interquartile range of the timed steps over their median (3+ repeats)


# ------------------------------------------------------------------ variants


class Checkpointed(nn.Module):
    """Runs `block` under torch.utils.checkpoint (non-reentrant): keeps only the block's inputs."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        return checkpoint(self.block, *args, use_reentrant=False, **kwargs)


def checkpoint_blocks(model: nn.Module) -> nn.Module:
    """Checkpoint every top-level child block of `model` that has parameters, in place.

    A top-level nn.Sequential (ResNet's layer1, EfficientNet's features) is a list of
    blocks, not a block: its children are checkpointed one by one.
    """

    def wrap(parent: nn.Module) -> None:
        for name, child in list(parent.named_children()):
            if not any(True for _ in child.parameters()):
                continue
            setattr(parent, name, Checkpointed(child))

    for child in list(model.children()):
        if isinstance(child, nn.Sequential):
            wrap(child)
    for name, child in list(model.named_children()):
        if not isinstance(child, nn.Sequential) and any(True for _ in child.parameters()):
            setattr(model, name, Checkpointed(child))
    return model


class BudgetCompiled(nn.Module):
    """`torch.compile(model)` partitioned under AOTAutograd's activation_memory_budget=`budget`.

    Dynamo caches compiled graphs on the code object it starts from, and its guards
    let copies of one model share them: `torch.compile` of a second copy would reuse
    the graph compiled under the first copy's budget. Each instance therefore starts
    from an entry function of its own (a new code object), compiled on its first call
    with the budget in force.
    """

    def __init__(self, model: nn.Module, budget: float, backend: str | Callable = "inductor") -> None:
        super().__init__()
        self.model = model
        self.budget = float(budget)
        namespace: dict = {}
        source = "def entry(model, *args, **kwargs):\n    return model(*args, **kwargs)\n"
        exec(compile(source, f"<fxfuse compile-budget={budget:g} #{id(self)}>", "exec"), namespace)
        self._entry = torch.compile(namespace["entry"], backend=backend)

    def forward(self, *args, **kwargs):
        import torch._functorch.config as functorch_config

        with functorch_config.patch(activation_memory_budget=self.budget):
            return self._entry(self.model, *args, **kwargs)


class ComposedCompiled(nn.Module):
    """`torch.compile(model)` traced and run with fxfuse.ops.compiled.enabled set (see ops/compiled.py).

    The flag is read while dynamo traces and guarded on, so it is set around every call:
    other compiled variants in the process keep their own setting.
    """

    def __init__(self, model: nn.Module, backend: str | Callable = "inductor") -> None:
        super().__init__()
        self.compiled = torch.compile(model, backend=backend)

    def forward(self, *args, **kwargs):
        from .ops import compiled

        enabled, compiled.enabled = compiled.enabled, True
        try:
            return self.compiled(*args, **kwargs)
        finally:
            compiled.enabled = enabled


def budget_compiled_mode(name: str) -> Optional[tuple[float, str]]:
    """(0.5, "fast") for the variant name "compile-budget=0.5(fast)"; None for other names."""
    if not (name.startswith("compile-budget=") and name.endswith(")") and "(" in name):
        return None
    budget, _, mode = name[len("compile-budget=") : -1].partition("(")
    return float(budget), mode


def _compiled_fxfuse_mode(name: str) -> tuple[str, bool]:
    """("memory", composed) for the variant name "compile(memory)" / "compile(memory,composed)"."""
    inner = name[len("compile(") : -1]
    mode, _, composed = inner.partition(",")
    return mode, composed == "composed"


def parse_variants(
    modes: Sequence[str],
    budgets: Sequence[float] = (),
    peers: Sequence[str] = (),
    channels_last_baseline: bool = False,
    peak_budgets: Sequence[float] = (),
    budget_peak: Optional[float] = None,
) -> list[str]:
    """Variant names in table order, eager first; bad names raise ConfigurationError.

    `channels_last_baseline` adds eager in channels_last beside eager NCHW (4-D inputs).
    "compile-budget" runs at each of `budgets`, the budgets fxfuse runs at; "compile-fxfuse"
    and "compile-fxfuse-composed" run torch.compile over each fxfuse mode of `modes`;
    "compile-budget-fxfuse" runs torch.compile over each fxfuse mode of `modes` at each of `budgets`.
    `budget_peak` adds each budget again with that peak budget too.
    """
    names = ["eager"] + ([EAGER_CHANNELS_LAST] if channels_last_baseline else [])
    for mode in modes:
        if mode != "eager" and mode not in MODES:
            raise ConfigurationError(f"unknown mode {mode!r}: choose from eager, {', '.join(MODES)}")
        if mode not in names:
            names.append(mode)
    names += [f"budget={b:g}" for b in budgets]
    if budget_peak is not None:
        if not budgets:
            raise ConfigurationError("a peak budget for the memory budgets needs --budget too")
        names += [f"budget={b:g},peak={budget_peak:g}" for b in budgets]
    names += [f"peak-budget={b:g}" for b in peak_budgets]
    for peer in peers:
        if peer not in PEERS:
            raise ConfigurationError(f"unknown peer {peer!r}: choose from {', '.join(PEERS)}")
        if peer == "compile-budget":
            if not budgets:
                raise ConfigurationError("compile-budget runs torch.compile at fxfuse's budgets: give --budget too")
            names += [f"compile-budget={b:g}" for b in budgets]
        elif peer == "compile-budget-fxfuse":
            fxfuse_modes = [m for m in modes if m in MODES]
            if not fxfuse_modes or not budgets:
                raise ConfigurationError(
                    "compile-budget-fxfuse runs torch.compile over fxfuse's modes at each budget: "
                    "give --modes fast (or memory, auto) and --budget too"
                )
            names += [f"compile-budget={b:g}({m})" for b in budgets for m in fxfuse_modes]
        elif peer.startswith("compile-fxfuse"):
            fxfuse_modes = [m for m in modes if m in MODES]
            if not fxfuse_modes and not budgets:
                raise ConfigurationError(
                    f"{peer} compiles fxfuse's modes and budgets: give --modes memory (or fast, auto) or --budget too"
                )
            suffix = ",composed" if peer == "compile-fxfuse-composed" else ""
            names += [f"compile({m}{suffix})" for m in fxfuse_modes]
            names += [f"compile(budget={b:g}{suffix})" for b in budgets]
        else:
            names.append(peer)
    return names


def is_baseline(name: str) -> bool:
    return name in ("eager", EAGER_CHANNELS_LAST)


def variant_layout(name: str, memory_format: torch.memory_format) -> torch.memory_format:
    """The memory format variant `name` runs in: the eager baselines have their own."""
    if name == "eager":
        return torch.contiguous_format
    if name == EAGER_CHANNELS_LAST:
        return torch.channels_last
    return memory_format


def in_layout(inputs: Sequence[Any], memory_format: torch.memory_format) -> tuple:
    """`inputs` with every 4-D tensor in `memory_format`."""
    return tuple(
        x.contiguous(memory_format=memory_format) if isinstance(x, torch.Tensor) and x.dim() == 4 else x for x in inputs
    )


def variant_inputs(inputs: Sequence[Any], name: str, memory_format: Optional[torch.memory_format]) -> tuple:
    """`inputs` as variant `name` takes them: in its layout (`variant_layout`) when `memory_format` is given."""
    return tuple(inputs) if memory_format is None else in_layout(inputs, variant_layout(name, memory_format))


def make_variant(
    name: str,
    model: nn.Module,
    example_inputs: Sequence[Any],
    memory_format: Optional[torch.memory_format] = None,
    compile_backend: str | Callable = "inductor",
) -> nn.Module:
    """A fresh copy of `model` set up as variant `name` (see parse_variants), in `memory_format` if given
    (the eager baselines always in their own); the torch.compile variants with `compile_backend`
    ("aot_eager_decomp_partition" partitions as inductor does, budget included, in seconds on CPU)."""
    copied = copy.deepcopy(model)
    if memory_format is not None:
        layout = variant_layout(name, memory_format)
        copied = copied.to(memory_format=layout)
        example_inputs = in_layout(example_inputs, layout)
    if is_baseline(name):
        return copied
    if name in MODES:
        return optimize(copied, tuple(example_inputs), mode=name)
    if name.startswith("budget="):
        budget, _, peak = name[len("budget=") :].partition(",peak=")
        return optimize(
            copied, tuple(example_inputs), memory_budget=float(budget), peak_budget=float(peak) if peak else None
        )
    if name.startswith("peak-budget="):
        return optimize(copied, tuple(example_inputs), peak_budget=float(name.split("=", 1)[1]))
    if name == "checkpoint":
        return checkpoint_blocks(copied)
    if name == "compile":
        return torch.compile(copied, backend=compile_backend)
    over_fxfuse = budget_compiled_mode(name)
    if over_fxfuse is not None and over_fxfuse[1] in MODES:
        budget, mode = over_fxfuse
        return BudgetCompiled(optimize(copied, tuple(example_inputs), mode=mode), budget, compile_backend)
    if name.startswith("compile-budget="):
        return BudgetCompiled(copied, float(name.split("=", 1)[1]), compile_backend)
    if name.startswith("compile(") and name.endswith(")"):
        mode, composed = _compiled_fxfuse_mode(name)
        optimized = None
        if mode in MODES:
            optimized = optimize(copied, tuple(example_inputs), mode=mode)
        elif mode.startswith("budget="):
            optimized = optimize(copied, tuple(example_inputs), memory_budget=float(mode.split("=", 1)[1]))
        if optimized is not None:
            if composed:
                return ComposedCompiled(optimized, compile_backend)
            return torch.compile(optimized, backend=compile_backend)
    raise ConfigurationError(f"unknown variant {name!r}")


def variants_for(
    model: nn.Module, modes: Sequence[str], example_inputs: Optional[Sequence[Any]] = None
) -> dict[str, nn.Module]:
    """eager (the model itself) and fxfuse.optimize in each mode."""
    out: dict[str, nn.Module] = {}
    for mode in modes:
        out[mode] = (
            model
            if mode == "eager"
            else optimize(
                copy.deepcopy(model), tuple(example_inputs) if example_inputs is not None else None, mode=mode
            )
        )
    return out


# ------------------------------------------------------------------ measuring


def _peak_bytes(model: nn.Module, inputs: Sequence[Any]) -> Optional[int]:
    device = next((x.device for x in inputs if isinstance(x, torch.Tensor)), torch.device("cpu"))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        memory.train_step(model, inputs)
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    return memory.step_allocated_peak_bytes(lambda: memory.train_step(model, inputs), device)


def compare(
    variants: dict[str, nn.Module],
    inputs: Sequence[Any],
    repeats: int = 5,
    log: Callable[[str], None] = lambda s: None,
    memory_format: Optional[torch.memory_format] = None,
) -> list[Row]:
    """Measure every variant. The baseline of the ratios is the fastest eager variant
    (`is_baseline`), else the first. With `memory_format`, each variant gets the inputs
    in its own layout (`variant_layout`)."""

    saved, resident, peak = {}, {}, {}
    for name, model in variants.items():
        log(f"measuring memory: {name}")
        x = variant_inputs(inputs, name, memory_format)
        memory.train_step(model, x)  # warm-up: kernels, compilation
        saved[name] = memory.saved_activation_bytes(model, x)
        resident[name] = memory.forward_allocated_bytes(model, x)
        peak[name] = _peak_bytes(model, x)
    log(f"timing train steps ({repeats} interleaved repeats)")
    faults: dict[str, float] = {}
    spread: dict[str, float] = {}
    on_cpu = all(x.device.type == "cpu" for x in memory.tensors(inputs))
    times = memory.median_step_times(
        {
            name: (lambda m=model, x=variant_inputs(inputs, name, memory_format): memory.train_step(m, x))
            for name, model in variants.items()
        },
        repeats=repeats,
        faults=faults if on_cpu else None,
        spread=spread,
    )
    baselines = [name for name in variants if is_baseline(name)] or [next(iter(variants))]
    base = min(baselines, key=times.__getitem__)

    def ratio(values: dict, name: str) -> Optional[float]:
        if values[name] is None or not values[base]:
            return None
        return values[name] / values[base]

    return [
        Row(
            name,
            saved[name],
            resident[name],
            times[name],
            ratio(saved, name) or 0.0,
            ratio(resident, name) or 0.0,
            times[name] / times[base],
            peak[name],
            ratio(peak, name),
            baseline=name == base,
            step_faults=faults.get(name),
            step_spread=spread.get(name),
        )
        for name in variants
    ]


FIT_WAYS = ("counted", "measured")


def _fit_hint(name: str, counted: dict[str, int], baseline: str) -> Optional[int]:
    """Where a variant's measured search starts: its own counted answer, else (torch.compile
    runs nothing on the meta device) that of the variant it compiles."""
    if counted.get(name) is not None:
        return counted[name]
    over_fxfuse = budget_compiled_mode(name)
    if over_fxfuse is not None:
        return counted.get(over_fxfuse[1])
    if name.startswith("compile-budget="):
        return counted.get("budget=" + name.split("=", 1)[1])
    if name.startswith("compile(") and name.endswith(")"):
        return counted.get(_compiled_fxfuse_mode(name)[0])
    return counted.get(baseline)


def add_fit(
    rows: list[Row],
    variants: dict[str, nn.Module],
    inputs: Sequence[Any],
    cap_bytes: int,
    ways: Sequence[str] = FIT_WAYS,
    log: Callable[[str], None] = lambda s: None,
    memory_format: Optional[torch.memory_format] = None,
) -> list[Row]:
    """Fill each row's largest batch within `cap_bytes` (`measure.fit`): "counted" on the meta
    device (not for torch.compile variants), "measured" by real train steps, started from the
    counted answer. `inputs` give every dimension but the batch. Ratios are to the baseline row's."""
    for way in ways:
        if way not in FIT_WAYS:
            raise ConfigurationError(f"unknown way to fit a batch {way!r}: choose from {', '.join(FIT_WAYS)}")
    base = next((r.variant for r in rows if r.baseline), rows[0].variant)
    x_of = {name: variant_inputs(inputs, name, memory_format) for name in variants}
    counted: dict[str, int] = {}
    if "counted" in ways:
        for name, model in variants.items():
            if not name.startswith("compile"):
                log(f"largest batch within the cap, counted: {name}")
                counted[name] = fit.largest_batch(model, x_of[name], cap_bytes)
    measured: dict[str, int] = {}
    if "measured" in ways:
        for name, model in variants.items():
            log(f"largest batch within the cap, measured: {name}")
            measured[name] = fit.largest_batch(
                model, x_of[name], cap_bytes, how="measured", start=_fit_hint(name, counted, base)
            )
    chosen = measured or counted
    for r in rows:
        r.fit_counted = counted.get(r.variant)
        r.fit_measured = measured.get(r.variant)
        if chosen.get(r.variant) is not None and chosen.get(base):
            r.fit_ratio = chosen[r.variant] / chosen[base]
    return rows


def render(rows: list[Row], frontier: bool = False) -> str:
    """The table; with `frontier`, a last column names the row that dominates each one
    (`dominated`), blank on the Pareto front."""
    mib = 2**20

    def size(n: Optional[int]) -> str:
        return "-" if n is None else f"{n / mib:.1f} MiB"

    def x(r: Optional[float]) -> str:
        return "-" if r is None else f"{r:.3f}"

    table = [
        (
            r.variant + (" (baseline)" if r.baseline else ""),
            size(r.saved_bytes),
            x(r.saved_ratio),
            size(r.resident_bytes),
            x(r.resident_ratio),
            size(r.peak_bytes),
            x(r.peak_ratio),
            f"{r.step_seconds * 1e3:.0f} ms" + ("" if r.step_spread is None else f" (IQR {r.step_spread:.0%})"),
            x(r.time_ratio),
        )
        for r in rows
    ]
    headers = [
        "variant",
        "saved for backward",
        "ratio",
        "held at end of fwd",
        "ratio",
        "peak in step",
        "ratio",
        "train step",
        "ratio",
    ]
    if any(r.step_faults is not None for r in rows):
        headers.append("page faults/step")
        table = [(*line, "-" if r.step_faults is None else f"{r.step_faults:.0f}") for line, r in zip(table, rows)]
    fit_columns = [
        (attr, header)
        for attr, header in (("fit_counted", "batch in cap (counted)"), ("fit_measured", "batch in cap (measured)"))
        if any(getattr(r, attr) is not None for r in rows)
    ]
    if fit_columns:
        headers += [header for _, header in fit_columns] + ["ratio"]
        table = [
            (*line, *("-" if getattr(r, attr) is None else getattr(r, attr) for attr, _ in fit_columns), x(r.fit_ratio))
            for line, r in zip(table, rows)
        ]
    if frontier:
        marks = dominated(rows)
        headers.append("Pareto front")
        table = [
            (*line, f"dominated by {marks[r.variant]}" if r.variant in marks else "front")
            for line, r in zip(table, rows)
        ]
    return tabulate(table, headers=headers)


def render_narrow(rows: list[Row]) -> str:
    """The table in under 100 columns (`make demo`): bytes saved for backward, step peak and step time,
    each with its ratio to the baseline row (marked *)."""

    def cell(value: str, ratio: Optional[float]) -> str:
        return value if ratio is None else f"{value} ({ratio:.3f}×)"

    def size(n: Optional[int]) -> str:
        return "-" if n is None else f"{n / 2**20:.1f} MiB"

    table = [
        (
            r.variant + ("*" if r.baseline else ""),
            cell(size(r.saved_bytes), r.saved_ratio),
            cell(size(r.peak_bytes), r.peak_ratio),
            cell(f"{r.step_seconds * 1e3:.0f} ms", r.time_ratio)
            + ("" if r.step_spread is None else f" IQR {r.step_spread:.0%}"),
        )
        for r in rows
    ]
    headers = ["variant (*: baseline)", "saved for backward", "peak in step", "train step"]
    return tabulate(table, headers=headers, disable_numparse=True)


def _ratios(r: Row, other: Row) -> str:
    peak = f"{r.peak_bytes / other.peak_bytes:.3f}" if r.peak_bytes and other.peak_bytes else "-"
    return f"time {r.step_seconds / other.step_seconds:.3f}, saved {r.saved_bytes / other.saved_bytes:.3f}, peak {peak}"


def compile_comparison(rows: list[Row]) -> list[str]:
    """For each "compile(M...)" row: its step time, saved bytes and peak as ratios to plain
    "compile"'s, and its peak and saved bytes as ratios to fxfuse eager's in mode M (when measured).
    For each "compile-budget=B(M)" row: the same ratios to "compile-budget=B"'s."""
    by_name = {r.variant: r for r in rows}
    plain = by_name.get("compile")
    lines = []
    for r in rows:
        over_fxfuse = budget_compiled_mode(r.variant)
        peer = by_name.get(f"compile-budget={over_fxfuse[0]:g}") if over_fxfuse else None
        if peer is not None:
            lines.append(f"{r.variant}: vs {peer.variant}: {_ratios(r, peer)}")
        if not (r.variant.startswith("compile(") and r.variant.endswith(")")):
            continue
        parts = []
        if plain is not None:
            parts.append(f"vs compile: {_ratios(r, plain)}")
        eager = by_name.get(_compiled_fxfuse_mode(r.variant)[0])
        if eager is not None:
            parts.append(f"vs fxfuse {eager.variant} eager: {_ratios(r, eager)}")
        if parts:
            lines.append(f"{r.variant}: " + "; ".join(parts))
    return lines


# `fxfuse bench --frontier`: the memory budgets swept when none are given.
FRONTIER_BUDGETS = (0.9, 0.7, 0.5, 0.4, 0.3, 0.25, 0.2, 0.15, 0.1)


def _point(r: Row) -> tuple[float, float, float]:
    return (r.saved_ratio, r.peak_ratio if r.peak_ratio is not None else float("inf"), r.time_ratio)


def dominated(rows: list[Row]) -> dict[str, str]:
    """variant -> the variant that dominates it: no more saved bytes, no higher peak and no slower,
    and better in at least one (the first such row, in table order). Rows on the Pareto front of
    (saved, peak, time) are absent."""
    out = {}
    for r in rows:
        p = _point(r)
        for other in rows:
            q = _point(other)
            if other is not r and all(b <= a for a, b in zip(p, q)) and q != p:
                out[r.variant] = other.variant
                break
    return out


def to_json(rows: list[Row]) -> list[dict]:
    marks = dominated(rows)
    return [{**asdict(r), "dominated_by": marks.get(r.variant)} for r in rows]


def from_json(rows: list[dict]) -> list[Row]:
    """The rows `to_json` wrote (the "rows" of `fxfuse bench --json`)."""
    fields = set(Row.__dataclass_fields__)
    return [Row(**{k: v for k, v in r.items() if k in fields}) for r in rows]
