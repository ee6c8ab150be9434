"""Which op's kernel moves a quantized model's perplexity away from its reference path (GPU diagnostic).

    python benchmarks/diag_quant_accuracy.py --model mamba2 --recipe quamba2-w8a8 [--windows 40]

``check_quant_accuracy.py`` compares the whole model on the kernels with the whole model on the references. This
runs the kernels with ONE dispatched op at a time on its reference (``ref:<op>``), and with the fused activation
quantization turned off (``nofusion``), on the first --windows windows of WikiText-2 (2048 tokens); each row's
perplexity against the all-kernels and the all-reference ones tells which op, if any, carries a difference.
Writes diag_accuracy.json to --out.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ssmq  # noqa: E402
from check_quant_accuracy import paired, quantized_model, reference_ops  # noqa: E402
from ssmq import kernels  # noqa: E402
from ssmq.kernels import policy  # noqa: E402
from ssmq.eval.perplexity import perplexity_of_ids, wikitext2_path  # noqa: E402
from ssmq.paths import shared_path  # noqa: E402
from ssmq.quant.recipe import get_recipe  # noqa: E402

# the ops a quantized Mamba model dispatches (those it does not use leave the number unchanged)
OPS = ("conv1d_silu_quant", "causal_conv1d", "quant_ssd", "ssd_chunk_scan", "ssd_int8", "quant_selective_scan",
       "selective_scan", "rms_norm", "rms_norm_quant", "rmsnorm_gated", "rmsnorm_gated_quant",
       "quant_linear")
FUSION_FLAGS = ("act_quant_fusion_enabled",)


def on_reference(fn):
    """``fn`` with the dispatcher forced to its reference for the duration of the call."""
    @functools.wraps(fn)
    def run(*a, **k):
        with policy.using(policy.active().with_changes(reference_ops=True)):
            return fn(*a, **k)
    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mamba2")
    ap.add_argument("--recipe", default="quamba2-w8a8")
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--out", default=os.environ.get("OUT", "out/diag_acc"))
    args = ap.parse_args()
    folder = shared_path("models", args.model)
    tok = ssmq.load_tokenizer(folder)
    ids = tok.encode(wikitext2_path().read_text(encoding="utf-8"))
    model, _ = quantized_model(folder, tok, get_recipe(args.recipe), "cuda", 16, 512)
    saved = {n: getattr(kernels, n) for n in OPS + FUSION_FLAGS}

    def ppl(mode: str) -> dict:
        for n, f in saved.items():
            setattr(kernels, n, f)
        reference_ops(mode == "reference", everything=True)
        if mode == "nofusion":
            for n in FUSION_FLAGS:
                setattr(kernels, n, lambda *a, **k: False)
        elif mode.startswith("ref:"):
            setattr(kernels, mode[4:], on_reference(saved[mode[4:]]))
        try:
            with torch.inference_mode():
                return perplexity_of_ids(model, ids, 2048, limit=args.windows, progress=False, per_window=True)
        finally:
            reference_ops(False)
            for n, f in saved.items():
                setattr(kernels, n, f)

    base = {m: ppl(m) for m in ("kernels", "reference")}
    tokens = base["kernels"]["n_tokens_predicted"] / base["kernels"]["n_windows"]
    res = {"model": args.model, "recipe": args.recipe, "windows": args.windows,
           "kernels": base["kernels"]["ppl"], "reference": base["reference"]["ppl"],
           "window_diff": paired(base["kernels"]["window_nll"], base["reference"]["window_nll"], tokens), "rows": {}}
    print(json.dumps({k: v for k, v in res.items() if k != "rows"}), flush=True)
    for mode in ("nofusion",) + tuple(f"ref:{n}" for n in OPS):
        p = ppl(mode)["ppl"]
        res["rows"][mode] = {"ppl": p, "vs_kernels_pct": 100 * (p / res["kernels"] - 1),
                             "vs_reference_pct": 100 * (p / res["reference"] - 1)}
        print(mode, json.dumps(res["rows"][mode]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "diag_accuracy.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
