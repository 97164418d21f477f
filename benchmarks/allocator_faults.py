"""Train-step time and page faults under three CPU allocator settings: how much of a step is the
kernel handing freed memory back.

    python benchmarks/allocator_faults.py [--model timm.models.dla:dla34] [--shape 8,3,224,224]
        [--budget 0.45] [--repeats 7] [--settings default,no-trim,thp] [--no-compile]

Each setting runs in a process of its own (the allocator reads its environment at start):

* default: glibc as installed. Blocks above its mmap threshold (which adapts, up to 32 MiB) and
  free heap above its trim threshold go back to the OS, and the next step faults them in again;
* no-trim: MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ so large that glibc keeps every
  block: no faults after the first steps (glibc 2.26 or later; older glibc caps the threshold);
* thp: THP_MEM_ALLOC_ENABLE=1, torch's transparent huge pages for large tensors (a fault can be
  2 MiB, so counts are not bytes across settings; the kernel's THP mode decides, and is printed).

Each child starts from this environment less every allocator setting in it (`child_env`), so
that "default" is the allocator as installed. Run it with TORCHINDUCTOR_FORCE_DISABLE_CACHES=1,
so that the budget-0.5 compile compiles anew rather than reusing a cached graph.

In each, `fxfuse bench`'s variants eager-channels_last, fast, budget=B, compile and
compile-budget=0.5 (`fxfuse.bench.make_variant`) run interleaved in one process (rounds shuffled).
Prints the median step (ms, and as a ratio to eager's in the same process) and the median minor
page faults of a step (`fxfuse.measure.median_step_times`, getrusage).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

SETTINGS = {
    "default": {},
    "no-trim": {"MALLOC_MMAP_THRESHOLD_": str(2**32), "MALLOC_TRIM_THRESHOLD_": str(2**36)},
    "thp": {"THP_MEM_ALLOC_ENABLE": "1"},
}
# What else in an environment changes the allocator (glibc's other MALLOC_ variables, its tunables,
# a preloaded jemalloc or tcmalloc).
_ALLOCATOR_VARIABLES = ("GLIBC_TUNABLES", "LD_PRELOAD", "THP_MEM_ALLOC_ENABLE")


def child_env(setting: str, environ: dict[str, str]) -> dict[str, str]:
    """`environ` without any allocator setting, then with `setting`'s."""
    clean = {k: v for k, v in environ.items() if not k.startswith("MALLOC_") and k not in _ALLOCATOR_VARIABLES}
    return {**clean, **SETTINGS[setting]}


def _system() -> str:
    import platform

    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = f.read().strip()
    except OSError:
        thp = "unknown"
    return f"libc {' '.join(platform.libc_ver()) or 'unknown'}, transparent_hugepage {thp}"


def run_one(args) -> None:
    import torch

    from fxfuse import bench
    from fxfuse.commands._common import load_model
    from fxfuse.measure.memory import median_step_times, train_step

    torch.manual_seed(0)
    x = (torch.randn(*map(int, args.shape.split(","))),)
    model = load_model(args.model).train()
    # fxfuse bench's own variants: each compiled one gets a graph of its own (bench.BudgetCompiled), where two
    # torch.compile copies of one model would share the first one's graph and its budget.
    names = [bench.EAGER_CHANNELS_LAST, "fast", f"budget={args.budget:g}"]
    names += [] if args.no_compile else ["compile", "compile-budget=0.5"]
    layout = torch.channels_last
    models = {name: bench.make_variant(name, model, x, layout) for name in names}
    inputs = {name: bench.variant_inputs(x, name, layout) for name in names}
    steps = {name: (lambda m=m, i=inputs[name]: train_step(m, i)) for name, m in models.items()}
    faults: dict[str, float] = {}
    times = median_step_times(steps, repeats=args.repeats, warmup=2, faults=faults)
    base = times[bench.EAGER_CHANNELS_LAST]
    for name, seconds in times.items():
        counted = f"{faults[name]:9.0f}" if name in faults else "        -"
        print(f"{args.setting:8} {name:32} {seconds * 1e3:7.0f} ms {seconds / base:6.3f}x {counted} faults")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="timm.models.dla:dla34")
    parser.add_argument("--shape", default="8,3,224,224")
    parser.add_argument("--budget", type=float, default=0.45)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile variants")
    parser.add_argument("--setting", help=argparse.SUPPRESS)  # set in each child process
    args = parser.parse_args()
    if args.setting:
        if child_env(args.setting, dict(os.environ)) != dict(os.environ):
            parser.error("--setting is for the child processes this script starts")
        run_one(args)
        return
    settings = args.settings.split(",")
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        parser.error(f"unknown settings {', '.join(unknown)}: choose from {', '.join(SETTINGS)}")
    print(_system())
    for setting in settings:
        child = [sys.executable, __file__, *sys.argv[1:], "--setting", setting]
        subprocess.run(child, env=child_env(setting, dict(os.environ)), check=True)


if __name__ == "__main__":
    main()
