"""How far an A8 recipe's perplexity moves when the inputs of its activation quantizers move by one float32 ulp, on
the CPU: the noise floor under which no other implementation of the same arithmetic (the GPU kernels, summing in
another order) can be told from the reference by perplexity.

    python benchmarks/act_code_sensitivity.py --model ../shared/models/mamba2 --seeds 3 --out OUT.json

Each recipe quantizes the trained model once and scores the first ``--limit`` WikiText-2 test windows through the
forward on the references, then again ``--seeds`` times with every activation quantizer's input (``ssmq.ops``'
``quantize_act_ref`` and ``quantize_ref``, wherever they are called) multiplied by 1 + r * ``--ulps`` * 2^-23, r = +-1
drawn per element: the size of a float32 rounding difference. A code changes only where its quotient lies within
that distance of a rounding boundary; the perplexity difference is what those flips do after every later layer.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import contextmanager

import torch

import ssmq.ops.quant_linear as QL
from ssmq.eval.perplexity import perplexity_of_ids, wikitext2_path
from ssmq.models.loading import load_model
from ssmq.quant import get_recipe, load_calibration, quantize
from ssmq.tokenizer import load_tokenizer

A8 = ("static-w8a8", "dynamic-w8a8", "smoothquant-w8a8", "hadamard-w8a8", "fp8-w8a8", "quamba-w8a8", "quamba2-w8a8",
      "quamba2-w4a8", "ssdi8-w8a8")


@contextmanager
def jittered_quantizers(ulps: float, seed: int):
    """Every ssmq module's ``quantize_act_ref`` / ``quantize_ref`` (imported by name where they are called) replaced
    by one that first moves each input element by ``ulps`` float32 ulps, up or down at random."""
    gen = torch.Generator().manual_seed(seed)
    act, codes = QL.quantize_act_ref, QL.quantize_ref

    def jitter(x):
        x = x.float()
        sign = torch.randint(0, 2, x.shape, generator=gen).float() * 2 - 1
        return x * (1 + sign * (ulps * 2.0 ** -23))

    swaps = {act: lambda x, *a, **k: act(jitter(x), *a, **k), codes: lambda x, s: codes(jitter(x), s)}
    patched = [(m, name, fn) for m in list(sys.modules.values()) if getattr(m, "__name__", "").startswith("ssmq.")
               for name, fn in vars(m).items() if any(fn is f for f in swaps)]
    for m, name, fn in patched:
        setattr(m, name, swaps[fn])
    try:
        yield
    finally:
        for m, name, fn in patched:
            setattr(m, name, fn)


def forward_args(description: str, recipes: str) -> argparse.ArgumentParser:
    """The options of a script that scores recipes' forward on the trained models with and without a change."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model", required=True)
    ap.add_argument("--recipes", default=recipes)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--calib-samples", type=int, default=8)
    ap.add_argument("--calib-seqlen", type=int, default=256)
    ap.add_argument("--out", required=True)
    return ap


def score_changed(args, changes) -> list[dict]:
    """For each of ``args.recipes``: the trained model quantized once, its forward perplexity on the references, and
    its difference in % under each context manager ``changes(model)`` yields (a row: recipe, ppl, delta_pct list)."""
    tok = load_tokenizer(args.model)
    ids = tok.encode(open(wikitext2_path(), encoding="utf-8").read())
    calib = load_calibration(None, args.calib_samples, args.calib_seqlen, 0, tok)
    rows = []
    for name in args.recipes.split(","):
        t0 = time.time()
        model = load_model(args.model, dtype=torch.float32, device="cpu").eval()
        recipe = get_recipe(name)
        quantize(model, recipe, calib if recipe.needs_calibration() else None, progress=False)
        ref = perplexity_of_ids(model, ids, args.seqlen, 1, args.limit, progress=False)["ppl"]
        moved = []
        for change in changes(model):
            with change:
                ppl = perplexity_of_ids(model, ids, args.seqlen, 1, args.limit, progress=False)["ppl"]
            moved.append(100 * (ppl / ref - 1))
        rows.append({"recipe": name, "ppl": ref, "delta_pct": moved})
        print(json.dumps(rows[-1]), f"{time.time() - t0:.0f} s", flush=True)
    return rows


def main() -> None:
    ap = forward_args(__doc__.splitlines()[0], ",".join(A8))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--ulps", type=float, default=1.0)
    args = ap.parse_args()
    rows = score_changed(args, lambda model: (jittered_quantizers(args.ulps, seed) for seed in range(args.seeds)))
    with open(args.out, "w") as fh:
        json.dump({"model": args.model, "seqlen": args.seqlen, "limit": args.limit, "ulps": args.ulps, "rows": rows},
                  fh, indent=1)


if __name__ == "__main__":
    main()
