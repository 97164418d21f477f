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
