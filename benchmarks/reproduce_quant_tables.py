"""CPU subset of the README's quantization tables, to show a refactor does not move the numbers.

    python benchmarks/reproduce_quant_tables.py --out out/repro.json                       # all rows, both models
    python benchmarks/reproduce_quant_tables.py --models mamba1 --recipes quamba-w8a8 --windows 1

Each row goes through the user's path: quantize the float32 model (calibration: --calib-samples windows of
512 tokens of wikitext2_train.txt.gz, seed 0), save the checkpoint, load it back in float32 and evaluate
the first --windows windows of 2048 tokens of WikiText-2 test. A recipe is a registered name or a JSON
file (the paper ladders' custom rows: ``naive-w8a8``, ``+hadamard-y``, written as JSON by ``--dump-recipes``).
Writes one JSON {model: {recipe: ppl}} to --out and prints one line per row.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

import ssmq
from ssmq.eval.perplexity import perplexity_of_ids, wikitext2_path
from ssmq.paths import shared_path
from ssmq.quant import load_calibration, save_quantized

ROWS = ["rtn-w8a16", "rtn-w4a16-g128", "static-w8a8", "dynamic-w8a8", "smoothquant-w8a8", "hadamard-w8a8",
        "gptq-w4a16-g128", "quamba-w8a8", "quamba2-w8a8", "quamba2-w4a8", "quamba2-w4a16", "quamba2-mixed"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mamba1,mamba2")
    ap.add_argument("--recipes", default=",".join(ROWS), help="comma list of names or JSON files")
    ap.add_argument("--windows", type=int, default=2, help="WikiText-2 test windows of 2048 tokens")
    ap.add_argument("--calib-samples", type=int, default=16)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.manual_seed(0)
    tok = ssmq.load_tokenizer()
    ids = tok.encode(wikitext2_path().read_text(encoding="utf-8"))
    calib = load_calibration(None, args.calib_samples, 512, seed=0, tokenizer=tok)
    out = Path(args.out)
    res = json.loads(out.read_text()) if out.is_file() else {}
    setting = {"windows": args.windows, "seqlen": 2048, "calib": [args.calib_samples, 512], "dtype": "float32",
               "device": "cpu"}
    if res.setdefault("setting", setting) != setting:
        raise SystemExit(f"{out} holds rows measured with {res['setting']}, not {setting}")
    for name in args.models.split(","):
        folder = shared_path("models", name)
        row = res.setdefault(name, {})
        if "float" not in row:
            row["float"] = perplexity_of_ids(ssmq.load_model(folder, dtype=torch.float32), ids, 2048,
                                             limit=args.windows, progress=False)["ppl"]
            print(name, "float", row["float"], flush=True)
        for recipe in args.recipes.split(","):
            label = Path(recipe).stem if recipe.endswith(".json") else recipe
            if label in row:  # resume: rows already measured stay
                continue
            t0 = time.time()
            model = ssmq.load_model(folder, dtype=torch.float32)
            ssmq.quantize(model, recipe, calib, progress=False)
            with tempfile.TemporaryDirectory() as tmp:
                save_quantized(model, Path(tmp) / "q")
                del model
                model = ssmq.load_model(Path(tmp) / "q", dtype=torch.float32)
            row[label] = perplexity_of_ids(model, ids, 2048, limit=args.windows, progress=False)["ppl"]
            print(name, label, repr(row[label]), f"{time.time() - t0:.0f}s", flush=True)
            out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
