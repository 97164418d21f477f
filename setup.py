"""Builds fxfuse._C, the C++ operator library. Everything else lives in pyproject.toml.

Environment:
  FXFUSE_CUDA     unset: compile the CUDA kernels when torch has CUDA and a matching nvcc is
                  found (fxfuse/_cuda_build.py); 1: always (compile-only where no GPU); 0: never
  FXFUSE_DEBUG=1  build without optimisation, with debug symbols
"""

import glob
import os
import re
import sys

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


def _cuda_decision():
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("_cuda_build", os.path.join(HERE, "fxfuse", "_cuda_build.py"))
    build = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = build  # dataclasses look their module up there
    spec.loader.exec_module(build)
    nvcc = build.find_nvcc(os.environ)
    return build.decide(os.environ, torch.version.cuda, nvcc, build.release_of(nvcc) if nvcc else None)


HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join("fxfuse", "csrc")
# pip runs setup.py three times for `pip install -e .`: for the build requirements (egg_info), for
# the metadata (dist_info), then to build. The first two need no extension and skip importing torch
# (~3 CPU-seconds each). Option values that are paths do not count as commands.
_COMMANDS = {arg for arg in sys.argv[1:] if not arg.startswith("-") and os.sep not in arg}
METADATA_ONLY = bool(_COMMANDS) and _COMMANDS <= {"egg_info", "dist_info"}
if not METADATA_ONLY:
    CUDA = _cuda_decision()
    print(f"fxfuse: CUDA kernels {'on' if CUDA.cuda else 'off'} ({CUDA.reason})")
    if CUDA.cuda:
        _cuda_home_for_nvcc_wrapper()
        import torch

        _archs = sys.modules["_cuda_build"].arch_list(
            os.environ, torch.cuda.is_available(), getattr(torch._C, "_cuda_getArchFlags", lambda: "")()
        )
        if _archs:
            os.environ["TORCH_CUDA_ARCH_LIST"] = _archs
            print(
                "fxfuse: no GPU visible and TORCH_CUDA_ARCH_LIST unset: "
                f"building for torch's own architectures {_archs}"
            )

    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension


def sources(pattern):
    return sorted(glob.glob(os.path.join(CSRC, pattern), recursive=True))


# Translation units that compile several files together (csrc/*_unit.cpp): apart, each file spent
# most of its CPU time on the same torch headers and templates (a fresh CPU-only build, 14 units
# -> 4: ~190 -> ~125 CPU-seconds with the glue at -O1, ~135 at -O2). A file matching a unit's patterns is compiled
# by exactly one unit (the first unit listed that it matches names where it goes); a csrc/*.cpp or
# cpu/*.cpp file that no unit covers is compiled alone.
UNITS = {
    "autograd_unit.cpp": ["autograd/*.cpp", "autocast/*.cpp"],
    "generic_unit.cpp": ["generic/*.cpp", "module.cpp", "direct_calls.cpp"],
    "cpu_avx2_unit.cpp": ["cpu/*_avx2.cpp"],
    "cpu_unit.cpp": ["cpu/*.cpp"],
}
# The units of glue around ATen calls (registration, autograd Functions, argument checks, the
# Python fast path): -O2. -O1 compiled them in ~30% less time than -O3, but a fused call's host
# time against eager's layers read up to 8% worse with it (benchmarks/host_cost.py's sites, one
# loaded run: issue 54 is about that time); -O2 costs ~40% more than -O1 to compile. The CPU
# kernels keep -O3.
GLUE_UNITS = ("autograd_unit.cpp", "generic_unit.cpp")
GLUE_OPT = "-O2"


def _included_by_units():
    where: dict[str, list[str]] = {}
    for unit in UNITS:
        with open(os.path.join(CSRC, unit)) as f:
            for rel in re.findall(r'^#include "([^"]+)"', f.read(), re.MULTILINE):
                where.setdefault(rel, []).append(unit)
    return where


def check_units():
    """A file matching a unit's patterns that no unit includes would be built nowhere; one that two
    include would be built twice; one in another unit than the first that it matches, built with
    the wrong neighbours (an AVX2 file among the baseline ones)."""
    where = _included_by_units()
    home: dict[str, str] = {}
    for unit, patterns in UNITS.items():
        for path in (p for pattern in patterns for p in sources(pattern)):
            home.setdefault(os.path.relpath(path, CSRC).replace(os.sep, "/"), unit)
    for rel, unit in home.items():
        if rel not in where:
            sys.exit(f'setup.py: fxfuse/csrc/{rel} is not compiled: add #include "{rel}" to fxfuse/csrc/{unit}')
        if len(where[rel]) > 1:
            sys.exit(f"setup.py: fxfuse/csrc/{rel} is in {' and '.join(where[rel])}: keep it in one")
        if where[rel] != [unit]:
            sys.exit(f"setup.py: fxfuse/csrc/{rel} belongs in fxfuse/csrc/{unit}, not {where[rel][0]}")


