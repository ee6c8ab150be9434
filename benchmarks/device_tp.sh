#!/usr/bin/env bash
# Tensor-parallel benchmarks on every GPU of one host (2 H200 for issue 14, 4 for issue 19), one torchrun job.
# Usage (GPU machine, repo root): bash benchmarks/device_tp.sh [bench_tp.py args...]; JSON/MD/PNG and logs go to $OUT.
# N defaults to the number of visible GPUs. NVLink multicast stays off (NCCL NVLS, symmetric-memory multicast,
# NVSHMEM NVLS): the one-shot all-reduce reads peers' buffers over plain peer-to-peer mappings.
set -uo pipefail
out=${OUT:-out/tp}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 TORCH_NCCL_ASYNC_ERROR_HANDLING=1
n=${N:-$(python3 -c "import torch; print(torch.cuda.device_count())")}
nvidia-smi topo -m > "$out/topo.txt" 2>&1 || true
# 500 s hard stop (the budget inside skips rows after 420 s): the job ends well inside 9 minutes
timeout -k 10 500 python3 -m torch.distributed.run --standalone --nproc_per_node "$n" benchmarks/bench_tp.py \
  --out "$out" "$@" 2>&1 | grep -v "it/s\]\|s/it\]" | tee "$out/tp.log"
rc=${PIPESTATUS[0]}
echo "device_tp.sh: exit $rc (N=$n)" | tee -a "$out/tp.log"
exit $rc
