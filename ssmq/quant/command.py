"""``ssmq quantize``: load a float model, apply a recipe, write a quantized checkpoint folder."""

from __future__ import annotations

import argparse
from pathlib import Path

from ssmq.errors import SSMQError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def register(subparsers) -> None:
    from ssmq.cli import add_model_args
    from ssmq.quant.recipe import RECIPES

    p = subparsers.add_parser("quantize", help="quantize a model by a recipe and save it (safetensors + quantization.json)",
                              formatter_class=argparse.RawDescriptionHelpFormatter,
                              epilog="recipes:\n" + "\n".join(f"  {n:<18} {getattr(r, 'description', '')}"
                                                              for n, r in RECIPES.items()))
    add_model_args(p)
    p.add_argument("--recipe", required=True, help="a recipe name (below) or a recipe JSON file")
    p.add_argument("--out", required=True, help="output folder (must not exist unless --overwrite)")
    p.add_argument("--calib", default=None, help="calibration text (.txt/.txt.gz, or a name in ../shared/data/train/; "
                   "default wikitext2_train.txt.gz)")
    p.add_argument("--calib-samples", type=int, default=512, help="calibration windows (default 512)")
    p.add_argument("--calib-seqlen", type=int, default=512, help="tokens per window (default 512)")
    p.add_argument("--calib-seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=8, help="calibration windows per forward")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists (atomically)")
    p.set_defaults(func=run)


def run(args) -> None:
    from ssmq.cli import load_from_args
    from ssmq.quant.api import check_any_recipe, needs_calibration, quantize
    from ssmq.quant.recipe import get_recipe
    from ssmq.quant.calibration import load_calibration
    from ssmq.quant.checkpoint import save_quantized

    recipe = get_recipe(args.recipe)
    out = Path(args.out)
    if out.exists() and not args.overwrite:
        raise SSMQError(f"output folder {out} already exists (pass --overwrite to replace it)")
    model, tok, path = load_from_args(args)
    check_any_recipe(recipe, model)  # before the (slow) calibration data
    calib = None
    if needs_calibration(recipe):
        calib = load_calibration(args.calib, args.calib_samples, args.calib_seqlen, args.calib_seed, tok)
    quantize(model, recipe, calib, batch_size=args.batch_size)
    extra = [Path(path) / f for f in TOKENIZER_FILES if (Path(path) / f).is_file()]
    save_quantized(model, out, extra_files=extra, overwrite=args.overwrite)
    n = len([m for m in model.modules() if hasattr(m, "wspec")])
    print(f"quantized {n} modules with {recipe.name} -> {out}")
