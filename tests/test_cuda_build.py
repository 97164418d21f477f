"""setup.py's decision to compile the CUDA kernels (fxfuse/_cuda_build.py), on a faked environment,
and what the built extension says about itself."""

import subprocess
import sys

import pytest

from fxfuse import _cuda_build, _extension
from fxfuse._cuda_build import decide


def test_cuda_torch_and_a_matching_nvcc_build_the_kernels():
    d = decide({}, "13.0", "/usr/local/cuda/bin/nvcc", "13.0")
    assert d.cuda and "13.0" in d.reason


@pytest.mark.parametrize(
    "torch_cuda, nvcc, release, why",
    [
        (None, "/usr/local/cuda/bin/nvcc", "13.0", "torch has no CUDA"),
        ("13.0", None, None, "no nvcc was found"),
        ("12.8", "/usr/local/cuda/bin/nvcc", "13.0", "does not match"),
        ("13.0", "/usr/local/cuda/bin/nvcc", None, "does not match"),
    ],
)
def test_without_cuda_torch_or_a_matching_nvcc_the_build_is_cpu_only(torch_cuda, nvcc, release, why):
    d = decide({}, torch_cuda, nvcc, release)
    assert not d.cuda and why in d.reason


def test_fxfuse_cuda_forces_either_way():
    assert decide({"FXFUSE_CUDA": "1"}, None, None, None).cuda
    assert not decide({"FXFUSE_CUDA": "0"}, "13.0", "/usr/local/cuda/bin/nvcc", "13.0").cuda
    with pytest.raises(ValueError, match="FXFUSE_CUDA must be 0, 1 or unset"):
        decide({"FXFUSE_CUDA": "yes"}, "13.0", None, None)


def test_nvcc_is_found_under_cuda_home_first(tmp_path, monkeypatch):
    (tmp_path / "bin").mkdir()
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.4, V12.4.131'\n")
    nvcc.chmod(0o755)
    assert _cuda_build.find_nvcc({"CUDA_HOME": str(tmp_path)}) == str(nvcc)
    assert _cuda_build.release_of(str(nvcc)) == "12.4"
    assert _cuda_build.release_of(str(tmp_path / "missing")) is None


def test_the_extension_says_whether_it_has_cuda_kernels():
    text = _extension.summary()
    assert "fxfuse._C built against torch" in text
    assert ("with CUDA kernels" in text) == _extension.cuda_kernels()


def test_version_flag_prints_the_extension_summary():
    out = subprocess.run(
        [sys.executable, "-m", "fxfuse", "--version"], capture_output=True, text=True, check=True
    ).stdout
    assert out.startswith("fxfuse ") and "fxfuse._C built against torch" in out and out.count("\n") == 1


def test_without_a_gpu_or_an_arch_list_the_build_targets_torchs_own_architectures():
    flags = "sm_75 sm_80 sm_86 sm_90 sm_100 sm_120"
    assert _cuda_build.arch_list({}, False, flags) == "7.5;8.0;8.6;9.0;10.0;12.0+PTX"
    # the user's list, or torch's own pick for a visible GPU, wins
    assert _cuda_build.arch_list({"TORCH_CUDA_ARCH_LIST": "9.0"}, False, flags) is None
    assert _cuda_build.arch_list({}, True, flags) is None
    assert _cuda_build.arch_list({}, False, "") is None


_ARCH_FLAGS = """
import os, sys, torch
from torch.utils import cpp_extension
from fxfuse import _cuda_build
archs = _cuda_build.arch_list(os.environ, False, torch._C._cuda_getArchFlags())
if archs and sys.argv[1] == "fxfuse":
    os.environ["TORCH_CUDA_ARCH_LIST"] = archs
try:
    print(" ".join(cpp_extension._get_cuda_arch_flags()))
except IndexError:
    print("IndexError")
"""


@pytest.mark.parametrize("who", ["torch", "fxfuse"])
def test_torch_needs_the_arch_list_on_a_machine_without_a_gpu(who):
    """What setup.py fixes: torch's CUDA flags for a build host without a GPU and without
    TORCH_CUDA_ARCH_LIST (a plain `pip install` there died with IndexError)."""
    import torch

    if not torch.version.cuda or torch.cuda.is_available():
        pytest.skip("needs a CUDA torch on a machine without a GPU")
    env = {k: v for k, v in __import__("os").environ.items() if k != "TORCH_CUDA_ARCH_LIST"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    out = subprocess.run(
        [sys.executable, "-c", _ARCH_FLAGS, who], capture_output=True, text=True, env=env, check=True
    ).stdout.strip()
    if who == "torch":
        assert out == "IndexError"
    else:
        assert "arch=compute_90,code=sm_90" in out and "code=compute_" in out, out
