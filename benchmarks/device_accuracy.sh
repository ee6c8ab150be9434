#!/usr/bin/env bash
# Accuracy numbers of one reference model on a GPU machine: FP16 eval suite, baseline recipes, Quamba table.
# Only one model fits a device call's 64 MiB carry, so the data travel xz-compressed:
#   .carry/evaldata.txz  tokenizer, eval JSONL, WikiText-2 test, calibration text (from ../shared)
#   .carry/MODEL.txz     the model folder
# Usage (on the GPU machine, repo root): bash benchmarks/device_accuracy.sh MODEL [STEPS]
#   STEPS: comma list of eval,baselines,quamba (default: all three). Results: $OUT/MODEL.tgz
#   (one archive: the device tool brings back at most 8 files).
set -uo pipefail
m=$1
steps=${2:-eval,baselines,quamba}
out=/tmp/results/$m
mkdir -p /tmp/shared/models "$out"
tar xJf .carry/evaldata.txz -C /tmp/shared && tar xJf ".carry/$m.txz" -C /tmp/shared/models || exit 1
export SSMQ_SHARED=/tmp/shared PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
rc=0
pack() { tar czf "${OUT:-out}/$m.tgz" -C /tmp/results "$m"; }  # after every step: a killed run keeps what it has
if [[ $steps == *eval* ]]; then
  python3 benchmarks/run_eval_suite.py --models "$m" --out "$out/eval" 2>&1 | grep -v "it/s\]\|s/it\]" \
    | tee "$out/eval.log" || rc=1
  pack
fi
if [[ $steps == *baselines* ]]; then
  python3 benchmarks/run_baselines.py --models "$m" --out "$out/baselines" 2>&1 | grep -v "it/s\]\|s/it\]" \
    | tee "$out/baselines.log" || rc=1
  pack
fi
if [[ $steps == *quamba* && -f benchmarks/run_quamba_table.py ]]; then
  python3 benchmarks/run_quamba_table.py --models "/tmp/shared/models/$m" ${QUAMBA_ARGS:---full} --out "$out/quamba" \
    2>&1 | grep -v "it/s\]\|s/it\]" | tee "$out/quamba.log" || rc=1
  pack
fi
exit $rc
