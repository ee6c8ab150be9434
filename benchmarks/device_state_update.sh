#!/usr/bin/env bash
# The state update on a GPU machine, in one call: its GPU tests against the CPU references, the STEP_CFG sweep at
# batch 128 (Mamba2-2.7B's layer) whose selection the rest then runs with, old (BASELINE: another state_update.py)
# vs new at Mamba2-2.7B's and 8B's layers, batches 32-256, and Mamba2-2.7B TPOT FP16 and FP16 + int8 state (new;
# BASELINE_ROOT: also another checkout's, on PYTHONPATH).
# Usage (repo root): BASELINE=... [BASELINE_ROOT=...] bash benchmarks/device_state_update.sh [STEPS]
# STEPS: comma list of tests,micro,e2e (default all). Logs and JSON go to $OUT.
set -uo pipefail
steps=${1:-tests,micro,e2e}
out=${OUT:-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
rc=0
if [[ $steps == *tests* ]]; then
  timeout 100 python3 -m pytest -q -m gpu tests/test_kernels.py tests/test_int8_ssm_kernels.py --maxfail=5 \
    -k "selective_state_update_mamba2 or quant_state_update_equals or several_tiles or asked or requant" 2>&1 \
    | tail -6 | tee "$out/gpu_tests.log" || rc=1
fi
if [[ $steps == *micro* ]]; then
  timeout 150 python3 benchmarks/bench_state_update.py --sweep 128 --tune ${BASELINE:+--baseline "$BASELINE"} \
    --out "$out" 2>&1 | tee "$out/micro.log" | grep -v '^{' | tail -28 || rc=1
fi
if [[ $steps == *e2e* ]]; then
  cfg=(); [[ -f $out/step_cfg.json ]] && cfg=(--step-cfg "$out/step_cfg.json")
  timeout 90 python3 benchmarks/bench_state_update.py --skip-micro "${cfg[@]}" --e2e 32,128,256 --out "$out/e2e_new" \
    2>&1 | grep -v "it/s\]\|s/it\]" | tail -7 || rc=1
  if [[ -n ${BASELINE_ROOT:-} ]]; then
    PYTHONPATH=$BASELINE_ROOT timeout 90 python3 benchmarks/bench_state_update.py --skip-micro --e2e 32,128,256 \
      --out "$out/e2e_old" 2>&1 | grep -v "it/s\]\|s/it\]" | tail -7 || rc=1
  fi
fi
exit $rc
