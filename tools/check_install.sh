#!/usr/bin/env bash
# Installs fxfuse as a user with their own torch would, into a fresh venv, and checks it:
# the wheel carries fxfuse/_C*.so, the installed package imports it, and the demo runs
# from outside the checkout. Prints the wall time of the wheel build (the C++ compile; with the
# CUDA kernels when torch has CUDA and nvcc is found, unless FXFUSE_CUDA=0).
# Usage: tools/check_install.sh [WORKDIR]   (make install-check)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# A WORKDIR given is kept; a temporary one (a ~6 GB venv) is removed however the check ends.
if [ $# -ge 1 ]; then
  work=$1
else
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
fi
python3 -m venv "$work/venv"
py=$work/venv/bin/python
# torch first: the extension must be compiled against the torch that will run it.
"$py" -m pip install --quiet torch==2.14.1 torchvision==0.29.1 "setuptools>=77" wheel ninja
start=$(date +%s)
"$py" -m pip wheel --quiet --no-build-isolation --no-deps --wheel-dir "$work/dist" "$root"
echo "wheel build: $(( $(date +%s) - start )) s"
wheel=$(ls "$work"/dist/fxfuse-*.whl)
# One process reads the listing: `python -m zipfile -l | grep -q` under pipefail failed whenever
# grep exited at its first match and zipfile died of the broken pipe.
"$py" -c '
import fnmatch, sys, zipfile
found = fnmatch.filter(zipfile.ZipFile(sys.argv[1]).namelist(), "fxfuse/_C*.so")
if not found:
    sys.exit(f"no fxfuse/_C*.so in {sys.argv[1]}")
print("wheel carries", *found)
' "$wheel"
"$py" -m pip install --quiet "$wheel"
cd "$work"
"$py" -c "
import fxfuse, fxfuse._C, fxfuse._build_info as b, fxfuse._extension as e
assert e.loaded()
print('fxfuse', fxfuse.__version__, 'from', fxfuse.__file__, 'built against torch', e.built_against())
print('CUDA kernels:', 'on' if b.WITH_CUDA else 'off', f'({b.CUDA_REASON})')
"
"$py" "$root/examples/resnet_demo.py"
echo "install check passed"
