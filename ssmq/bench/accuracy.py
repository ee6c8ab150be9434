"""``ssmq bench accuracy``: perplexity of a checkpoint in 16-bit and under each recipe, side by side, on one text
(WikiText-2 test by default). Each recipe quantizes a fresh copy of the model in memory; the calibration windows
are drawn with a fixed seed from ``--calib`` (default: the WikiText-2 train text of the data folder).

Paths: ``forward`` scores each window in one forward (prefill's kernels); ``decode`` feeds the same windows one
token a step through ``model.step`` and the cache (the decode kernels and the cache's state formats; its windows
are one batch). ``--against-reference`` scores each path twice on one loaded model, on the kernels and on the
``ssmq.ops`` references (``KernelPolicy(reference_ops=True)``), and reports their difference: what the kernels
change in the number the recipe is judged by."""

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

PATHS = ("forward", "decode")


def run(args) -> dict:
    from ssmq.eval.perplexity import wikitext2_path
    from ssmq.models.loading import resolve_model_path
    from ssmq.paths import default_model
    from ssmq.quant import get_recipe, load_calibration, load_model, quantize, save_quantized
    from ssmq.tokenizer import load_tokenizer

    device, dtype = device_and_dtype(args.device, args.dtype)
    paths, against = args.paths, args.against_reference
    bad = [p for p in paths if p not in PATHS]
    if bad:
        raise SSMQError(f"--paths: {', '.join(bad)} is not a path; choose from {', '.join(PATHS)}")
    if against and device.type != "cuda":
        raise SSMQError("--against-reference compares the GPU kernels with the references: it needs --device cuda "
                        "(on the CPU every op already is its reference)")
    path = resolve_model_path(args.model or default_model())
    tok = load_tokenizer(path)
    text_path = args.text or wikitext2_path()
    try:
        text = open(text_path, encoding="utf-8").read()
    except OSError as e:
        raise SSMQError(f"cannot read --text {text_path}: {e.strerror}") from None
    ids = tok.encode(text)
    result = record("accuracy", device, model=str(path), text=str(text_path), seqlen=args.seqlen, limit=args.limit,
                    dtype=str(dtype).removeprefix("torch."), paths=paths, against_reference=against)
    recipes = [get_recipe(r) if r != FLOAT else None for r in args.recipes]  # unknown names stop before any work
    calib = None
    base = {}
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
        for kind in paths:
            out = _score(model, kind, ids, args)
            base.setdefault(kind, out["ppl"])
            row = {"recipe": name, "path": kind, "ppl": out["ppl"], "delta_pct": 100 * (out["ppl"] / base[kind] - 1),
                   "windows": out["n_windows"]}
            if against:
                ref = _score(model, kind, ids, args, reference=True)
                row.update(ppl_reference=ref["ppl"], kernels_vs_reference_pct=100 * (out["ppl"] / ref["ppl"] - 1))
            result["rows"].append(row)
        del model
    if any(not math.isfinite(r["ppl"]) for r in result["rows"]):
        print("note: a perplexity is not finite", flush=True)
    columns = ["recipe", "path", "ppl", "delta_pct", "windows"]
    print(table(result["rows"], columns + (["ppl_reference", "kernels_vs_reference_pct"] if against else [])))
    for path_ in write(result, args.out, plot=_plot):
        print(f"wrote {path_}")
    return result


def _score(model, kind: str, ids: list[int], args, reference: bool = False) -> dict:
    """Perplexity of ``ids`` through ``kind`` (``PATHS``) on the kernels, or with ``reference`` on the references
    (the decode path's cache is allocated under that policy too, so its layer plans are the references')."""
    from ssmq.eval.perplexity import decode_perplexity_of_ids, perplexity_of_ids
    from ssmq.kernels.policy import active, using

    with using(active().with_changes(reference_ops=True) if reference else active()):
        if kind == "forward":
            return perplexity_of_ids(model, ids, args.seqlen, args.batch_size, args.limit, progress=False)
        return decode_perplexity_of_ids(model, ids, args.seqlen, args.limit, progress=False)


def _plot(pyplot, result):
    fig, ax = pyplot.subplots(figsize=(6, 4))
    several = len(result["paths"]) > 1
    ax.bar([f"{r['recipe']} ({r['path']})" if several else r["recipe"] for r in result["rows"]],
           [r["ppl"] for r in result["rows"]])
    ax.set_ylabel("perplexity")
    ax.set_title(f"ssmq bench accuracy - {result['gpu']}", fontsize=9)
    ax.tick_params(axis="x", labelrotation=30, labelsize=7)
    return fig
