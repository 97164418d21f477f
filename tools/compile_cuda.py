"""Compile-only check of fxfuse's CUDA sources (csrc/cuda/*.cu) with nvcc: `make cuda-check`.

Runs nvcc -c on each .cu file with the flags torch's CUDAExtension uses, into
build/cuda-check/, for one GPU architecture (CUDA_CHECK_ARCH, default 9.0). Needs nvcc
but no GPU, and leaves fxfuse/_C*.so alone. `make cuda-build` does the full
FXFUSE_CUDA=1 build and checks that its kernels register (tools/check_cuda_build.py).
"""

import glob
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor

from torch.utils import cpp_extension


def nvcc_path() -> str:
    home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    candidate = os.path.join(home, "bin", "nvcc")
    return (
        candidate
        if os.path.exists(candidate)
        else (shutil.which("nvcc") or sys.exit("cuda-check: nvcc not found (set CUDA_HOME or put nvcc on PATH)"))
    )


def main() -> int:
    arch = os.environ.get("CUDA_CHECK_ARCH", "9.0").replace(".", "")
    home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    out_dir = os.path.join("build", "cuda-check")
    os.makedirs(out_dir, exist_ok=True)
    includes = [
        *cpp_extension.include_paths("cuda"),
        os.path.join(home, "include"),
        sysconfig.get_paths()["include"],
        os.path.join("fxfuse", "csrc"),
    ]
    flags = [
        *cpp_extension.COMMON_NVCC_FLAGS,
        "-O3",
        "-std=c++20",
        f"-gencode=arch=compute_{arch},code=sm_{arch}",
        "--compiler-options",
        "-fPIC",
        "-DFXFUSE_WITH_CUDA=1",
        "-DTORCH_EXTENSION_NAME=_C",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        "-D_GLIBCXX_USE_CXX11_ABI=1",
    ]
    sources = sorted(glob.glob(os.path.join("fxfuse", "csrc", "cuda", "*.cu")))
    if not sources:
        sys.exit("cuda-check: no fxfuse/csrc/cuda/*.cu sources")

    stale = []
    for src in sources:
        obj = os.path.join(out_dir, os.path.basename(src) + ".o")
        deps = [
            src,
            *glob.glob(os.path.join("fxfuse", "csrc", "**", "*.h"), recursive=True),
            *glob.glob(os.path.join("fxfuse", "csrc", "cuda", "*.cuh")),
        ]
        if os.path.exists(obj) and os.path.getmtime(obj) >= max(os.path.getmtime(d) for d in deps):
            print(f"cuda-check: {src} up to date")
        else:
            stale.append((src, obj))

    def compile_one(job):
        src, obj = job
        start = time.time()
        cmd = [nvcc_path(), "-c", src, "-o", obj, *flags, *(f"-I{p}" for p in includes)]
        run = subprocess.run(cmd, capture_output=True, text=True)
        return src, run, time.time() - start

    # One nvcc per core at once (CUDA_CHECK_JOBS to change): each is a single-threaded host compile
    # of torch's headers.
    jobs = int(os.environ.get("CUDA_CHECK_JOBS") or os.cpu_count() or 1)
    failed = False
    with ThreadPoolExecutor(max(1, min(jobs, len(stale) or 1))) as pool:
        for src, run, seconds in pool.map(compile_one, stale):
            sys.stdout.write(run.stdout)
            sys.stderr.write(run.stderr)
            if run.returncode != 0:
                print(f"cuda-check: nvcc failed on {src}", file=sys.stderr)
                failed = True
            else:
                print(f"cuda-check: compiled {src} for sm_{arch} ({seconds:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
