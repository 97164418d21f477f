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

In each, eager channels_last, fxfuse `mode="fast"`, fxfuse `memory_budget`, and `torch.compile`
without and with `activation_memory_budget=0.5` run interleaved in one process (rounds shuffled).
Prints the median step (ms, and as a ratio to eager's in the same process) and the median minor
page faults of a step (`fxfuse.measure.median_step_times`, getrusage).
"""

from __future__ import annotations

import argparse
import copy
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
    import torch._functorch.config as functorch_config

    import fxfuse
    from fxfuse.commands._common import load_model
    from fxfuse.measure.memory import median_step_times, train_step

    torch.manual_seed(0)
    x = torch.randn(*map(int, args.shape.split(","))).contiguous(memory_format=torch.channels_last)
    eager = load_model(args.model).train().to(memory_format=torch.channels_last)
    models = {
        "eager": eager,
        'fxfuse mode="fast"': fxfuse.optimize(copy.deepcopy(eager), x, mode="fast"),
        f"fxfuse memory_budget={args.budget}": fxfuse.optimize(copy.deepcopy(eager), x, memory_budget=args.budget),
    }
    if not args.no_compile:
        models["compile"] = torch.compile(copy.deepcopy(eager))
        with functorch_config.patch(activation_memory_budget=0.5):  # read when the first call compiles
            models["compile, budget 0.5"] = torch.compile(copy.deepcopy(eager))
            train_step(models["compile, budget 0.5"], (x,))
    faults: dict[str, float] = {}
    steps = {name: (lambda m=m: train_step(m, (x,))) for name, m in models.items()}
    times = median_step_times(steps, repeats=args.repeats, warmup=2, faults=faults)
    for name, seconds in times.items():
        counted = f"{faults[name]:9.0f}" if name in faults else "        -"
        print(f"{args.setting:8} {name:32} {seconds * 1e3:7.0f} ms {seconds / times['eager']:6.3f}x {counted} faults")


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
