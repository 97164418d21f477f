"""The op-level tests under every CPU capability ATen can pick on this CPU.

ATen picks its CPU kernels (DEFAULT, AVX2, AVX512) at start-up, and
ATEN_CPU_CAPABILITY lowers the choice; fxfuse's hand-written kernels follow it
(baseline build for DEFAULT, AVX2 build otherwise). The main pytest run covers the
capability this process got; this test reruns the op-level files in a subprocess for
each other capability the CPU supports, so an AVX2 machine also exercises DEFAULT and
an AVX-512 machine all three (`make test` only DEFAULT, `make zoo` the others). A
capability whose eager ATen ops die on a signal here (CPUID bits the OS has not enabled:
tests/support/cpu_probe.py) is skipped with the reason.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from support import cpu_probe

from fxfuse import _extension

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OP_TESTS = [
    "test_cpu_kernels.py",
    "test_ops_gelu.py",
    "test_ops_linear_act.py",
    "test_ops_act_linear.py",
    "test_ops_conv_act.py",
    "test_bn_act_elementwise.py",
    "test_bn_bitwise.py",
    "test_ops_conv2d.py",
]
# `make test` reruns them under DEFAULT (fxfuse's baseline kernel build, ATen's baseline kernels), which
# every CPU has. AVX2 and AVX-512 run fxfuse's AVX2 build: the main run already covers one of them, and on
# an AVX2 machine AVX-512 is skipped anyway, so the rerun under the other one runs in `make zoo`.
CAPABILITIES = ["default", pytest.param("avx2", marks=pytest.mark.zoo), pytest.param("avx512", marks=pytest.mark.zoo)]

pytestmark = [
    pytest.mark.skipif(not _extension.loaded(), reason="fxfuse._C is not built"),
    pytest.mark.skipif(
        os.environ.get("FXFUSE_CAPABILITY_RUN") is not None, reason="already inside a per-capability run"
    ),
]


def _env(capability):
    env = dict(cpu_probe.env_for(capability), FXFUSE_CAPABILITY_RUN=capability)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    return env


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_op_tests_under_capability(capability):
    # ATen falls back to what the CPU has when it lacks the capability asked for.
    picked = cpu_probe.skip_unless_runs(capability).picked
    if picked != capability.upper():
        pytest.skip(f"this CPU cannot run ATen's {capability} kernels (ATen picks {picked})")
    if picked == torch.backends.cpu.get_cpu_capability():
        pytest.skip(f"{picked} is this run's own capability: the op tests already ran under it")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-x",
            "-p",
            "no:cacheprovider",
            *[os.path.join(HERE, f) for f in OP_TESTS],
        ],
        env=_env(capability),
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, (
        f"op tests failed under ATEN_CPU_CAPABILITY={capability}:\n" + proc.stdout[-6000:] + proc.stderr[-2000:]
    )
