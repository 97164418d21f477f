"""tests/support/cpu_probe.py tells a capability that runs from one that dies on a signal.

This machine runs what it has, so the dying case is a child that kills itself with
SIGILL, as an AVX-512 instruction does on an OS that has not enabled AVX-512.

Every assertion holds on any x86 machine: the logic is tested with faked children, and the
real machine only for consistency (what ATen picks under a capability is asked of ATen in a
child, never assumed to be this process's own: an AVX2 VM whose CPUID reports AVX-512 runs
AVX2 here and picks AVX512 under ATEN_CPU_CAPABILITY=avx512).
"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
import torch
from support import cpu_probe

PRINT_PICKED = "import torch\nprint(torch.backends.cpu.get_cpu_capability(), flush=True)\n"

SIGILL_AFTER_PICKING = (
    "import os, signal, torch\n"
    "print(torch.backends.cpu.get_cpu_capability(), flush=True)\n"
    "os.kill(os.getpid(), signal.SIGILL)\n"
)


def aten_picks(capability: str) -> str:
    """What ATen reports under ATEN_CPU_CAPABILITY=capability, asked of a child that runs no
    vectorized op (so it cannot die of the capability)."""
    out = subprocess.run(
        [sys.executable, "-c", PRINT_PICKED],
        env=cpu_probe.env_for(capability),
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    return out.stdout.strip()


def test_default_runs():
    result = cpu_probe.probe("default")
    assert result.runs and result.signal is None and result.reason == ""
    assert result.picked == "DEFAULT"


def test_this_process_capability_runs():
    # Whatever ATen picks for this process runs here (this test is running), and the probe
    # agrees.
    own = torch.backends.cpu.get_cpu_capability()
    result = cpu_probe.probe(own.lower())
    assert result.runs and result.picked == own


def test_sigill_is_a_skip_with_the_reason():
    result = cpu_probe.probe("avx512", code=SIGILL_AFTER_PICKING)
    assert not result.runs
    assert result.signal == signal.SIGILL
    # What ATen reports under the variable, which need not be this process's capability.
    assert result.picked == aten_picks("avx512")
    assert "ATEN_CPU_CAPABILITY=avx512" in result.reason and "SIGILL" in result.reason
    assert f"ATen picks {result.picked}" in result.reason
    flags = cpu_probe.cpuinfo_flags()
    if flags is not None:
        assert "/proc/cpuinfo" in result.reason
        for flag in cpu_probe.FLAGS["avx512"]:
            assert flag in result.reason
    assert result.reason.count(". ") == 0 and result.reason.endswith(".")  # one sentence


@pytest.mark.parametrize("capability", ["default", "avx2", "avx512"])
def test_probe_reports_what_aten_picks(capability):
    # Consistency on the real machine: a probe that runs, or one that dies after ATen said what it
    # picks, reports what ATen picks under that capability (never more than was asked for).
    result = cpu_probe.probed(capability)
    assert result.picked == aten_picks(capability)
    order = ["DEFAULT", "AVX2", "AVX512"]
    if result.picked in order:
        assert order.index(result.picked) <= order.index(capability.upper())


def test_sigill_under_faulthandler_is_still_a_signal():
    # pytest and PYTHONFAULTHANDLER print "Fatal Python error: Illegal instruction" and then
    # re-raise the signal: still a death by signal, not an exit status.
    code = "import faulthandler, os, signal\nfaulthandler.enable()\nos.kill(os.getpid(), signal.SIGILL)\n"
    result = cpu_probe.probe("avx2", code=code)
    assert result.signal == signal.SIGILL and result.picked is None
    assert "before ATen said what it picks" in result.reason


def test_skip_unless_runs_skips_on_a_signal(monkeypatch):
    dead = cpu_probe.Probe("avx512", "AVX512", int(signal.SIGILL), "the reason.")
    monkeypatch.setattr(cpu_probe, "probed", lambda capability: dead)
    with pytest.raises(pytest.skip.Exception, match="the reason"):
        cpu_probe.skip_unless_runs("avx512")


@pytest.mark.parametrize(
    "code, match",
    [
        ("import sys; sys.exit(3)", "exited with status 3"),
        ("raise ImportError('no torch here')", "no torch here"),
    ],
)
def test_other_failures_raise(code, match):
    with pytest.raises(RuntimeError, match=match):
        cpu_probe.probe("avx2", code=code)


def test_timeout_raises():
    with pytest.raises(RuntimeError, match="ran past"):
        cpu_probe.probe("avx2", code="import time; time.sleep(30)", timeout=0.5)


def test_cpuinfo_flags(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert cpu_probe.cpuinfo_flags(str(path)) == {"fpu", "sse2", "avx", "avx2", "fma"}
    assert cpu_probe.cpuinfo_flags(str(tmp_path / "missing")) is None


def test_reason_on_an_avx2_vm_that_reports_avx512(monkeypatch):
    # The VM: /proc/cpuinfo lists avx2 and fma but no avx512* flags.
    monkeypatch.setattr(cpu_probe, "cpuinfo_flags", lambda: {"sse2", "avx", "avx2", "fma"})
    code = "import os, signal\nprint('AVX512', flush=True)\nos.kill(os.getpid(), signal.SIGILL)\n"
    assert cpu_probe.probe("avx512", code=code).reason == (
        "ATEN_CPU_CAPABILITY=avx512: eager ATen ops die with SIGILL on this machine (ATen picks AVX512; "
        "/proc/cpuinfo lists none of avx512f avx512bw avx512dq avx512vl), so it cannot run these kernels."
    )
    monkeypatch.setattr(cpu_probe, "cpuinfo_flags", lambda: {"sse2", "avx", "avx2"})
    assert "/proc/cpuinfo lists avx avx2 but not fma)" in cpu_probe.probe("avx2", code=code).reason
    monkeypatch.setattr(cpu_probe, "cpuinfo_flags", lambda: None)
    assert "no /proc/cpuinfo" in cpu_probe.probe("avx2", code=code).reason
