"""Builds fxfuse._C, the C++ operator library. Everything else lives in pyproject.toml.

Environment:
  FXFUSE_CUDA=1   also compile the CUDA registration with nvcc (compile-only where no GPU)
  FXFUSE_DEBUG=1  build without optimisation, with debug symbols
"""
import glob
import os

from setuptools import setup


def _cuda_home_for_nvcc_wrapper():
    """torch derives CUDA_HOME from `which nvcc` when it is not set; an nvcc on PATH that
    is a wrapper script (here /usr/local/bin/nvcc, which execs /usr/local/cuda-13.0/bin/nvcc)
    gives a CUDA_HOME without the CUDA headers. Point it at /usr/local/cuda in that case."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    import shutil

    nvcc = shutil.which("nvcc")
    home = os.path.dirname(os.path.dirname(os.path.realpath(nvcc))) if nvcc else None
    if not (home and os.path.isfile(os.path.join(home, "include", "cuda_runtime.h"))):
        if os.path.isfile("/usr/local/cuda/include/cuda_runtime.h"):
            os.environ["CUDA_HOME"] = "/usr/local/cuda"


if os.environ.get("FXFUSE_CUDA") == "1":
    _cuda_home_for_nvcc_wrapper()

from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join("fxfuse", "csrc")


def sources(pattern):
    return sorted(glob.glob(os.path.join(CSRC, pattern), recursive=True))


def extension():
    debug = os.environ.get("FXFUSE_DEBUG") == "1"
    cxx = ["-O0", "-g"] if debug else ["-O3"]
    cxx += ["-fopenmp", "-Wno-unused-function"]
    # No fusing of a * b + c into an FMA behind the source's back: the hand-written CPU
    # kernels (csrc/cpu/) round like the ATen ops they reproduce. Their AVX2 builds
    # enable AVX2/FMA per function (#pragma GCC target in cpu/*_avx2.cpp, picked at
    # run time), so no -mavx2 here: the extension still loads on x86-64 CPUs without AVX2.
    cxx += ["-ffp-contract=off"]
    srcs = sources("*.cpp") + sources("generic/*.cpp") + sources("cpu/*.cpp") + sources("autocast/*.cpp")
    if os.environ.get("FXFUSE_CUDA") == "1":
        return CUDAExtension(
            "fxfuse._C",
            srcs + sources("cuda/*.cu"),
            define_macros=[("FXFUSE_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3"]},
            extra_link_args=["-fopenmp"],
        )
    return CppExtension("fxfuse._C", srcs, extra_compile_args={"cxx": cxx}, extra_link_args=["-fopenmp"])


setup(ext_modules=[extension()], cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)})
