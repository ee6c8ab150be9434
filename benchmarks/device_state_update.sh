#!/usr/bin/env bash
# The state update on a GPU machine, in one call: its GPU tests against the CPU references, the STEP_CFG sweep
# (batches 32 and 128, Mamba2-2.7B's layer), old (BASELINE: another state_update.py) vs new at Mamba2-2.7B's and
# 8B's layers, batches 32-256, and (e2e in STEPS) Mamba2-2.7B TPOT FP16 and FP16 + int8 state, old and new.
# Usage (repo root): BASELINE=path/to/state_update.py bash benchmarks/device_state_update.sh [STEPS]
# STEPS: comma list of tests,sweep,micro,e2e (default tests,sweep,micro). Logs and JSON go to $OUT.
set -uo pipefail
steps=${1:-tests,sweep,micro}
out=${OUT:-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$out/gpu.txt"
rc=0
if [[ $steps == *tests* ]]; then
  timeout 150 python3 -m pytest -q -m gpu tests/test_kernels.py -k "selective_state_update" --maxfail=5 2>&1 | tail -5 \
    | tee "$out/gpu_tests.log" || rc=1
  timeout 150 python3 -m pytest -q -m gpu tests/test_int8_ssm_kernels.py tests/test_replay_kernels.py \
    -k "state_update or several_tiles or requant or asked or reciprocal or replay" --maxfail=5 2>&1 | tail -8 \
    | tee -a "$out/gpu_tests.log" || rc=1
fi
if [[ $steps == *sweep* ]]; then
  timeout 150 python3 benchmarks/bench_state_update.py --skip-micro --sweep 32,128 --out "$out/sweep" 2>&1 \
    | tail -3 | tee "$out/sweep.log" || rc=1
fi
if [[ $steps == *micro* ]]; then
  timeout 120 python3 benchmarks/bench_state_update.py ${BASELINE:+--baseline "$BASELINE"} --out "$out" 2>&1 \
    | tee "$out/micro.log" | tail -30 || rc=1
fi
if [[ $steps == *e2e* ]]; then
  timeout 150 python3 benchmarks/bench_state_update.py --skip-micro --e2e 32,128,256 --out "$out/e2e_new" 2>&1 \
    | grep -v "it/s\]\|s/it\]" | tail -8 | tee "$out/e2e_new.log" || rc=1
  if [[ -n ${BASELINE_ROOT:-} ]]; then
    PYTHONPATH=$BASELINE_ROOT timeout 150 python3 benchmarks/bench_state_update.py --skip-micro --e2e 32,128,256 \
      --out "$out/e2e_old" 2>&1 | grep -v "it/s\]\|s/it\]" | tail -8 | tee "$out/e2e_old.log" || rc=1
  fi
fi
exit $rc
