#!/usr/bin/env bash
# Everything a GPU run of fxfuse needs: `make gpu-check` or tools/gpu_check.sh [OUT] [PHASE[:SECONDS]...].
# Phases (default: all, in this order), each one command of under 10 minutes on an H100:
#   build         the extension with its CUDA kernels (FXFUSE_CUDA=1)
#   env           device, driver, CUDA / cuDNN, peak memory bandwidth, whether the CUDA kernels registered
#   tests         tests/test_cuda.py: every op family vs eager CUDA, shapes up to > 2^31 elements,
#                 every output mask, channels_last, training step, autocast, timing, fit
#   exact         float64 assert_equivalent on resnet50, efficientnet_b0, convnext_tiny, vit_b_16 (+ timm)
#   autocast      bf16 and fp16 autocast training gradients vs eager autocast, both vs float64
#   kernels       GB/s of the CUDA bn_act kernels against the device's bandwidth and a copy
#   step          ResNet-50 / EfficientNet-B0 batch 64 train steps, fp32 and bf16 AMP: saved, peak, time
#   profile       where a ResNet-50 bf16 step's time goes: wall vs GPU busy time, top ops by GPU and CPU time
#   speed         issue 54: eager, fxfuse, torch.compile steps, bf16 batch 128 / fp32 batch 64: saved, peak,
#                 time, launches and host enqueue time per step (speed.json)
#   frontier      issue 55: fxfuse's budgets eager and compiled against compile's activation_memory_budget
#                 and checkpoint, bf16 batch 128, three models (frontier.json, frontier.svg)
#   fit           largest batch within a 16 GiB cap and time per sample, eager vs fxfuse, fp32 and bf16 AMP
#   bench         fxfuse bench --device cuda --fit-cap: ResNet-50 batch 64 fp32
#   bench-effnet  the same for EfficientNet-B0
# speed, frontier and fit are time-boxed: PHASE:SECONDS sets the phase's budget (default 450), which
# it spends in priority order, writing its JSON after every row; a timeout stops it 90 s past it.
# GPU_CHECK_SECONDS caps the whole run: each time-boxed phase gets at most what is left of it (less 20 s),
# every phase is stopped 5 s before it runs out, and a phase that would start with under 30 s left
# (a time-boxed one: with a budget under 30 s) is skipped. GPU_CHECK_ARGS_<phase> adds arguments to a
# time-boxed phase (GPU_CHECK_ARGS_fit="--cap-gib 8"); GPU_CHECK_DRY_RUN=1 runs speed, frontier and fit on the CPU with tiny models
# (--dry-run) and skips the rest, to try the driver without a GPU.
# Each phase logs to OUT/PHASE.log; its tables land in OUT as JSON and markdown (the README's GPU
# tables). A CPU-only machine stops at once with one line.
set -uo pipefail
OUT=${1:-gpu-check-out}
shift || true
PHASES=${*:-build env tests exact autocast kernels step profile speed frontier fit bench bench-effnet}
PY=${PYTHON:-python3}
DRY=${GPU_CHECK_DRY_RUN:-0}
# The phases run tools/gpu_check.py, whose sys.path starts at tools/: fxfuse comes from the checkout
# (the build phase builds it in place), also where it is not installed.
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if [ "$DRY" != 1 ] && ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu-check: no CUDA GPU here (torch.cuda.is_available() is False): nothing to check on this machine"
  exit 2
fi
mkdir -p "$OUT"
END=$(($(date +%s) + ${GPU_CHECK_SECONDS:-86400}))
status=0
for item in $PHASES; do
  phase=${item%%:*}
  budget=450
  [ "$item" != "$phase" ] && budget=${item#*:}
  start=$(date +%s)
  left=$((END - start))
  if [ "$left" -lt 30 ]; then
    echo "gpu-check: $phase skipped: ${left} s left of GPU_CHECK_SECONDS"
    continue
  fi
  case $phase in
    speed | frontier | fit)
      [ $((left - 20)) -lt "$budget" ] && budget=$((left - 20))
      if [ "$budget" -lt 30 ]; then
        echo "gpu-check: $phase skipped: ${left} s left of GPU_CHECK_SECONDS"
        continue
      fi ;;
    *)
      if [ "$DRY" = 1 ]; then
        echo "gpu-check: $phase skipped: a dry run runs speed, frontier and fit only"
        continue
      fi ;;
  esac
  # every phase ends 5 s before GPU_CHECK_SECONDS run out, so that a command after the driver (packing
  # OUT) still runs; a time-boxed phase also 90 s past its own budget
  limit=$((left - 5))
  case $phase in speed | frontier | fit) [ "$limit" -gt $((budget + 90)) ] && limit=$((budget + 90)) ;; esac
  run=(timeout -k 5 "$limit" "$PY")
  dry=()
  [ "$DRY" = 1 ] && dry=(--dry-run)
  extra=GPU_CHECK_ARGS_$phase
  extra=${extra//-/_}
  case $phase in
    build) FXFUSE_CUDA=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16} \
             "${run[@]}" setup.py build_ext --inplace >"$OUT/build.log" 2>&1 ;;
    tests) "${run[@]}" -m pytest -q -p no:cacheprovider -rs tests/test_cuda.py >"$OUT/tests.log" 2>&1 ;;
    bench) "${run[@]}" -m fxfuse bench torchvision:resnet50 --input-shape 64,3,224,224 --device cuda --modes memory \
             --budget 0.5 --repeats 10 --fit-cap 16GiB --fit-by measured --json >"$OUT/bench.json" 2>"$OUT/bench.log" ;;
    bench-effnet) "${run[@]}" -m fxfuse bench torchvision:efficientnet_b0 --input-shape 64,3,224,224 --device cuda \
             --modes memory --budget 0.5 --repeats 10 --fit-cap 16GiB --fit-by measured --json \
             >"$OUT/bench-effnet.json" 2>"$OUT/bench-effnet.log" ;;
    # shellcheck disable=SC2086  # the extra arguments are a list
    speed | frontier | fit) "${run[@]}" tools/gpu_check.py "$phase" --out "$OUT" \
             --budget-s "$budget" "${dry[@]}" ${!extra:-} >"$OUT/$phase.log" 2>&1 ;;
    *) "${run[@]}" tools/gpu_check.py "$phase" --out "$OUT" >"$OUT/$phase.log" 2>&1 ;;
  esac
  rc=$?
  echo "gpu-check: $phase rc=$rc ($(($(date +%s) - start)) s)"
  tail -n 4 "$OUT/$phase.log" 2>/dev/null | sed 's/^/    /'
  [ $rc -eq 0 ] || status=1
done
exit $status
