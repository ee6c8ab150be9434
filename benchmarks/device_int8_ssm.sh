#!/usr/bin/env bash
# int8 SSM decode kernels on a GPU machine, in one call (under 500 s on one H100): the GPU tests of the int8 conv /
# state-update kernels and of the int8 decode path, the state-update micro-benchmark (int8 state vs our FP16 kernel
# vs mamba_ssm's, Mamba2-2.7B layer, batch 1 / 32 / 128 / 256, with bytes-moved limits; a BP x warps sweep of the
# int8 kernel at batch 128 / 256), then Mamba2-2.7B TPOT at batch 1 / 32 / 128 (random weights): FP16 vs Quamba2
# W8A8 with the int8 state, on the int8 kernels and on the earlier fake-quant path. The mamba_ssm peer is taken from .carry/ or shared/peers/ when one travels.
# Usage (repo root): bash benchmarks/device_int8_ssm.sh [STEPS]; STEPS: comma list of tests,micro,e2e (default all).
# Logs, int8_ssm.json and int8_ssm.png go to $OUT.
set -uo pipefail
steps=${1:-tests,micro,e2e}
out=${OUT:-out}
mkdir -p "$out"
source benchmarks/peer_env.sh
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$out/gpu.txt"
rc=0
if [[ $steps == *tests* ]]; then
  timeout 130 python3 -m pytest -q -m gpu tests/test_int8_ssm_kernels.py tests/test_int8_decode.py --maxfail=5 2>&1 \
    | tail -25 | tee "$out/int8_gpu_tests.log" || rc=1
fi
if [[ $steps == *micro* ]]; then
  timeout 120 python3 benchmarks/bench_int8_ssm.py --sweep 128,256 --out "$out" 2>&1 | tee "$out/int8_micro.log" || rc=1
fi
if [[ $steps == *e2e* ]]; then
  # keeps the micro table of the step above: the JSON is written by one run, so e2e goes to its own folder
  timeout 230 python3 benchmarks/bench_int8_ssm.py --no-micro --e2e --out "$out/e2e" 2>&1 \
    | grep -v "it/s\]\|s/it\]" | tee "$out/int8_e2e.log" || rc=1
fi
exit $rc
