"""WikiText-2 perplexity of quantized reference models on the low-bit kernels vs the reference path (GPU).

    python benchmarks/check_quant_accuracy.py --models mamba2 --out out/acc

Each recipe quantizes the float32 reference model (recipes that need calibration get --calib-samples windows of
the calibration text, seed 0), saves and loads the checkpoint in float16 on the GPU
(``ssmq.load_model(dir, device="cuda")``) and evaluates WikiText-2 test twice: once on the Triton kernels, once on
the references. The reference path is ``QuantLinear`` on the CPU references of ``ssmq.ops.quant_linear`` run on
the GPU tensors (every other op identical) for recipes without SSM quantization, and every op on its reference
(``SSMQ_REF_OPS``' switch: int8 conv / scan / state update, Hadamard, norms) for the Quamba / Quamba2 / SSDi8
recipes, whose SSM side has kernels too. Writes accuracy.json; prints a table with the relative difference
(target: within 0.05%) and the per-window paired difference. ``--decode-tokens N`` scores through the decode path
instead (``decode_perplexity_of_ids``: N-token windows fed one a step to ``model.step``, so a recipe's int8 SSM state
cache and the decode kernels are what is compared).
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
from ssmq.kernels import policy
from ssmq.eval.perplexity import decode_perplexity_of_ids, perplexity_of_ids, wikitext2_path
from ssmq.models.cache import calibrated_ssm_dtype
from ssmq.paths import shared_path
from ssmq.quant import save_quantized
from ssmq.quant.calibration import load_calibration
from ssmq.quant.recipe import STATE_SCALES, Cache, get_recipe

RECIPES = "rtn-w8a16,rtn-w4a16-g128,dynamic-w8a8,fp8-w8a8"


def reference_ops(on: bool, everything: bool = False) -> None:
    """Route QuantLinear (``ssmq.kernels.quant_gemm`` / ``quantize_act``) to the references or the kernels;
    ``everything``: every dispatched op."""
    policy.set_policy(policy.KernelPolicy(reference_ops=on and everything))
    if on:
        kernels.quant_linear = ops.quant_linear_ref
        kernels.quantize_act = ops.quantize_act_ref
    else:
        kernels.quant_linear = kernels.dispatch.quant_linear
        kernels.quantize_act = kernels.dispatch.quantize_act


def quantized_model(folder, tok, spec, device: str, calib_samples: int, calib_seqlen: int):
    """(the float32 model at ``folder`` quantized by ``spec``, saved and loaded back in float16 on ``device``,
    its calibration data or None)."""
    model = ssmq.load_model(folder, dtype=torch.float32, device=device)
    calib = load_calibration(None, calib_samples, calib_seqlen, seed=0, tokenizer=tok) \
        if spec.needs_calibration() else None
    ssmq.quantize(model, spec, calib, progress=False)
    with tempfile.TemporaryDirectory() as tmp:
        save_quantized(model, Path(tmp) / "q")
        del model
        return ssmq.load_model(Path(tmp) / "q", dtype=torch.float16, device=device), calib


def paired(a: list[float], b: list[float], tokens: float) -> dict:
    """Per-window NLL differences a - b (per token): their mean with its standard error (in % of perplexity, since
    d ppl / ppl = d nll), and how many windows went each way. A mean within two standard errors of 0, with the
    windows split both ways, is rounding noise (flipped codes) rather than a bias of the kernels."""
    d = [(x - y) / tokens for x, y in zip(a, b)]
    mean = sum(d) / len(d)
    se = (sum((x - mean) ** 2 for x in d) / max(len(d) - 1, 1)) ** 0.5 / len(d) ** 0.5
    return {"mean_pct": 100 * mean, "stderr_pct": 100 * se, "up": sum(x > 0 for x in d), "down": sum(x < 0 for x in d)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mamba2")
    ap.add_argument("--recipes", default=RECIPES)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--calib-samples", type=int, default=16, help="calibration windows (recipes that need them)")
    ap.add_argument("--calib-seqlen", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=0,
                    help="score through the decode path instead: windows of this many tokens fed one a step to "
                         "model.step over the recipe's cache (its int8 state, if any); --limit windows (default 8)")
    ap.add_argument("--decode-prefill", type=int, default=0, help="with --decode-tokens: tokens prefilled first")
    ap.add_argument("--state-bits", type=int, default=16, choices=[8, 16],
                    help="8: each recipe with the int8 SSM state cache (calibrated state scales)")
    ap.add_argument("--state-scales", choices=STATE_SCALES, default="x_groups",
                    help="with --state-bits 8: the int8 state's scale table (recipe cache.state_scales)")
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
            spec = get_recipe(recipe)
            if args.state_bits == 8 and spec.cache.state_bits != 8:  # the recipe plus the int8 SSM state cache
                suffix = "" if args.state_scales == "x_groups" else f"-{args.state_scales}"
                spec = spec.with_changes(name=f"{recipe}+int8-state{suffix}",
                                         cache=Cache(state_bits=8, kv=spec.cache.kv, state_scales=args.state_scales))
            model, calib = quantized_model(folder, tok, spec, args.device, args.calib_samples, args.calib_seqlen)
            # recipes with SSM quantization (transforms / taps / int8 state) run kernels beyond the linears
            whole = bool(spec.transforms or spec.taps or spec.cache.state_bits != 16)
            r, nll = {}, {}
            for path in ("kernels", "reference"):
                reference_ops(path == "reference", whole)
                if args.decode_tokens:  # the decode path: step kernels, the cache's state format
                    p = decode_perplexity_of_ids(model, ids, args.decode_tokens, args.limit or 8, args.decode_prefill,
                                                 calibrated_ssm_dtype(model), progress=False)
                else:
                    p = perplexity_of_ids(model, ids, args.seqlen, limit=args.limit, progress=False, per_window=True)
                r[path], nll[path], r["windows"] = p["ppl"], p["window_nll"], p["n_windows"]
            if args.decode_tokens:
                r["decode"] = {"tokens": args.decode_tokens, "prefill": args.decode_prefill,
                               "state_bits": spec.cache.state_bits}
            reference_ops(False)
            r["rel_diff_pct"] = 100 * (r["kernels"] - r["reference"]) / r["reference"]
            r["window_diff"] = paired(nll["kernels"], nll["reference"], p["n_tokens_predicted"] / p["n_windows"])
            r["reference_ops"] = "all" if whole else "linears"
            if calib is not None:
                r["calibration"] = [args.calib_samples, args.calib_seqlen]
            rows[spec.name] = r
            print(name, spec.name, json.dumps(r), flush=True)
            del model
            torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "accuracy.json").write_text(json.dumps(results, indent=1))
    print("| model | recipe | windows | ppl kernels | ppl reference path | diff | per-window mean ± s.e. | up / down |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|")
    for name, rows in results["models"].items():
        for recipe, r in rows.items():
            w = r["window_diff"]
            print(f"| {name} | `{recipe}` | {r['windows']} | {r['kernels']:.3f} | {r['reference']:.3f} | "
                  f"{r['rel_diff_pct']:+.4f}% | {w['mean_pct']:+.4f} ± {w['stderr_pct']:.4f}% | {w['up']} / {w['down']} |")


if __name__ == "__main__":
    main()
