#!/usr/bin/env bash
# KVQuant on a GPU machine, each mode one device call (< 600 s on one H200; logs, JSON and PNG go to $OUT):
#   tests   the GPU tests of the warp kernel against its CPU reference (tests/test_kv_decode_warp.py, 267 tests,
#           ~400 s on the H200 in session 37: its reference cases, then the rest)
#   tests2  the Triton kernels and their outlier passes (tests/test_kvquant_kernels.py, ~200 s), the paged cache and
#           the model-level decode (~130 s)
#   bench   the kernel benchmark (FP16 attention decode, ours and torch SDPA, against the quantized formats; 32 q / 8
#           kv heads x 128) at batch 1 (4K..128K tokens, ~110 s) and batch 8 (32K, 128K, ~100 s), the README's runs
#   bench64 the same at head dim 64, SmolLM2-135M's heads (9 / 3, full RoPE) and our hybrid's (6 / 2, RoPE on 32),
#           and at Bamba-9B's partial RoPE (32 / 8 x 128, RoPE on 64): batch 1 (4K..128K), batch 8 (32K, 128K)
#   e2e64   a whole model's decode step (bench_kv_e2e.py, random weights) at SmolLM2-135M's config (30 attention
#           layers of 9 / 3 x 64) and Bamba-9B's (3 attention layers of 32 / 8 x 128 among 29 Mamba-2 layers)
# Usage (on the GPU machine, repo root): bash benchmarks/device_kvquant.sh tests|tests2|bench|bench64|e2e64
# KV_CFG=GP_MIN=8 (say) overrides kernels.kv_decode_fast.CFG for the benchmark (bench_kvquant.py --cfg).
set -uo pipefail
mode=${1:-tests}
case "$mode" in
  tests|tests2|bench|bench64|e2e64) ;;
  *) echo "device_kvquant.sh: unknown mode '$mode' (tests, tests2, bench, bench64 or e2e64)"; exit 2 ;;
esac
out=${OUT:-out}
mkdir -p "$out"
export PYTHONPATH=.:benchmarks:${PYTHONPATH:-} PYTHONUNBUFFERED=1
rc=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$out/kvquant_gpu.txt"
gpu_tests() {  # LIMIT NAME PYTEST-ARGS...: the GPU tests of PYTEST-ARGS, log $out/gpu_NAME.log
  local limit=$1 name=$2
  shift 2
  timeout "$limit" python3 -m pytest -q -m gpu -p no:cacheprovider "$@" > "$out/gpu_$name.log" 2>&1 || rc=1
  echo "$name: $(tail -1 "$out/gpu_$name.log")"
}
case "$mode" in
  tests)  # within one call's 600 s: the warp kernel's file in two parts, each its own limit
    ref=test_warp_kernel_equals_reference
    gpu_tests 280 warp_reference -k "$ref" tests/test_kv_decode_warp.py
    gpu_tests 200 warp_rest -k "not $ref" tests/test_kv_decode_warp.py ;;
  tests2)
    gpu_tests 260 kvquant_kernels tests/test_kvquant_kernels.py
    gpu_tests 200 paged_model tests/test_paged_kv.py tests/test_kvquant.py tests/test_gpu_runtime.py ;;
  bench)
    timeout 200 python3 benchmarks/bench_kvquant.py --out "$out/b1" --lengths 4096,16384,65536,131072 --batch 1 \
      ${KV_CFG:+--cfg "$KV_CFG"} > "$out/kvquant_bench_b1.log" 2>&1 || rc=1
    timeout 200 python3 benchmarks/bench_kvquant.py --out "$out/b8" --lengths 32768,131072 --batch 8 \
      ${KV_CFG:+--cfg "$KV_CFG"} > "$out/kvquant_bench_b8.log" 2>&1 || rc=1
    tail -4 "$out/kvquant_bench_b1.log" "$out/kvquant_bench_b8.log" ;;
  bench64)
    for shape in smollm2 hybrid bamba; do
      timeout 140 python3 benchmarks/bench_kvquant.py --out "$out/$shape" --shape $shape \
        --lengths 4096,16384,65536,131072 --batch 1 > "$out/kvquant_bench_${shape}_b1.log" 2>&1 || rc=1
      timeout 140 python3 benchmarks/bench_kvquant.py --out "$out/$shape" --shape $shape --lengths 32768,131072 \
        --batch 8 > "$out/kvquant_bench_${shape}_b8.log" 2>&1 || rc=1
      tail -4 "$out/kvquant_bench_${shape}_b1.log" "$out/kvquant_bench_${shape}_b8.log"
    done ;;
  e2e64)
    kvs=fp16,nuq4,nuq3,nuq2,nuq4-1%,nuq3-1%,nuq2-1%
    for mc in smollm2-135m:1:131072,8:32768,8:131072 bamba-9b:1:131072,8:131072; do
      model=${mc%%:*}
      timeout 280 python3 benchmarks/bench_kv_e2e.py --model "$model" --cases "${mc#*:}" --kv "$kvs" \
        --out "$out/e2e_$model" > "$out/kv_e2e_$model.log" 2>&1 || rc=1
      tail -3 "$out/kv_e2e_$model.log"
    done ;;
esac
exit $rc
