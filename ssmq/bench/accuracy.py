"""``ssmq bench accuracy``: perplexity of a checkpoint in 16-bit and under each recipe, side by side, on one text
(WikiText-2 test by default). Each recipe quantizes a fresh copy of the model in memory; the calibration windows
are drawn with a fixed seed from ``--calib`` (default: the WikiText-2 train text of the data folder)."""

from __future__ import annotations

import gc
import math
import tempfile
from pathlib import Path

import torch
from tqdm import tqdm

from ssmq.bench.models import FLOAT, device_and_dtype
from ssmq.bench.output import record, table, write
from ssmq.errors import SSMQError


def run(args) -> dict:
    from ssmq.eval.perplexity import perplexity_of_ids, wikitext2_path
    from ssmq.models.loading import resolve_model_path
    from ssmq.paths import default_model
    from ssmq.quant import get_recipe, load_calibration, load_model, quantize, save_quantized
    from ssmq.tokenizer import load_tokenizer

    device, dtype = device_and_dtype(args.device, args.dtype)
    path = resolve_model_path(args.model or default_model())
    tok = load_tokenizer(path)
    text_path = args.text or wikitext2_path()
    try:
        text = open(text_path, encoding="utf-8").read()
    except OSError as e:
        raise SSMQError(f"cannot read --text {text_path}: {e.strerror}") from None
    ids = tok.encode(text)
    result = record("accuracy", device, model=str(path), text=str(text_path), seqlen=args.seqlen, limit=args.limit,
                    dtype=str(dtype).removeprefix("torch."))
    recipes = [get_recipe(r) if r != FLOAT else None for r in args.recipes]  # unknown names stop before any work
    calib = None
    base = None
    for name, recipe in tqdm(list(zip(args.recipes, recipes)), desc="accuracy", unit="recipe"):
        gc.collect()
        # quantized from float32 weights, as `ssmq quantize` does
        model = load_model(path, dtype=torch.float32 if recipe is not None else dtype, device=str(device)).eval()
        if recipe is not None:
            if recipe.needs_calibration() and calib is None:
                calib = load_calibration(args.calib, args.calib_samples, args.calib_seqlen, 0, tok)
            quantize(model, recipe, calib if recipe.needs_calibration() else None, progress=False)
            with tempfile.TemporaryDirectory() as tmp:  # loaded back as `ssmq eval` loads a quantized folder
                save_quantized(model, Path(tmp) / "q")
                del model
                model = load_model(Path(tmp) / "q", dtype=dtype, device=str(device)).eval()
        out = perplexity_of_ids(model, ids, args.seqlen, args.batch_size, args.limit, progress=False)
        ppl = out["ppl"]
        base = ppl if base is None else base
        result["rows"].append({"recipe": name, "ppl": ppl, "delta_pct": 100 * (ppl / base - 1),
                               "windows": out.get("n_windows")})
        del model
    if any(not math.isfinite(r["ppl"]) for r in result["rows"]):
        print("note: a perplexity is not finite", flush=True)
    print(table(result["rows"], ["recipe", "ppl", "delta_pct", "windows"]))
    for path_ in write(result, args.out, plot=_plot):
        print(f"wrote {path_}")
    return result


def _plot(pyplot, result):
    fig, ax = pyplot.subplots(figsize=(6, 4))
    ax.bar([r["recipe"] for r in result["rows"]], [r["ppl"] for r in result["rows"]])
    ax.set_ylabel("perplexity")
    ax.set_title(f"ssmq bench accuracy - {result['gpu']}", fontsize=9)
    ax.tick_params(axis="x", labelrotation=30, labelsize=7)
    return fig
