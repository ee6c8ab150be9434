#!/usr/bin/env bash
# int8-input prefill scans on a GPU machine, in one call (a few minutes on one H100): the GPU tests of the int8-input
# SSD / selective-scan kernels and of the float scans they share their code with; then benchmarks/bench_quant_scan.py (Mamba2-2.7B SSD and Mamba-2.8B scan layers, batch 1 / 4, length
# 2048 / 8192: float vs int8-input vs dequantize + float). Usage (repo root): bash benchmarks/device_quant_scan.sh
# [STEPS]; STEPS: comma list of tests,bench (default both). Logs and quant_scan.json go to $OUT.
set -uo pipefail
steps=${1:-tests,bench}
out=${OUT:-out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$out/gpu.txt"
rc=0
if [[ $steps == *tests* ]]; then
  timeout 300 python3 -m pytest -q -m gpu tests/test_quant_scan_kernels.py tests/test_kernels.py \
    -k "quant or prefill or ssd or chunk or selective_scan" --maxfail=5 2>&1 \
    | tail -25 | tee "$out/quant_scan_gpu_tests.log" || rc=1
fi
if [[ $steps == *bench* ]]; then
  timeout 240 python3 benchmarks/bench_quant_scan.py --out "$out" 2>&1 | tee "$out/quant_scan_bench.log" || rc=1
fi
exit $rc
