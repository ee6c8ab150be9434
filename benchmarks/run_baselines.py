"""WikiText-2 perplexity of each baseline recipe vs the float model, on the trained reference models.

    python benchmarks/run_baselines.py --out out/baselines            # GPU, full settings
    python benchmarks/run_baselines.py --device cpu --limit 2 --calib-samples 8 --models mamba2   # smoke test

Each recipe goes through the user's path: quantize the float32 model (calibration: N windows of L
tokens from shared/data/train/wikitext2_train.txt.gz, seed 0), save the checkpoint, load it back in
--dtype, evaluate. Writes baselines.json and baselines.md to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

import ssmq
from ssmq.eval.perplexity import perplexity_of_ids, wikitext2_path
from ssmq.paths import shared_path
from ssmq.quant.calibration import load_calibration
from ssmq.quant.checkpoint import load_quantized, save_quantized
from ssmq.quant.recipe import RECIPES, get_recipe

BASELINES = ["rtn-w8a16", "rtn-w4a16-g128", "static-w8a8", "dynamic-w8a8", "smoothquant-w8a8", "hadamard-w8a8",
             "gptq-w4a16-g128"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mamba1,mamba2,hybrid")
    ap.add_argument("--recipes", default=",".join(BASELINES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--limit", type=int, default=None, help="evaluate only the first N windows")
    ap.add_argument("--calib-samples", type=int, default=512)
    ap.add_argument("--calib-seqlen", type=int, default=512)
    ap.add_argument("--out", default=os.environ.get("OUT", "out/baselines"))
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = ssmq.load_tokenizer()
    ids = tok.encode(wikitext2_path().read_text(encoding="utf-8"))
    calib = load_calibration(None, args.calib_samples, args.calib_seqlen, seed=0, tokenizer=tok)
    results = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
               "date": time.strftime("%Y-%m-%d"), "dtype": args.dtype, "seqlen": args.seqlen, "limit": args.limit,
               "calibration": calib.record(), "models": {}}

    def ppl(model, desc):
        return perplexity_of_ids(model, ids, args.seqlen, limit=args.limit, desc=desc)

    for name in args.models.split(","):
        folder = shared_path("models", name)
        if folder is None:
            sys.exit(f"run_baselines: ../shared/models/{name} not found")
        row = {"float": ppl(ssmq.load_model(folder, dtype=dtype, device=args.device), f"{name} {args.dtype}")}
        for recipe in tqdm(args.recipes.split(","), desc=f"{name} recipes"):
            t0 = time.time()
            try:
                model = ssmq.load_model(folder, dtype=torch.float32, device=args.device)
                ssmq.quantize(model, get_recipe(recipe), calib)
                with tempfile.TemporaryDirectory() as tmp:
                    save_quantized(model, Path(tmp) / "q")
                    del model
                    model = load_quantized(Path(tmp) / "q", dtype=dtype, device=args.device)
                row[recipe] = ppl(model, f"{name} {recipe}")
            except ssmq.errors.SSMQError as e:  # a recipe that does not apply is reported, not fatal
                row[recipe] = {"error": str(e)}
            row[recipe]["wall_s"] = round(time.time() - t0, 1)
            print(name, recipe, json.dumps(row[recipe]), flush=True)
        results["models"][name] = row
    (out / "baselines.json").write_text(json.dumps(results, indent=1))
    table = markdown(results, args.recipes.split(","))
    (out / "baselines.md").write_text(table)
    print(table)


def markdown(results, recipes) -> str:
    models = list(results["models"])
    lines = [f"WikiText-2 test perplexity (seqlen {results['seqlen']}, {results['dtype']}, {results['device']}, "
             f"{results['date']}); in brackets: change vs the float model\n",
             "| recipe | " + " | ".join(models) + " |", "|---" * (len(models) + 1) + "|"]
    for r in ["float", *recipes]:
        cells = []
        for m in models:
            v, base = results["models"][m].get(r, {}), results["models"][m]["float"]["ppl"]
            if "ppl" not in v:
                cells.append(v.get("error", "—")[:40])
            else:
                cells.append(f"{v['ppl']:.2f}" + ("" if r == "float" else f" ({100 * (v['ppl'] / base - 1):+.1f}%)"))
        lines.append(f"| {r if r != 'float' else results['dtype']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    assert set(BASELINES) <= set(RECIPES)
    main()
