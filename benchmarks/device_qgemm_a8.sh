# One device call for the int8-activation serving-batch GEMM (run from the tree's root; OUT set by the tool): tuning +
# kernel table in GPU time (writes configs/qgemm_a8.json), the GPU tests against the references on the tuned settings
# (one process a weight format), then Mamba2-2.7B's decode latency, float against quamba2-w4a8, and quamba2-w4a8 again
# with qgemm_a8 routed no rows (quant_gemm's kernels, as before it).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
LAT="bench latency --model mamba2-2.7b --dtype float16 --batch-size 16,32,64,128,256 --input-len 128 --peers none --gptq-as-rtn"
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/log.txt
echo "== sweep $(date -u +%T)" | tee -a $OUT/log.txt
timeout 180 python3 benchmarks/device_qgemm_a8.py $OUT 15 2>&1 | tail -70 | tee -a $OUT/log.txt
cp ssmq/kernels/configs/qgemm_a8.json $OUT/cfg_qgemm_a8.json
echo "== gpu tests $(date -u +%T)" | tee -a $OUT/log.txt
for f in w4g128 w4g64 w8g128 w8ch w4ch w8t; do
  timeout 80 python3 -m pytest -q -x -p no:cacheprovider tests/test_qgemm_a8.py -k "$f" > $OUT/t_$f.txt 2>&1 &
done
timeout 80 python3 -m pytest -q -p no:cacheprovider tests/test_qgemm_a8.py -k "not w4g128 and not w4g64 and not w8g128 and not w8ch and not w4ch and not w8t" > $OUT/t_rest.txt 2>&1 &
wait
for f in $OUT/t_*.txt; do echo "$(basename $f): $(tail -1 $f)"; done | tee -a $OUT/log.txt
grep -h -E "^(FAILED|ERROR)|Error" $OUT/t_*.txt | head -20 | tee -a $OUT/log.txt
cat $OUT/t_*.txt > $OUT/tests.txt; rm -f $OUT/t_*.txt
echo "== latency $(date -u +%T)" | tee -a $OUT/log.txt
timeout 80 python3 -m ssmq.cli $LAT --recipes float,quamba2-w4a8 --out $OUT/lat 2>&1 | grep -v "it/s\|s/it\|run/s" | tail -16 | tee -a $OUT/log.txt
echo "== latency, qgemm_a8 routed no rows $(date -u +%T)" | tee -a $OUT/log.txt
rm -rf /tmp/base && cp -r . /tmp/base && python3 - <<'PY'
import json
p = "/tmp/base/ssmq/kernels/configs/qgemm_a8.json"
d = json.load(open(p))
for v in d["devices"].values():
    v["ROUTE"] = {"int4": [1, 0], "int8": [1, 0]}
json.dump(d, open(p, "w"))
PY
(cd /tmp/base && PYTHONPATH=/tmp/base timeout 60 python3 -m ssmq.cli $LAT --recipes quamba2-w4a8 --out $OUT/lat_old 2>&1 | grep -v "it/s\|s/it\|run/s" | tail -9) | tee -a $OUT/log.txt
rm -f $OUT/lat/*.png $OUT/lat_old/*.png
echo "== done $(date -u +%T)" | tee -a $OUT/log.txt
