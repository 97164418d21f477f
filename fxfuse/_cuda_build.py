"""Whether setup.py compiles fxfuse's CUDA kernels: one pure decision, testable without a GPU.

setup.py loads this file by path (importing the fxfuse package would need the extension it is
about to build), so it imports nothing from fxfuse and nothing heavy at module level.

FXFUSE_CUDA=1 forces the CUDA build and FXFUSE_CUDA=0 forbids it. Unset, the kernels are built
when the torch being built against has CUDA and an nvcc of the same CUDA major version is found.
A GPU is not needed: the kernels compile without one.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Mapping, Optional


@dataclass(frozen=True)
class Decision:
    cuda: bool
    reason: str


def decide(
    env: Mapping[str, str], torch_cuda: Optional[str], nvcc: Optional[str], nvcc_release: Optional[str]
) -> Decision:
    """`torch_cuda`: torch.version.cuda; `nvcc`: the nvcc found (None: none); `nvcc_release`: its
    version, e.g. '13.0'."""
    forced = env.get("FXFUSE_CUDA", "").strip()
    if forced not in ("", "0", "1"):
        raise ValueError(f"FXFUSE_CUDA must be 0, 1 or unset, got {forced!r}")
    if forced == "0":
        return Decision(False, "FXFUSE_CUDA=0")
    if forced == "1":
        return Decision(True, "FXFUSE_CUDA=1")
    if not torch_cuda:
        return Decision(False, "torch has no CUDA")
    if nvcc is None:
        return Decision(False, f"torch has CUDA {torch_cuda} but no nvcc was found (set CUDA_HOME)")
    if not nvcc_release or nvcc_release.split(".")[0] != torch_cuda.split(".")[0]:
        return Decision(False, f"nvcc {nvcc_release or '?'} does not match torch's CUDA {torch_cuda}")
    return Decision(True, f"torch CUDA {torch_cuda}, nvcc {nvcc_release} ({nvcc})")


def arch_list(env: Mapping[str, str], gpu_visible: bool, torch_arch_flags: str) -> Optional[str]:
    """The TORCH_CUDA_ARCH_LIST to build for, or None to leave torch's choice.

    torch compiles for the visible GPUs, or for TORCH_CUDA_ARCH_LIST when set. With neither (a
    build host or container without a GPU) its arch list comes out empty and the build dies with
    an IndexError, so fxfuse builds for the architectures torch itself was built for
    (`torch._C._cuda_getArchFlags()`, e.g. 'sm_75 sm_80 sm_90'), PTX for the newest: the kernels
    then run wherever this torch runs."""
    if env.get("TORCH_CUDA_ARCH_LIST", "").strip() or gpu_visible:
        return None
    archs = sorted({int(m) for m in re.findall(r"sm_(\d+)", torch_arch_flags)})
    if not archs:
        return None
    names = [f"{a // 10}.{a % 10}" for a in archs]
    return ";".join(names[:-1] + [names[-1] + "+PTX"])


def find_nvcc(env: Mapping[str, str]) -> Optional[str]:
    """The nvcc torch's CUDAExtension would use: CUDA_HOME/CUDA_PATH's, else the one on PATH."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = env.get(var)
        if home and os.path.isfile(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    default = "/usr/local/cuda/bin/nvcc"
    return default if os.path.isfile(default) else None


def release_of(nvcc: str) -> Optional[str]:
    """'13.0' from `nvcc --version`'s 'release 13.0, V13.0.48' (None when it does not run)."""
    try:
        text = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"release (\d+\.\d+)", text)
    return match.group(1) if match else None
