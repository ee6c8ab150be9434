#!/usr/bin/env bash
# SSDi8 on a GPU machine (< 5 minutes on one H100): the GPU tests of the int8 SSD kernels, then the kernel benchmark
# (int8 SSD vs our FP16 SSD vs mamba_ssm's mamba_chunk_scan_combined, Mamba2-2.7B shape, batch 1 / 32, L 256..8192).
# The peer travels as .carry/mamba_ssm-2.3.2.post1-triton.tar.gz (as for device_speed.sh).
# Usage (on the GPU machine, repo root): bash benchmarks/device_ssdi8.sh [LENGTHS]   Logs and JSON go to $OUT.
set -uo pipefail
lengths=${1:-256,512,1024,2048,4096,8192}
out=${OUT:-out}
mkdir -p "$out"
source benchmarks/peer_env.sh
rc=0
timeout 120 python3 -m pytest -q -m gpu tests/test_ssdi8_kernels.py 2>&1 | tail -15 | tee "$out/ssdi8_gpu_tests.log" || rc=1
timeout 170 python3 benchmarks/bench_ssdi8.py --lengths "$lengths" --json "$out/ssdi8_kernels.json" 2>&1 \
  | tee "$out/ssdi8_kernels.log" || rc=1
exit $rc
