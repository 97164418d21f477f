"""Whether this machine can run ATen's kernels for a CPU capability, found by running them.

ATen trusts CPUID: under ATEN_CPU_CAPABILITY=avx512 it reports AVX512 on a VM whose
hypervisor passes the AVX-512 CPUID bits through to an OS that has not enabled AVX-512,
and its first vectorized op then dies with SIGILL. So before a test runs anything under a
capability it probes it: a child process with ATEN_CPU_CAPABILITY set runs a few eager ops
that take that capability's kernels. Dying on a signal means the machine cannot run them
(a skip); any other failure is a failure.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import subprocess
import sys

# Prints the capability ATen picks before running anything vectorized, so that a probe that
# dies can still say what ATen reported.
PROBE_CODE = """
import torch, torch.nn.functional as F
torch.set_num_threads(1)
print(torch.backends.cpu.get_cpu_capability(), flush=True)
x = torch.randn(8, 32, 32, 32)  # 2**18 float32 elements: the vectorized loops, not the tails
for y in (F.silu(x), x.exp(), F.gelu(x), F.gelu(x, approximate="tanh"), x.tanh(), x * 2 + 1):
    assert y.shape == x.shape
print("ok", flush=True)
"""

# The /proc/cpuinfo flags ATen's build of each capability needs (what the OS says it enabled).
FLAGS = {
    "default": (),
    "avx2": ("avx", "avx2", "fma"),
    "avx512": ("avx512f", "avx512bw", "avx512dq", "avx512vl"),
}


@dataclasses.dataclass(frozen=True)
class Probe:
    capability: str  # as given to ATEN_CPU_CAPABILITY
    picked: str | None  # what ATen reported it runs, if it got that far
    signal: int | None  # the signal the probe died on, None if it ran
    reason: str  # why it cannot run, one sentence; "" if it runs

    @property
    def runs(self) -> bool:
        return self.signal is None


def cpuinfo_flags(path: str = "/proc/cpuinfo") -> set[str] | None:
    """The first processor's flags as the OS reports them, or None where there is no such file."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        return None
    return set()


def _os_view(capability: str) -> str:
    flags = cpuinfo_flags()
    if flags is None:
        return "there is no /proc/cpuinfo to say what the OS enabled"
    wanted = FLAGS.get(capability, ())
    present = [f for f in wanted if f in flags]
    missing = [f for f in wanted if f not in flags]
    parts = []
    if present:
        parts.append("lists " + " ".join(present))
    if missing:
        parts.append(("but not " if present else "lists none of ") + " ".join(missing))
    return "/proc/cpuinfo " + (" ".join(parts) if parts else "names no flags for it")


def env_for(capability: str, base: dict | None = None) -> dict:
    return dict(os.environ if base is None else base, ATEN_CPU_CAPABILITY=capability)


def probe(capability: str, code: str = PROBE_CODE, timeout: float = 300) -> Probe:
    """Run `code` (PROBE_CODE: a few eager ops) under ATEN_CPU_CAPABILITY=capability.

    Returns a Probe that runs, or one that died on a signal with the reason. Raises
    RuntimeError when the child fails any other way (non-zero exit, timeout): that is a
    broken environment, not a missing instruction set.
    """
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code], env=env_for(capability), capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"the ATEN_CPU_CAPABILITY={capability} probe ran past {timeout} s") from exc
    lines = proc.stdout.splitlines()
    picked = lines[0].strip() if lines else None
    if proc.returncode < 0:
        sig = -proc.returncode
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        reported = f"ATen picks {picked}" if picked else "before ATen said what it picks"
        reason = (
            f"ATEN_CPU_CAPABILITY={capability}: eager ATen ops die with {name} on this machine "
            f"({reported}; {_os_view(capability)}), so it cannot run these kernels."
        )
        return Probe(capability, picked, sig, reason)
    if proc.returncode != 0:
        raise RuntimeError(
            f"the ATEN_CPU_CAPABILITY={capability} probe exited with status {proc.returncode}:\n"
            + proc.stdout[-2000:]
            + proc.stderr[-4000:]
        )
    return Probe(capability, picked, None, "")


@functools.cache
def probed(capability: str) -> Probe:
    """probe(capability), once per process."""
    return probe(capability)


def skip_unless_runs(capability: str) -> Probe:
    """pytest.skip with the probe's reason where this machine cannot run the capability."""
    import pytest

    result = probed(capability)
    if not result.runs:
        pytest.skip(result.reason)
    return result
