#!/usr/bin/env bash
# Everything a GPU run of fxfuse needs: `make gpu-check` or tools/gpu_check.sh [OUT] [PHASE...].
# Phases (default: all, in this order): build tests exact autocast kernels step bench.
# Each phase logs to OUT/PHASE.log; JSON tables land in OUT too. A CPU-only machine stops at once.
set -uo pipefail
OUT=${1:-gpu-check-out}
shift || true
PHASES=${*:-build tests exact autocast kernels step bench}
PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu-check: no CUDA GPU here (torch.cuda.is_available() is False): nothing to check on this machine"
  exit 2
fi
mkdir -p "$OUT"
status=0
for phase in $PHASES; do
  start=$(date +%s)
  case $phase in
    build) FXFUSE_CUDA=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16} \
             "$PY" setup.py build_ext --inplace >"$OUT/build.log" 2>&1 ;;
    tests) "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py >"$OUT/tests.log" 2>&1 ;;
    bench) "$PY" -m fxfuse bench torchvision:resnet50 --input-shape 64,3,224,224 --device cuda --modes memory \
             --budget 0.5 --repeats 10 --fit-cap 16GiB --fit-by measured --json >"$OUT/bench.json" 2>"$OUT/bench.log" ;;
    *) "$PY" tools/gpu_check.py "$phase" --out "$OUT" >"$OUT/$phase.log" 2>&1 ;;
  esac
  rc=$?
  echo "gpu-check: $phase rc=$rc ($(($(date +%s) - start)) s)"
  tail -n 4 "$OUT/$phase.log" 2>/dev/null | sed 's/^/    /'
  [ $rc -eq 0 ] || status=1
done
exit $status
