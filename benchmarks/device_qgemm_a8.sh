# One device call for the int8-activation serving-batch GEMM (run from the tree's root; OUT set by the tool): tuning +
# kernel table in GPU time (writes configs/qgemm_a8.json), the GPU tests against the references on the tuned settings
# (one process a weight format), then Mamba2-2.7B's decode latency, float against quamba2-w4a8.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
LAT="bench latency --model mamba2-2.7b --dtype float16 --recipes float,quamba2-w4a8 --batch-size 16,32,64,128,256 --input-len 128 --peers none --gptq-as-rtn"
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/log.txt
echo "== sweep $(date -u +%T)" | tee -a $OUT/log.txt
timeout 165 python3 benchmarks/device_qgemm_a8.py $OUT 15 2>&1 | tail -60 | tee -a $OUT/log.txt
cp ssmq/kernels/configs/qgemm_a8.json $OUT/cfg_qgemm_a8.json
echo "== gpu tests $(date -u +%T)" | tee -a $OUT/log.txt
for f in w4g128 w4g64 w8g128 w8ch w4ch w8t; do
  timeout 95 python3 -m pytest -q -x -p no:cacheprovider tests/test_qgemm_a8.py -k "$f" > $OUT/t_$f.txt 2>&1 &
done
timeout 95 python3 -m pytest -q -p no:cacheprovider tests/test_qgemm_a8.py -k "not w4g128 and not w4g64 and not w8g128 and not w8ch and not w4ch and not w8t" > $OUT/t_rest.txt 2>&1 &
wait
for f in $OUT/t_*.txt; do echo "$(basename $f): $(tail -1 $f)"; done | tee -a $OUT/log.txt
grep -h -E "^(FAILED|ERROR)|Error" $OUT/t_*.txt | head -20 | tee -a $OUT/log.txt
cat $OUT/t_*.txt > $OUT/tests.txt; rm -f $OUT/t_*.txt
echo "== latency $(date -u +%T)" | tee -a $OUT/log.txt
timeout 140 python3 -m ssmq.cli $LAT --out $OUT/lat 2>&1 | grep -v "it/s\|s/it\|run/s" | tail -16 | tee -a $OUT/log.txt
rm -f $OUT/lat/*.png
echo "== done $(date -u +%T)" | tee -a $OUT/log.txt
