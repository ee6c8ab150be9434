#!/usr/bin/env bash
# Quantized speed and kernel accuracy on a GPU machine, in one call (about 5 minutes on an H100):
# GPU tests of the low-bit kernels, WikiText-2 perplexity on the kernels vs the reference path, and
# bench_quant.py's end-to-end table. The reference model and WikiText-2 travel in shared/ (SSMQ_SHARED):
#   mkdir -p X/shared/models X/shared/data/eval; cp -r ../shared/models/mamba2 X/shared/models/;
#   cp -r ../shared/data/eval/wikitext2 X/shared/data/eval/     (X: the copy of the repo that travels)
# Usage (repo root): bash benchmarks/device_quant.sh [STEPS] [BENCH_ARGS...]; STEPS: comma list of
# tests,accuracy,e2e,micro (default tests,accuracy,e2e). Logs and JSON go to $OUT.
set -uo pipefail
steps=${1:-tests,accuracy,e2e}
shift || true
out=${OUT:-out}
mkdir -p "$out"
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1 HF_HUB_OFFLINE=1
export SSMQ_SHARED=${SSMQ_SHARED:-$PWD/shared}
rc=0
if [[ $steps == *tests* ]]; then
  SSMQ_GPU_QUICK=1 timeout 200 python3 -m pytest -q -m gpu tests/test_quant_kernels.py tests/test_gpu_quant_runtime.py \
    --maxfail=5 2>&1 | tail -25 \
    | tee "$out/gpu_tests.log" || rc=1
fi
if [[ $steps == *accuracy* ]]; then
  timeout 120 python3 benchmarks/check_quant_accuracy.py --out "$out" 2>&1 | tee "$out/accuracy.log" || rc=1
fi
if [[ $steps == *e2e* ]]; then
  python3 benchmarks/bench_quant.py --models mamba2-2.7b --steps 16 --profile --out "$out" "$@" 2>&1 \
    | grep -v "it/s\]\|s/it\]" > "$out/e2e.log" || rc=1
  tail -30 "$out/e2e.log"
fi
if [[ $steps == *micro* ]]; then
  python3 benchmarks/bench_quant.py --models mamba2-2.7b --no-e2e --micro --out "$out/micro" 2>&1 \
    | grep -v "it/s\]\|s/it\]" > "$out/micro.log" || rc=1
fi
exit $rc
