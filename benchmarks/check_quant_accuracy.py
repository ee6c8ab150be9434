"""WikiText-2 perplexity of quantized reference models on the low-bit kernels vs the reference path (GPU).

    python benchmarks/check_quant_accuracy.py --models mamba2 --out out/acc

Each recipe quantizes the float32 reference model (no calibration: the recipes checked need none), saves
and loads the checkpoint in float16 on the GPU (``ssmq.load_model(dir, device="cuda")``) and evaluates
WikiText-2 test twice: once with ``QuantLinear`` on the Triton kernels, once with the same modules on the
CPU references of ``ssmq.ops.quant_linear`` run on the GPU tensors (every other op identical). Writes
accuracy.json; prints a table with the relative difference (target: within 0.05%).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

import ssmq
from ssmq import kernels, ops
from ssmq.eval.perplexity import perplexity_of_ids, wikitext2_path
from ssmq.paths import shared_path
from ssmq.quant import save_quantized

RECIPES = "rtn-w8a16,rtn-w4a16-g128,dynamic-w8a8,fp8-w8a8"


def reference_ops(on: bool) -> None:
    """Route QuantLinear (``ssmq.kernels.quant_gemm`` / ``quantize_act``) to the references or the kernels."""
    if on:
        kernels.quant_linear = ops.quant_linear_ref
        kernels.quantize_act = ops.quantize_act_ref
    else:
        kernels.quant_linear = kernels.dispatch.quant_linear
        kernels.quantize_act = kernels.dispatch.quantize_act


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mamba2")
    ap.add_argument("--recipes", default=RECIPES)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=os.environ.get("OUT", "out/acc"))
    args = ap.parse_args()
    results = {"device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
               "date": time.strftime("%Y-%m-%d"), "models": {}}
    for name in args.models.split(","):
        folder = shared_path("models", name)
        tok = ssmq.load_tokenizer(folder)
        ids = tok.encode(wikitext2_path().read_text(encoding="utf-8"))
        rows = results["models"].setdefault(name, {})
        for recipe in args.recipes.split(","):
            model = ssmq.load_model(folder, dtype=torch.float32, device=args.device)
            ssmq.quantize(model, recipe, None, progress=False)
            with tempfile.TemporaryDirectory() as tmp:
                save_quantized(model, Path(tmp) / "q")
                del model
                model = ssmq.load_model(Path(tmp) / "q", dtype=torch.float16, device=args.device)
            r = {}
            for path in ("kernels", "reference"):
                reference_ops(path == "reference")
                r[path] = perplexity_of_ids(model, ids, args.seqlen, limit=args.limit, progress=False)["ppl"]
            reference_ops(False)
            r["rel_diff_pct"] = 100 * (r["kernels"] - r["reference"]) / r["reference"]
            rows[recipe] = r
            print(name, recipe, json.dumps(r), flush=True)
            del model
            torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "accuracy.json").write_text(json.dumps(results, indent=1))
    print("| model | recipe | ppl kernels | ppl reference path | diff |\n|---|---|---|---|---|")
    for name, rows in results["models"].items():
        for recipe, r in rows.items():
            print(f"| {name} | `{recipe}` | {r['kernels']:.3f} | {r['reference']:.3f} | {r['rel_diff_pct']:+.4f}% |")


if __name__ == "__main__":
    main()
