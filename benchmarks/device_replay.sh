#!/usr/bin/env bash
# ReplaySSM state checkpointing on a GPU machine, in one call (each step has its own timeout: 440 s in all, under the
# 450 s a call may take): the GPU tests of the checkpointed decode (kernel vs reference at real shapes, the model and
# the CUDA-graph engine with --state-checkpoint), the state-update micro-benchmark (Mamba2-2.7B layer, batch 1 / 32 /
# 128 / 256, fp16 and int8 state, plain vs checkpoint K=16, bytes-moved limits at 3.35 TB/s; the ring loop's
# pipelining depth swept at batch 128 / 256), then Mamba2-2.7B TPOT (random weights) at batch 1 / 128 / 256, fp16 and
# int8 state, plain vs checkpointed.
# Usage (repo root): bash benchmarks/device_replay.sh [STEPS]; STEPS: comma list of tests,micro,e2e (default all).
# Logs, replay.json and replay.png go to $OUT (the e2e numbers to $OUT/e2e).
set -uo pipefail
steps=${1:-tests,micro,e2e}
out=${OUT:-out}
mkdir -p "$out"
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$out/gpu.txt"
rc=0
if [[ $steps == *tests* ]]; then
  timeout 100 python3 -m pytest -q tests/test_replay_kernels.py tests/test_replay_ssm.py \
    "tests/test_serve.py::test_cuda_graph_engine_equals_offline_on_gpu" --maxfail=5 2>&1 \
    | tail -25 | tee "$out/replay_gpu_tests.log" || rc=1
fi
if [[ $steps == *micro* ]]; then
  timeout 120 python3 benchmarks/bench_replay.py --sweep 128,256 --out "$out" 2>&1 | tee "$out/replay_micro.log" || rc=1
fi
if [[ $steps == *e2e* ]]; then
  timeout 220 python3 benchmarks/bench_replay.py --no-micro --e2e --out "$out/e2e" 2>&1 \
    | grep -v "it/s\]\|s/it\]" | tee "$out/replay_e2e.log" || rc=1
fi
exit $rc
