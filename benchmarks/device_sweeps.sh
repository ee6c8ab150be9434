# One device call (from this tree's root; OUT set by the tool): the grouped MoE's launch sweep on weight-only int4 /
# int8 experts (the winners written into configs/moe.json), the int8 state update's launch sweep, the GPU tests of
# both kernels, then granite-4.0-h-tiny's latency (float, FP8 W8A8, W4A16) on the new table. Everything ends up in
# $OUT/all.tgz; a summary is printed last.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
W=$OUT/w; mkdir -p $W
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee $W/gpu.txt
PAR=""; python3 -c "import xdist" 2>/dev/null && PAR="-n 6"
echo "== moe sweep $(date -u +%T)"
timeout 140 python3 benchmarks/device_moe_sweep.py $W 14 --write > $W/moe_sweep.txt 2>&1; echo "rc $?"
cp ssmq/kernels/configs/moe.json $W/moe.json
echo "== state update sweep $(date -u +%T)"
timeout 70 python3 benchmarks/device_state_update.py --rows 32,128,256 --kinds "int8 row scales,int8 table,fp16" \
  --variants benchmarks/state_update_variants.json --label sweeps --out $W > $W/state_sweep.txt 2>&1; echo "rc $?"
echo "== tests $(date -u +%T) ($PAR)"
timeout 95 python3 -m pytest -q -x -p no:cacheprovider $PAR tests/test_moe_kernel.py > $W/tests_moe.txt 2>&1
echo "rc $?"
timeout 30 python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_int8_ssm_kernels.py \
  -k "state_update or step or reciprocal or requant or codes" > $W/tests_state.txt 2>&1; echo "rc $?"
echo "== latency $(date -u +%T)"
timeout 125 python3 -m ssmq.cli bench latency --model granite-4.0-h-tiny --dtype float16 \
  --recipes float,fp8-w8a8,rtn-w4a16-g128 --batch-size 1,64 --input-len 1024 --peers none --warmup 1 --reps 3 \
  --profile --out $W/lat > $W/latency.txt 2>&1; echo "rc $?"
rm -f $W/lat/*.png
echo "== done $(date -u +%T)"
(cd $OUT && tar czf all.tgz w && rm -rf w/lat w/*.json w/*_log.txt w/gpu.txt)
tail -2 $W/tests_moe.txt; tail -2 $OUT/w/tests_state.txt 2>/dev/null
grep -A 12 "whole moe_experts" $W/moe_sweep.txt
grep -A 40 "copy" $W/state_sweep.txt | tail -40 | cut -c1-100
grep -A 8 "ttft_ms" $W/latency.txt | head -10
