#!/bin/bash
# On the device machine, from this tree's root (a copy of main's tree beside it in ../.dev-state-base): the state
# update's bandwidth for main's tree and for this tree (variants of its launch settings), then the GPU tests of the
# int8 state update kernels. Logs and JSON under $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1
ROWS=${ROWS:-32,128,256}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > $OUT/gpu.txt
(cd ../.dev-state-base && PYTHONPATH=$PWD timeout 30 python3 ../.dev-state/benchmarks/device_state_update.py \
    --rows $ROWS --label main --out $OUT > $OUT/sweep-main.txt 2>&1)
timeout 40 python3 benchmarks/device_state_update.py --rows $ROWS --variants benchmarks/state_update_variants.json \
    --label state --out $OUT > $OUT/sweep-state.txt 2>&1
timeout ${TESTS_S:-40} python3 -m pytest -q -m gpu -x tests/test_int8_ssm_kernels.py \
    -k "state_update or step or reciprocal or requant or codes" > $OUT/tests.txt 2>&1
head -1 $OUT/gpu.txt; tail -1 $OUT/gpu.txt
grep -A 20 "copy" $OUT/sweep-main.txt | tail -10
grep -A 200 "copy" $OUT/sweep-state.txt | tail -34
tail -3 $OUT/tests.txt
