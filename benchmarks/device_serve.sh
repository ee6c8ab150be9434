#!/usr/bin/env bash
# ssmq serve on a GPU machine: the serve tests on CUDA (graph decode, paged KV), then bench_serve.py for
# Mamba2-2.7B in FP16 and one quantized config (random weights), each writing serve.{json,md,png} to $OUT/<config>.
# FastAPI, uvicorn, pydantic and the openai client are not in the GPU image: they travel as wheels in .whl
# (benchmarks/fetch_serve_wheels.sh downloads them).
# Usage (on the GPU machine, repo root): bash benchmarks/device_serve.sh [QUANT_RECIPE] (default rtn-w8a16)
set -uo pipefail
quant=${1:-rtn-w8a16}
out=${OUT:-out}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
log="$out/serve.log"
rc=0
start=$(date +%s)
python3 -m pytest -q -m gpu tests/test_serve.py -k cuda_graph 2>&1 | tail -15 | tee "$log" || rc=1
common=(--model mamba2-2.7b --concurrency 1,16,64,256 --prompt-len 128 --output-len 128 --requests 3
        --max-seconds 40 --client-procs 4)
python3 benchmarks/bench_serve.py "${common[@]}" --out "$out/fp16" 2>&1 | grep -v "it/s\]" | tee -a "$log" || rc=1
python3 benchmarks/bench_serve.py "${common[@]}" --quant "$quant" --out "$out/$quant" 2>&1 | grep -v "it/s\]" \
  | tee -a "$log" || rc=1
echo "device_serve.sh: $(( $(date +%s) - start )) s, rc $rc" | tee -a "$log"
exit $rc
