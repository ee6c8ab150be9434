# One device call for the serving-batch GEMM (run from the tree's root; $1: the baseline tree; OUT set by the tool):
# tuning + kernel table in GPU time (writes configs/qgemm_mid.json), then this tree's and the baseline's latency.
set -o pipefail
export PYTHONUNBUFFERED=1
BASE=$1
LAT="bench latency --model mamba2-2.7b --recipes float,rtn-w4a16-g128,rtn-w8a16 --batch-size 16,32,64,128,256 --peers none --dtype float16"
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/log.txt
echo "== sweep $(date -u +%T)" | tee -a $OUT/log.txt
PYTHONPATH=$PWD timeout 270 python3 benchmarks/device_qgemm_mid.py $OUT 15 2>&1 | tail -75 | tee -a $OUT/log.txt
cp ssmq/kernels/configs/qgemm_mid.json $OUT/cfg_qgemm_mid.json
echo "== latency, this tree $(date -u +%T)" | tee -a $OUT/log.txt
PYTHONPATH=$PWD timeout 70 python3 -m ssmq.cli $LAT --out $OUT/lat 2>&1 | grep -v "it/s\|s/it" | tail -19 | tee -a $OUT/log.txt
echo "== latency, baseline tree $(date -u +%T)" | tee -a $OUT/log.txt
(cd $BASE && PYTHONPATH=$PWD timeout 70 python3 -m ssmq.cli $LAT --out $OUT/lat_main 2>&1 | grep -v "it/s\|s/it" | tail -19) | tee -a $OUT/log.txt
rm -f $OUT/lat/*.png $OUT/lat_main/*.png
echo "== done $(date -u +%T)" | tee -a $OUT/log.txt