def _with_glue_opt(write_ninja_file):
    """torch's BuildExtension gives every C++ file of an extension the same flags; this wraps its
    ninja file writer so that the glue units' compile commands end with GLUE_OPT (the last -O
    wins)."""

    def write(path, *args, **kwargs):
        write_ninja_file(path, *args, **kwargs)
        with open(path) as f:
            lines = f.read().splitlines()
        out = []
        for line in lines:
            out.append(line)
            m = re.fullmatch(r"build (.+): compile (.+)", line)
            if m and m.group(2).replace("$ ", " ").endswith(tuple(f"{os.sep}{u}" for u in GLUE_UNITS)):
                out.append(f"  post_cflags = $post_cflags {GLUE_OPT}")
        with open(path, "w") as f:
            f.write("\n".join(out) + "\n")

    return write


def extension():
    check_units()
    debug = os.environ.get("FXFUSE_DEBUG") == "1"
    # -g0: Python's default CFLAGS carry -g, and debug info for these template-heavy kernels
    # costs ~40% of the compile time and 35 MB of the .so (FXFUSE_DEBUG=1 keeps it).
    cxx = ["-O0", "-g"] if debug else ["-O3", "-g0"]
    cxx += ["-fopenmp", "-Wno-unused-function"]
    # A switch over Act (csrc/act.h) that misses an activation fails the build: adding one
    # to FXFUSE_ACTIVATIONS then names every kernel that must handle it.
    cxx += ["-Werror=switch"]
    # No fusing of a * b + c into an FMA behind the source's back: the hand-written CPU
    # kernels (csrc/cpu/) round like the ATen ops they reproduce. Their AVX2 builds
    # enable AVX2/FMA per function (#pragma GCC target in cpu/*_avx2.cpp, picked at
    # run time), so no -mavx2 here: the extension still loads on x86-64 CPUs without AVX2.
    cxx += ["-ffp-contract=off"]
    included = _included_by_units()
    srcs = [
        p
        for p in sources("*.cpp") + sources("cpu/*.cpp")
        if os.path.relpath(p, CSRC).replace(os.sep, "/") not in included
    ]
    if CUDA.cuda:
        return CUDAExtension(
            "fxfuse._C",
            srcs + sources("cuda/*.cu"),
            define_macros=[("FXFUSE_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3"]},
            extra_link_args=["-fopenmp"],
        )
    return CppExtension("fxfuse._C", srcs, extra_compile_args={"cxx": cxx}, extra_link_args=["-fopenmp"])


if not METADATA_ONLY:

    class BuildWithInfo(BuildExtension.with_options(use_ninja=True)):
        """Also records the torch the extension is compiled against (fxfuse/_build_info.py), so that a
        load failure in a process running another torch can say so. Compiles the glue units at
        GLUE_OPT (_with_glue_opt) where torch still writes its ninja file with _write_ninja_file; an
        FXFUSE_DEBUG=1 build keeps -O0 everywhere."""

        def build_extensions(self):
            import torch.utils.cpp_extension as cpp

            write = getattr(cpp, "_write_ninja_file", None)
            if write is None or os.environ.get("FXFUSE_DEBUG") == "1":
                return super().build_extensions()
            cpp._write_ninja_file = _with_glue_opt(write)
            try:
                return super().build_extensions()
            finally:
                cpp._write_ninja_file = write

        def run(self):
            import torch

            text = (
                f'"""Generated by setup.py when fxfuse._C was built."""\n'
                f'TORCH_VERSION = "{torch.__version__}"\n'
                f"WITH_CUDA = {CUDA.cuda!r}\n"
                f"CUDA_REASON = {CUDA.reason!r}\n"
            )
            targets = [os.path.join(HERE, "fxfuse")]
            if not self.inplace:
                targets.append(os.path.join(self.build_lib, "fxfuse"))
            for target in targets:
                os.makedirs(target, exist_ok=True)
                with open(os.path.join(target, "_build_info.py"), "w") as f:
                    f.write(text)
            super().run()


if METADATA_ONLY:
    setup()
else:
    setup(ext_modules=[extension()], cmdclass={"build_ext": BuildWithInfo})
