"""Which build of the hand-written CPU kernels runs (csrc/cpu/capability.cpp): the AVX2 one
only where the CPU has AVX, AVX2 and FMA, the OS has enabled their YMM state (XCR0, read
with XGETBV), and ATen runs AVX2 or better; the baseline one otherwise."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest
import torch
from support import cpu_probe

from fxfuse import _extension

pytestmark = pytest.mark.skipif(not _extension.loaded(), reason="fxfuse._C is not built")

FMA, OSXSAVE, AVX = 1 << 12, 1 << 27, 1 << 28  # CPUID.1:ECX
AVX2 = 1 << 5  # CPUID.(7,0):EBX
AVX512F = 1 << 16  # CPUID.(7,0):EBX
X87, SSE, YMM, AVX512_STATE = 0x1, 0x2, 0x4, 0xE0  # XCR0
ECX, EBX, XCR0 = FMA | OSXSAVE | AVX, AVX2, X87 | SSE | YMM
X86 = platform.machine().lower() in ("x86_64", "amd64")


def usable(ecx, ebx, xcr0):
    return _extension._C._avx2_fma_usable(ecx, ebx, xcr0)


def test_avx2_needs_the_cpu_bits_and_the_os_state():
    assert usable(ECX, EBX, XCR0)
    assert usable(ECX, EBX | AVX512F, XCR0)  # AVX-512 in CPUID, its state not enabled: AVX2 still runs
    assert usable(ECX, EBX | AVX512F, XCR0 | AVX512_STATE)
    assert not usable(ECX & ~FMA, EBX, XCR0)
    assert not usable(ECX & ~AVX, EBX, XCR0)
    assert not usable(ECX, 0, XCR0)
    # The CPU has every instruction, but the OS does not save the YMM registers (no
    # OSXSAVE, or XCR0 without the AVX state): the instructions would fault.
    assert not usable(ECX & ~OSXSAVE, EBX, XCR0)
    assert not usable(ECX, EBX, X87 | SSE)
    assert not usable(ECX, EBX, X87 | YMM)
    assert not usable(ECX, EBX, 0)


@pytest.mark.skipif(not X86, reason="CPUID and XCR0 are x86 registers")
def test_this_cpu_agrees_with_what_the_os_reports():
    ecx, ebx, xcr0 = _extension._C._cpu_id()
    flags = cpu_probe.cpuinfo_flags()
    if flags is None:
        pytest.skip("no /proc/cpuinfo to compare with")
    # Linux lists avx/avx2/fma only where it enabled their state in XCR0.
    assert usable(ecx, ebx, xcr0) == {"avx", "avx2", "fma"}.issubset(flags), (hex(ecx), hex(ebx), hex(xcr0))
    assert bool(xcr0 & YMM) == ("avx" in flags)


def _expected_build(capability):
    ok = usable(*_extension._C._cpu_id()) and capability in ("AVX2", "AVX512")
    return "AVX2" if ok else "DEFAULT"


def test_build_in_this_process():
    assert _extension._C._cpu_kernel_build() == _expected_build(torch.backends.cpu.get_cpu_capability())


@pytest.mark.parametrize("capability", ["default", "avx2"])
def test_build_follows_aten_cpu_capability(capability):
    picked = cpu_probe.skip_unless_runs(capability).picked
    code = "import fxfuse._C as C; print(C._cpu_kernel_build())"
    out = subprocess.run(
        [sys.executable, "-c", code], env=cpu_probe.env_for(capability), capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == _expected_build(picked)
