"""Instructions a piece of code executes, counted by valgrind's callgrind (for benchmarks/host_cost.py).

On a shared 2-core machine a host-time ratio moves by ±5% from one process to the next. The
instructions a call executes do not depend on what else the machine runs: callgrind counts the same
total twice for the same binary and inputs. They are not time (cache misses and the allocator's
page faults cost time, not instructions), so a benchmark reports them beside its timings.

`reexec_under_callgrind(argv)` runs the script again under callgrind with instrumentation off until
asked; inside that run, `count(fn, calls)` turns it on around `calls` calls of `fn`, dumps the
counts and reads them back: instructions a call. The switch is callgrind's client requests, which
only C can issue: a tiny shared library, compiled here with the system's cc from valgrind's
callgrind.h on first use.
"""

from __future__ import annotations

import ctypes
import glob
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Callable

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


_lib = None


def count(fn: Callable[[], None], calls: int) -> float:
    """Instructions a call of `fn`, over `calls` calls (inside the callgrind run only)."""
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
        totals = [line for line in f if line.startswith("totals:")]
    os.remove(dump)
    return int(totals[0].split()[1]) / calls
