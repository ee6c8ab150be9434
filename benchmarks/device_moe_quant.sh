# One device call for the grouped MoE on quantized experts (run from this tree's root; $1: the baseline tree; OUT set
# by the tool): its GPU tests, the copy bandwidth and the moe kernel table, then this tree's and the baseline's
# latency of granite-4.0-h-tiny (float, FP8 W8A8, W4A16) side by side.
set -o pipefail
export PYTHONUNBUFFERED=1
BASE=$1
LAT="bench latency --model granite-4.0-h-tiny --dtype float16 --recipes float,fp8-w8a8,rtn-w4a16-g128 --batch-size 1,64 --input-len 1024 --peers none --warmup 1 --reps 3"
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/log.txt
echo "== tests $(date -u +%T)" | tee -a $OUT/log.txt
PYTHONPATH=$PWD timeout 110 python3 -m pytest -q -p no:cacheprovider tests/test_moe_kernel.py tests/test_gpu_runtime.py -k "moe or grouped" 2>&1 | tail -15 | tee -a $OUT/log.txt
echo "== latency, this tree $(date -u +%T)" | tee -a $OUT/log.txt
PYTHONPATH=$PWD timeout 110 python3 -m ssmq.cli $LAT --out $OUT/lat 2>&1 | grep -v "it/s\|s/it" | tail -12 | tee -a $OUT/log.txt
echo "== latency, baseline tree $(date -u +%T)" | tee -a $OUT/log.txt
(cd $BASE && PYTHONPATH=$PWD timeout 110 python3 -m ssmq.cli $LAT --out $OUT/lat_main 2>&1 | grep -v "it/s\|s/it" | tail -12) | tee -a $OUT/log.txt
echo "== kernels $(date -u +%T)" | tee -a $OUT/log.txt
PYTHONPATH=$PWD timeout 15 python3 -c "from ssmq.bench.timing import copy_bandwidth; print(f'copy bandwidth {copy_bandwidth() / 1e9:.0f} GB/s (read + write)')" 2>&1 | tee -a $OUT/log.txt
PYTHONPATH=$PWD timeout 45 python3 -m ssmq.cli bench kernels --only moe --shape granite-4.0-h-tiny --rows 1,64,1024 --l2-flush --out $OUT/kern 2>&1 | grep -v "it/s\|s/it" | tail -14 | tee -a $OUT/log.txt
rm -f $OUT/lat/*.png $OUT/lat_main/*.png $OUT/kern/*.png
echo "== done $(date -u +%T)" | tee -a $OUT/log.txt
