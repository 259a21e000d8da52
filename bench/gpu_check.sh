#!/usr/bin/env bash
# One-command CUDA validation (`make gpu-check`) for a machine with torch, triton and transformers
# preinstalled and no network: installs leankit without dependencies, runs the `cuda` tests
# (kernels against their references at real sizes, kernel-backend LeanCache against the torch
# backend, host syncs of decode steps, a CUDA-graph replay, compiled decode variants per
# generation), then times the decode kernel and the prefill kernels with do_bench. Every step
# runs even when an earlier one fails; the exit status is non-zero when any failed. Results land
# in $GPU_RESULTS:
#   environment.txt   device, clocks and package versions
#   pytest.log        the cuda tests, with each sync count they print
#   decode_*.json/md  bench/decode_kernels.py tables (us, GB/s, fraction of copy bandwidth, x FP16, x SDPA)
#   kernels.log       the benchmark's full output (the ACT->KV table included)
#   prefill_*.json/md bench/prefill_kernels.py: prefill and significance pass against torch SDPA
#   gpu_step.json/md  bench/gpu_step.py: whole-model prefill and decode steps against DynamicCache
#                     (random-init models of SmolLM2's and Llama-3-8B's layer shapes), and decode
#                     tokens/s at a fixed KV budget
#   summary.txt       the verdict: "all passed", or the steps that failed
set -u
PY=${GPU_PY:-python3}
RES=${GPU_RESULTS:-results/gpu}
TEST_TIMEOUT=${GPU_TEST_TIMEOUT:-330}
BENCH_TIMEOUT=${GPU_BENCH_TIMEOUT:-150}
STEP_TIMEOUT=${GPU_STEP_TIMEOUT:-270}
# The whole check stays under 10 minutes: each step gets its own timeout or what is left of this
# budget, whichever is less (the steps' own timeouts add up to more, as caps for a slow machine),
# and a step reached with no time left is reported as failed, not silently skipped.
BUDGET=${GPU_CHECK_BUDGET:-570}
START=$SECONDS
cap() {  # cap STEP_SECONDS: the step's timeout within the budget (0 when none is left)
  local left=$(( BUDGET - (SECONDS - START) ))
  (( left < 0 )) && left=0
  echo $(( $1 < left ? $1 : left ))
}
# Without a visible GPU every cuda test skips (pytest passes) and the benchmarks print unmeasured
# tables and exit 0, writing "device: none" results over the measured ones: refuse to start
# instead of reporting "all passed". TRITON_INTERPRET=1 skips the tests the same way.
if ! $PY -c "import os, torch; assert torch.cuda.is_available() and os.environ.get('TRITON_INTERPRET') != '1'"; then
  echo "gpu-check: FAILED: $PY sees no CUDA GPU (or TRITON_INTERPRET=1 is set); nothing run" >&2
  exit 2
fi
mkdir -p "$RES"
failed=()

$PY -m pip install -q --no-deps --no-build-isolation -e . || { echo "install failed"; exit 1; }

{
  date -u +"%Y-%m-%d %H:%M UTC"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv 2>&1
  $PY - <<'PY'
import torch, triton, transformers
p = torch.cuda.get_device_properties(0)
print(f"{p.name}: {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB, cc {p.major}.{p.minor}")
print(f"torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}")
PY
} 2>&1 | tee "$RES/environment.txt"

workers=()
if $PY -c "import xdist" 2>/dev/null; then
  workers=(-n "${GPU_TEST_WORKERS:-4}")  # compiles dominate: run them on several cores
fi
if $PY -c "import pytest_timeout" 2>/dev/null; then
  workers+=(--timeout "${GPU_TEST_EACH_TIMEOUT:-150}")  # one stuck test fails alone, with its traceback
fi
set -o pipefail
step() {  # step NAME SECONDS LOG COMMAND...: COMMAND under its timeout within the budget, output added to LOG
  local name=$1 t log=$3
  t=$(cap "$2")
  shift 3
  if (( t == 0 )); then
    failed+=("$name: no time left")
    return
  fi
  timeout "$t" "$@" 2>&1 | tee -a "$log" || failed+=("$name")
}

: > "$RES/pytest.log"
step "cuda tests" "$TEST_TIMEOUT" "$RES/pytest.log" $PY -m pytest -q -p no:cacheprovider -m cuda -rA --durations=8 \
  "${workers[@]}" tests/test_cuda_kernels.py

: > "$RES/gpu_step.log"
step "bench step" "$STEP_TIMEOUT" "$RES/gpu_step.log" $PY bench/gpu_step.py --steps 8 --out "$RES"

: > "$RES/kernels.log"
for shape in "64 3 3" "128 8 4"; do
  set -- $shape
  step "bench d$1" "$BENCH_TIMEOUT" "$RES/kernels.log" $PY bench/decode_kernels.py --head-dim "$1" --kv-heads "$2" \
    --group "$3" --out "$RES"
done

step "bench prefill" "$BENCH_TIMEOUT" "$RES/kernels.log" $PY bench/prefill_kernels.py --head-dim 128 --kv-heads 8 \
  --group 4 --batch 4 --prompts 1024 4096 --out "$RES"

# The verdict is kept with the results (summary.txt), so a results folder says whether its run passed.
if [ ${#failed[@]} -gt 0 ]; then
  msg=$(printf '%s; ' "${failed[@]}")
  echo "gpu-check: FAILED: ${msg%; }" | tee "$RES/summary.txt"
  exit 1
fi
echo "gpu-check: all passed; results in $RES" | tee "$RES/summary.txt"
