"""Passkey retrieval with a quantized KV cache on SmolLM2-135M (CPU), decoding THROUGH the cache.

    python benchmarks/run_passkey.py --lengths 1024 2048 --seeds 0 1 2 3 --out results/passkey
    python benchmarks/run_passkey.py --lengths 4096 --seeds 0 1 --out results/passkey   # adds to the same json
    python benchmarks/run_passkey.py --margins --formats float kvquant-nuq4-1% kvquant-nuq3-1% --out results/passkey

Same formats as run_kvquant_table.py's long table (float KV, KVQuant nuq4-1% / nuq3-1% / int4, int4 per
token-head, fp8 e4m3), calibrated the same way (``load_calibrated``: 16 x 512 WikiText-2 train windows, one
gradient pass). Each trial (``ssmq.eval.passkey``): a 5-digit key at a seeded random depth in filler text of exactly
N tokens, greedy decode of 8 tokens through ``model.allocate_cache`` (a ``QuantKVState`` per attention layer for a
quantized format: prefill writes codes, every decode step reads them back; eager ``model.step``). Success: the
key's digits appear in the output. Rows already in --out's passkey.json are kept and skipped (a cut run resumes).
Writes passkey.json after every trial and passkey.md (successes / trials per format and length).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
from pathlib import Path

import torch

from run_kvquant_table import load_calibrated, long_rows, spec_of
from ssmq.eval.passkey import run_passkey


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "hybrid"])
    ap.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048, 4096])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3])
    ap.add_argument("--formats", nargs="+", default=None,
                    help="presets to run (float for float KV); default: run_kvquant_table's long rows")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--calib-samples", type=int, default=16)
    ap.add_argument("--calib-seqlen", type=int, default=512)
    ap.add_argument("--out", default="results/passkey")
    ap.add_argument("--margins", action="store_true",
                    help="no decode: each trial's answer margin, logit of the key's first token minus the largest "
                         "other logit after the prompt (prefilled through the cache), to passkey_margins.json")
    args = ap.parse_args()

    rows = [(label, x) for label, x in long_rows() if args.formats is None or (x or "float") in args.formats]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "passkey.json"
    result = json.loads(path.read_text()) if path.exists() else {"trials": []}
    result.update(model=args.model, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  machine=f"CPU ({platform.processor() or platform.machine()}), torch {torch.__version__}, "
                          f"{torch.get_num_threads()} thread(s), float32",
                  calibration=f"{args.calib_samples} windows x {args.calib_seqlen} tokens of WikiText-2 train, seed 0",
                  decode=f"greedy, {args.max_new_tokens} new tokens, through the (quantized) KV cache, eager")
    done = {(t["format"], t["n_tokens"], t["seed"]) for t in result["trials"]}

    model, tok, _, formats = load_calibrated(args.model, args.calib_samples, args.calib_seqlen)
    if args.margins:
        return margins(model, tok, formats, rows, args, out)
    for n in args.lengths:  # length outermost: a cut run has every format at the shorter lengths
        for label, x in rows:
            seeds = [s for s in args.seeds if (label, n, s) not in done]
            if not seeds:
                continue
            formats.use(spec_of(x))
            state = type(model.allocate_cache(1, 1).states[0]).__name__  # QuantKVState for a quantized format

            def keep(row, label=label, x=x, state=state):
                result["trials"].append({"format": label, "preset": x, "cache_state": state, **row})
                path.write_text(json.dumps(result, indent=2))
                print(f"{n:6d} {label:32s} seed {row['seed']} key {row['key']} -> {row['output']!r} "
                      f"{'OK' if row['success'] else 'MISS'} ({row['seconds']} s)", flush=True)

            run_passkey(model, tok, [n], seeds, args.max_new_tokens, on_row=keep)
    (out / "passkey.md").write_text(markdown(result))
    print((out / "passkey.md").read_text())


@torch.no_grad()
def margins(model, tok, formats, rows, args, out: Path) -> None:
    """How close each trial is to a miss: the prompt prefilled through the (quantized) cache, then logit of the
    key's first token minus the largest other logit (> 0: greedy starts the key; the misses start " the pass key"
    instead). Prints a table a length: seeds across, formats down."""
    from ssmq.eval.passkey import build_prompt

    path = out / "passkey_margins.json"
    result = json.loads(path.read_text()) if path.exists() else {"trials": []}
    done = {(t["format"], t["n_tokens"], t["seed"]) for t in result["trials"]}
    for n in args.lengths:
        for label, x in rows:
            formats.use(spec_of(x))
            for seed in args.seeds:
                if (label, n, seed) in done:
                    continue
                p = build_prompt(tok, n, seed)
                first = tok.encode(" " + p.key)[0]
                cache = model.allocate_cache(1, n + 1)
                logits = model(torch.tensor([p.ids]), cache)[0, -1].float()
                other = logits.clone()
                other[first] = float("-inf")
                top = int(logits.argmax())
                result["trials"].append({"format": label, "n_tokens": n, "seed": seed, "key": p.key,
                                         "margin": round(float(logits[first] - other.max()), 3),
                                         "top": tok.decode([top])})
                path.write_text(json.dumps(result, indent=2))
                print(f"{n:6d} {label:32s} seed {seed} margin {result['trials'][-1]['margin']:+.3f} "
                      f"top {tok.decode([top])!r}", flush=True)
    for n in args.lengths:
        got = {(t["format"], t["seed"]): t["margin"] for t in result["trials"] if t["n_tokens"] == n}
        print(f"\n{n} tokens | " + " | ".join(f"seed {s}" for s in args.seeds))
        for label, _ in rows:
            print(f"{label} | " + " | ".join(f"{got.get((label, s), float('nan')):+.2f}" for s in args.seeds))


def markdown(result: dict) -> str:
    """Successes / trials per format (rows, in run order) and prompt length (columns)."""
    lengths = sorted({t["n_tokens"] for t in result["trials"]})
    grid: dict[str, dict[int, list[bool]]] = {}
    for t in result["trials"]:
        grid.setdefault(t["format"], {}).setdefault(t["n_tokens"], []).append(t["success"])
    lines = [f"Passkey retrieval, {result['model']}; {result['decode']}; calibration {result['calibration']}; "
             f"{result['machine']}; {result['date']}.", "",
             "| KV format | " + " | ".join(f"{n} tokens" for n in lengths) + " |", "|---|" + "---|" * len(lengths)]
    for label, by in grid.items():
        cells = [f"{sum(by[n])}/{len(by[n])}" if n in by else "—" for n in lengths]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
