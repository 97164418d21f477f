"""Instructions a piece of code executes, counted by valgrind's callgrind (for benchmarks/host_cost.py).

On a shared 2-core machine a host-time ratio moves by ±5% from one process to the next. The
instructions a call executes do not depend on what else the machine runs: callgrind counts the same
total twice for the same binary and inputs. They are not time (cache misses and the allocator's
page faults cost time, not instructions), so a benchmark reports them beside its timings.

`reexec_under_callgrind(argv)` runs the script again under callgrind with instrumentation off until
asked; inside that run, `count(fn, calls)` turns it on around `calls` calls of `fn`, dumps the
counts and reads them back: instructions a call, and how many of them ran inside the compute
kernels (`KERNELS`: oneDNN's primitives and the BLAS gemm ATen calls). On a GPU those run on the
device, so the rest is what the host spends; on ResNet-50 at 2×3×16×16 the kernels are 70% of a
step: the weights, not the input, set their size. The switch is callgrind's client requests, which
only C can issue: a tiny shared library, compiled here with the system's cc from valgrind's
callgrind.h on first use.

`parse_args` gives a benchmark its --instructions switch, and `rounds` measures its variants either
way: instructions in the callgrind run, the thread's CPU time otherwise (host_cost.py,
region_overhead.py).
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, NamedTuple

_ENV = "FXFUSE_CALLGRIND_DIR"
_SHIM = r"""
#include <valgrind/callgrind.h>
void fxfuse_cg_start(void) { CALLGRIND_START_INSTRUMENTATION; CALLGRIND_ZERO_STATS; }
void fxfuse_cg_stop(void) { CALLGRIND_DUMP_STATS; CALLGRIND_STOP_INSTRUMENTATION; }
"""


def active() -> bool:
    """Whether this process is the run under callgrind."""
    return _ENV in os.environ


def reexec_under_callgrind(argv: list[str]) -> int:
    """Runs `python argv...` under callgrind, instrumentation off until `count` turns it on, and
    returns its exit status. Needs valgrind and a C compiler with valgrind's headers."""
    if shutil.which("valgrind") is None or not os.path.exists("/usr/include/valgrind/callgrind.h"):
        sys.exit("--instructions needs valgrind and its headers (Debian: valgrind)")
    out = tempfile.mkdtemp(prefix="fxfuse-callgrind-")
    try:
        lib = os.path.join(out, "shim.so")
        src = os.path.join(out, "shim.c")
        with open(src, "w") as f:
            f.write(_SHIM)
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", src, "-o", lib], check=True)
        cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}/cg.out", "-q"]
        return subprocess.run(cmd + [sys.executable, *argv], env={**os.environ, _ENV: out}).returncode
    finally:
        shutil.rmtree(out, ignore_errors=True)


# Entry points of the compute kernels on CPU, as callgrind names them. In float32 and float64 neither
# calls the other, so the inclusive costs of their calls add up without counting an instruction twice
# (a bfloat16 gemm runs oneDNN inside cpublas::gemm, a level below the caller this checks: its count
# would be doubled).
KERNELS = ("dnnl_primitive_execute", "at::native::cpublas::gemm(")


class Counts(NamedTuple):
    total: float  # instructions a call
    kernels: float  # of them, inside KERNELS' calls

    @property
    def host(self) -> float:
        return self.total - self.kernels


def kernel_instructions(lines: list[str], kernels: tuple[str, ...] = KERNELS) -> int:
    """Instructions spent in calls to `kernels` from outside them, read off a callgrind dump: each
    `calls=` line is followed by the inclusive cost of those calls (one event, Ir, is recorded)."""
    names: dict[str, str] = {}

    def name(field: str) -> str:  # "(12) name" the first time, "(12)" after: callgrind's compression
        if field.startswith("("):
            key, _, rest = field.partition(")")
            if rest.strip():
                names[key] = rest.strip()
            return names.get(key, "")
        return field

    def is_kernel(fn: str) -> bool:
        return any(fn.startswith(k) for k in kernels)

    total, caller, callee, after_calls = 0, "", "", False
    for line in lines:
        if after_calls:
            after_calls = False
            if is_kernel(callee) and not is_kernel(caller):
                total += int(line.split()[-1])
        elif line.startswith("fn="):
            caller = name(line[3:].rstrip("\n"))
        elif line.startswith("cfn="):
            callee = name(line[4:].rstrip("\n"))
        elif line.startswith("calls="):
            after_calls = True
    return total


def parse_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """`parser`'s arguments with --instructions added; with it, outside callgrind, runs this script again
    under callgrind and exits with its status."""
    parser.add_argument("--instructions", action="store_true", help="count instructions under callgrind")
    args = parser.parse_args()
    if args.instructions and not active():
        sys.exit(reexec_under_callgrind(sys.argv))
    return args


_lib = None


def count(fn: Callable[[], None], calls: int) -> Counts:
    """Instructions a call of `fn`, over `calls` calls, and those in the kernels (inside the callgrind
    run only)."""
    global _lib
    out = os.environ[_ENV]
    if _lib is None:
        _lib = ctypes.CDLL(os.path.join(out, "shim.so"))
    before = set(glob.glob(os.path.join(out, "cg.out*")))
    _lib.fxfuse_cg_start()
    for _ in range(calls):
        fn()
    _lib.fxfuse_cg_stop()
    (dump,) = set(glob.glob(os.path.join(out, "cg.out*"))) - before
    with open(dump) as f:
        lines = f.readlines()
    os.remove(dump)
    totals = [line for line in lines if line.startswith("totals:")]
    return Counts(int(totals[0].split()[1]) / calls, kernel_instructions(lines) / calls)


def per_call(fn: Callable[[], None], calls: int) -> tuple[float, float]:
    """(all, host) a call of `fn` over `calls` calls: in the callgrind run thousands of instructions and
    those outside the compute kernels (KERNELS); else µs of the thread's CPU time, both the same."""
    if active():
        counts = count(fn, calls)
        return counts.total / 1e3, counts.host / 1e3
    # The thread's CPU time, not the wall clock: with one thread it is all the host spends, and other
    # processes on the machine do not count into it (they still share caches: keep the box quiet).
    start = time.thread_time()
    for _ in range(calls):
        fn()
    t = (time.thread_time() - start) / calls * 1e6
    return t, t


def rounds(
    variants: dict[str, Callable[[], None]], calls: int, repeats: int, warmup: int = 3
) -> dict[str, tuple[float, float]]:
    """per_call of each variant: the median of `repeats` interleaved rounds (each measures every variant
    once), after `warmup` calls of each (first calls build caches, graphs and autograd nodes). One round
    in the callgrind run: a count does not vary between rounds."""
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    measured: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for _ in range(1 if active() else repeats):
        for name, fn in variants.items():
            measured[name].append(per_call(fn, calls))
    return {
        name: (statistics.median(a for a, _ in m), statistics.median(h for _, h in m)) for name, m in measured.items()
    }
