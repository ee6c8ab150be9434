#!/usr/bin/env bash
# Speed numbers on a GPU machine: GPU tests, kernel timings, end-to-end TTFT/TPOT vs mamba_ssm and transformers.
# The peer travels as .carry/mamba_ssm-2.3.2.post1-triton.tar.gz (a copy of ../shared/peers/'s tarball).
# Usage (on the GPU machine, repo root): bash benchmarks/device_speed.sh [STEPS] [E2E_ARGS...]
#   STEPS: comma list of tests,kernels,e2e (default: all). Logs and JSON go to $OUT.
set -uo pipefail
steps=${1:-tests,kernels,e2e}
shift || true
out=${OUT:-out}
mkdir -p "$out"
source benchmarks/peer_env.sh
rc=0
if [[ $steps == *tests* ]]; then
  python3 -m pytest -q -m gpu tests/test_kernels.py tests/test_gpu_runtime.py 2>&1 | tail -25 | tee "$out/gpu_tests.log" || rc=1
fi
if [[ $steps == *kernels* ]]; then
  python3 benchmarks/bench_kernels.py --json "$out/kernels.json" 2>&1 | grep -v "it/s\]" | tee "$out/kernels.log" || rc=1
fi
if [[ $steps == *e2e* ]]; then
  python3 benchmarks/bench_e2e.py --out "$out/e2e" "$@" 2>&1 | grep -v "it/s\]\|s/it\]" | tee "$out/e2e.log" || rc=1
fi
exit $rc
