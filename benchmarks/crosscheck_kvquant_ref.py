"""Our KVQuant against the KVQuant authors' own quantizer code, on the same model, windows and calibration (CPU).

    git clone https://github.com/SqueezeAILab/KVQuant /path/to/KVQuant   # not vendored: only imported from there
    python benchmarks/crosscheck_kvquant_ref.py --ref /path/to/KVQuant --model smollm2 [--windows 64]

Is a perplexity gap ours or the model's? The reference side runs the paper's simulated quantization from
``quant/kvquant/simquant_module_quantizer.py`` of that checkout (its functions called as its ``QuantLinearSim``
calls them, its ``SimQuant`` calibration, scikit-learn's k-means) on the transformers model (SmolLM2 from the GGUF,
our hybrid as ``BambaForCausalLM``): keys per channel before RoPE with offline thresholds, values per token (over
all kv heads, as its v_proj rows are) with online thresholds, 1% dense-and-sparse outliers
(``--sparsity-threshold 0.99``), Fisher-weighted nuq codebooks from the squared gradients of the k_proj / v_proj
outputs (as its ``gradients/run-fisher.py``: the causal-LM loss over the calibration windows), the first token in
float (``--first_few_fp16 1``). Its k_proj / v_proj run in float32 here (the forward hooks replace their outputs),
not in float16 as in its ``QuantLinearSim``, so the two sides differ only by the quantizer.

Our side is run_kvquant_table.py's ``evaluate`` on ssmq's own model with the same presets. Both calibrate on the
same windows: --calib-samples (16) of --calib-seqlen (2048: the reference's calibration marks each window's first
token at multiples of 2048, so other lengths would mark the wrong tokens) tokens of WikiText-2 train, seed 0.
Evaluation: the tables' first windows (SmolLM2 8 x 512, hybrid 16 x 1024) or --windows N spread over the test set.
Writes ``crosscheck_<model>.{json,md}`` to --out.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import time
from pathlib import Path

import torch

from run_kvquant_table import MODELS, WINDOWS, evaluate, load_calibrated, spec_of, spread_windows

from ssmq.eval.perplexity import perplexity_of_ids, wikitext2_path
from ssmq.models.loading import resolve_model_path
from ssmq.paths import shared_path

# row -> (bits, nuq) of the reference; every row with 1% outliers and the float first token
ROWS = {"kvquant-nuq4-1%": (4, True), "kvquant-nuq3-1%": (3, True), "kvquant-int3-1%": (3, False)}
SPARSITY, FIRST_FEW = 0.99, 1


def load_reference(ref: Path):
    path = ref / "quant" / "kvquant" / "simquant_module_quantizer.py"
    if not path.is_file():
        raise SystemExit(f"crosscheck: {path} not found; --ref must be a checkout of SqueezeAILab/KVQuant")
    spec = importlib.util.spec_from_file_location("kvquant_reference", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load_hf(name: str):
    """The transformers model (float32, eval) of a name of MODELS."""
    from transformers import AutoModelForCausalLM

    where = resolve_model_path(MODELS[name] or shared_path("models", name))
    kw = dict(gguf_file=where.name) if where.suffix == ".gguf" else {}
    model = AutoModelForCausalLM.from_pretrained(str(where.parent if kw else where), dtype=torch.float32, **kw)
    return model.eval()


def kv_projections(model) -> list[tuple[torch.nn.Linear, torch.nn.Linear]]:
    """(k_proj, v_proj) of every attention layer, in order."""
    return [(m.k_proj, m.v_proj) for m in model.modules() if hasattr(m, "k_proj") and hasattr(m, "v_proj")]


def capture(model, calib: torch.Tensor):
    """Per layer and side, the projections' outputs and their squared gradients of the causal-LM loss, one window
    at a time: lists of (1, l, hkv * e) tensors (the reference's add_batch shape and Fisher layout)."""
    projs = kv_projections(model)
    outs = {(i, s): [] for i in range(len(projs)) for s in "kv"}
    grads = {key: [] for key in outs}
    live = {}

    def hook(key):
        def fn(mod, inp, out):
            out.retain_grad()
            live[key] = out
        return fn

    handles = [p.register_forward_hook(hook((i, s))) for i, pair in enumerate(projs) for s, p in zip("kv", pair)]
    try:
        for x in calib:
            live.clear()
            model.zero_grad(set_to_none=True)
            model(input_ids=x[None], labels=x[None]).loss.backward()
            for key, out in live.items():
                outs[key].append(out.detach().float())
                grads[key].append(out.grad.float().square())
    finally:
        for h in handles:
            h.remove()
    model.zero_grad(set_to_none=True)
    return outs, grads


def calibrate(ref, model, outs, grads, bits: int, nuq: bool) -> dict:
    """The reference's SimQuant per layer and side: keys per channel (qchannel 0), values per token (-1)."""
    quantizers = {}
    for i, (kp, vp) in enumerate(kv_projections(model)):
        for side, proj, qchannel in (("k", kp, 0), ("v", vp, -1)):
            sq = ref.SimQuant(proj, bits, perchannel=True, qchannel=qchannel)
            for out in outs[(i, side)]:
                sq.add_batch(None, out)
            fisher = torch.cat(grads[(i, side)], dim=1) if nuq else None
            quantizers[(i, side)] = sq.quantize(include_sparse=True, sparsity_threshold=SPARSITY, nuq=nuq,
                                                fisher=fisher, cap_outliers=False, first_few_fp16=FIRST_FEW)
            sq.free()
    return quantizers


def install(ref, model, quantizers: dict, bits: int, nuq: bool) -> list:
    """Forward hooks replacing each k_proj / v_proj output by the reference's simulated quantization of it, as its
    QuantLinearSim.forward does (keys: static per-channel thresholds; values: dynamic per token). Batch 1 only:
    the first-token rows are those of the flattened (tokens, channels) matrix."""
    def hook(q, per_channel):
        upper, lower = (torch.as_tensor(t).float().flatten() for t in q[:2])

        def fn(mod, inp, out):
            if out.shape[0] != 1:
                raise ValueError("crosscheck: the reference's first-token rows need batch 1")
            y = out.reshape(-1, out.shape[-1]).float()
            if per_channel:
                mask = ref.get_outliers(y, channel=0, outlier_threshold_upper=upper, outlier_threshold_lower=lower,
                                        cap_outliers=-1, first_few_fp16=FIRST_FEW)
            else:
                mask = ref.get_outliers_dynamic(y, channel=-1, thresh=SPARSITY, first_few_fp16=FIRST_FEW)
            kw = dict(bits=bits, qchannel=0 if per_channel else -1, dynamicquantization=not per_channel,
                      include_sparse=True, outlier_mask=mask, maxval=upper, minval=lower)
            if nuq:
                y = ref.quant_fn_nuq_recon(y, lut=q[2], first_few_fp16=FIRST_FEW, **kw)
            else:  # its integer path has no first-token option: put the first token back as its nuq path does
                y = torch.cat([y[:FIRST_FEW], ref.quant_fn_zp(y, **kw)[FIRST_FEW:]])
            return y.reshape(out.shape).to(out.dtype)
        return fn

    handles = []
    for i, (kp, vp) in enumerate(kv_projections(model)):
        handles.append(kp.register_forward_hook(hook(quantizers[(i, "k")], True)))
        handles.append(vp.register_forward_hook(hook(quantizers[(i, "v")], False)))
    return handles


class Logits(torch.nn.Module):
    """A transformers causal LM as perplexity_of_ids takes a model: input ids (b, l) -> logits (b, l, V)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(input_ids=x).logits


def hf_perplexity(model, ids: list[int], seqlen: int, limit: int) -> float:
    """ssmq's perplexity_of_ids over the transformers model, batch 1 (the reference's first-token rows)."""
    return perplexity_of_ids(Logits(model), ids, seqlen, 1, limit, progress=False)["ppl"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ref", type=Path, required=True, help="a checkout of github.com/SqueezeAILab/KVQuant")
    ap.add_argument("--model", default="smollm2", choices=list(WINDOWS))
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    ap.add_argument("--calib-samples", type=int, default=16)
    ap.add_argument("--calib-seqlen", type=int, default=2048)
    ap.add_argument("--windows", type=int, default=0, help="this many windows spread over the test set (0: the "
                    "tables' first windows)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args()
    if args.calib_seqlen != 2048:
        raise SystemExit("crosscheck: the reference marks first tokens at multiples of 2048: --calib-seqlen 2048")
    ref = load_reference(args.ref)
    torch.manual_seed(0)

    _, tok, calib, formats = load_calibrated(args.model, args.calib_samples, args.calib_seqlen)
    limit, seqlen = WINDOWS[args.model]
    ids = tok.encode(wikitext2_path("test").read_text(encoding="utf-8"))
    if args.windows:
        ids, limit = spread_windows(ids, seqlen, args.windows)
    where = f"{limit} windows x {seqlen} tokens" + (" spread over the test set" if args.windows else " (first)")
    print(f"{args.model}: {where}; calibration {args.calib_samples} x {args.calib_seqlen} (seed 0)", flush=True)

    hf = load_hf(args.model)
    t = time.time()
    outs, grads = capture(hf, calib)
    print(f"reference: captured K / V and gradients in {time.time() - t:.0f} s", flush=True)

    rows = []
    base_ours = evaluate(formats, None, ids, seqlen, limit, 2)["ppl"]
    base_ref = hf_perplexity(hf, ids, seqlen, limit)
    rows.append({"row": "float KV", "ssmq": base_ours, "reference": base_ref})
    print(f"float KV  ssmq {base_ours:.4f}  transformers {base_ref:.4f}", flush=True)
    for name in args.rows:
        bits, nuq = ROWS[name]
        mine = evaluate(formats, spec_of(name), ids, seqlen, limit, 2)["ppl"]
        t = time.time()
        quantizers = calibrate(ref, hf, outs, grads, bits, nuq)
        handles = install(ref, hf, quantizers, bits, nuq)
        try:
            theirs = hf_perplexity(hf, ids, seqlen, limit)
        finally:
            for h in handles:
                h.remove()
        rows.append({"row": name, "ssmq": mine, "reference": theirs})
        print(f"{name:18s} ssmq {mine:.4f} ({mine - base_ours:+.3f})  reference {theirs:.4f} "
              f"({theirs - base_ref:+.3f})  [{time.time() - t:.0f} s]", flush=True)

    result = {"model": args.model, "eval": where, "calibration": f"{args.calib_samples} x {args.calib_seqlen} "
              "WikiText-2 train, seed 0", "ref": str(args.ref), "date": datetime.date.today().isoformat(),
              "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"crosscheck_{args.model}{'_wide' if args.windows else ''}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    lines = [f"{args.model}, {where}; calibration {result['calibration']}; {result['date']}.", "",
             "| KV format | ssmq | Δ | KVQuant reference code | Δ |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        d1, d2 = r["ssmq"] - base_ours, r["reference"] - base_ref
        lines.append(f"| {r['row']} | {r['ssmq']:.3f} | {d1:+.3f} | {r['reference']:.3f} | {d2:+.3f} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
