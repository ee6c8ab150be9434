#!/usr/bin/env bash
# KVQuant on a GPU machine, in one call (< 400 s on one H100): the GPU tests of the quantized-KV decode kernels (vs
# their CPU references, and a tiny hybrid decoding through them), then the kernel benchmark (FP16 attention decode,
# ours and torch SDPA, vs the LUT kernels; 32 q / 8 kv heads x 128; 4K..128K tokens; batch 1 and 8).
# Usage (on the GPU machine, repo root): bash benchmarks/device_kvquant.sh [LENGTHS]   Logs, JSON and PNG go to $OUT.
# KV_CFG=BLOCK_T=32,num_warps=4 (say) overrides kernels.kv_decode.CFG for the benchmark (bench_kvquant.py --cfg).
set -uo pipefail
lengths=${1:-4096,8192,16384,32768,65536,131072}
out=${OUT:-out}
mkdir -p "$out"
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
rc=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$out/kvquant_gpu.txt"
timeout 120 python3 -m pytest -q -m gpu tests/test_kvquant_kernels.py 2>&1 | tail -15 | tee "$out/kvquant_gpu_tests.log" || rc=1
timeout 130 python3 benchmarks/bench_kvquant.py --out "$out" --lengths "$lengths" --batch 1 ${KV_CFG:+--cfg "$KV_CFG"} 2>&1 \
  | tee "$out/kvquant_bench_b1.log" || rc=1
timeout 130 python3 benchmarks/bench_kvquant.py --out "$out" --lengths "$lengths" --batch 8 ${KV_CFG:+--cfg "$KV_CFG"} 2>&1 \
  | tee "$out/kvquant_bench_b8.log" || rc=1
exit $rc
