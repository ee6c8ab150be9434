#!/usr/bin/env bash
# The low-bit decode GEMV (ssmq.kernels.qgemv) on a GPU machine: its GPU tests, a launch-setting sweep at
# Mamba2-2.7B's shapes, the old-vs-new table at Mamba2-2.7B and 8B shapes, and (e2e) batch-1 TPOT old vs new.
# Usage (repo root): bash benchmarks/device_gemv.sh [STEPS]   STEPS: comma list of tests,sweep,table,e2e
set -uo pipefail
steps=${1:-tests,sweep,table}
out=${OUT:-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv | tee "$out/gpu.txt"
if [[ $steps == *tests* ]]; then
  timeout 70 python3 -m pytest -q -x tests/test_qgemv.py -k "${TESTS_K:-default or fp8 or graph or routing}" 2>&1 \
    | tail -15 | tee "$out/tests.log"
fi
if [[ $steps == *sweep* ]]; then
  all='"ROUTE_ROWS": {"int4": 8, "int8": 8, "fp8": 8}'
  sweep="{\"old\": {\"ROUTE_ROWS\": {\"int4\": 0, \"int8\": 0, \"fp8\": 0}}, \"new\": {$all},
    \"bn128\": {$all, \"BN_FMA\": 128, \"BN_DOT\": 128}, \"kt512\": {$all, \"KT_FMA\": 512, \"KT_DOT\": 256},
    \"w3\": {$all, \"WAVES\": 3}, \"w12\": {$all, \"WAVES\": 12}}"
  timeout 60 python3 -m ssmq.runtime.bench_gemv --models mamba2-2.7b --formats w4a16-g128,w8a16 \
    --rows 1,8 --no-stream --reps 20 --variants "$sweep" --json "$out/sweep.json" 2>&1 \
    | tee "$out/sweep.log" | grep -v '^{'
fi
if [[ $steps == *table* ]]; then
  timeout ${TABLE_S:-120} python3 -m ssmq.runtime.bench_gemv --reps 20 --models "${MODELS:-mamba2-2.7b,mamba2-8b}" \
    --json "$out/gemv.json" 2>&1 | tee "$out/table.log" \
    | grep -v '^{'
fi
if [[ $steps == *e2e* ]]; then
  # the shipped routing against quant_gemm's kernels only (qgemv.CFG's ROUTE_ROWS zeroed by a sitecustomize)
  for v in new old; do
    site=$(mktemp -d)
    [[ $v == old ]] && printf '%s\n' 'from ssmq.kernels import qgemv' \
      'qgemv.CFG["ROUTE_ROWS"] = dict(int4=0, int8=0, fp8=0)' > "$site/sitecustomize.py"
    PYTHONPATH="$site:$PYTHONPATH" timeout 200 python3 benchmarks/bench_quant.py --models mamba2-2.7b \
      --recipes fp16,rtn-w8a16,rtn-w4a16-g128,fp8-w8a8 --batches 1 --via-disk none --prompt-len 64 --steps 32 \
      --out "$out/e2e_$v" 2>&1 | grep -v "it/s\]\|s/it\]" | tail -12 | tee "$out/e2e_$v.log"
  done
fi
