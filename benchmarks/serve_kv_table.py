"""Serving at equal KV memory: the table and plot of several ``bench_serve.py --kv-cache-memory`` runs, one KV
format each (their serve.json files), side by side.

    python benchmarks/serve_kv_table.py benchmarks/results/serve_kv_h200/serve_{fp16,nuq4-1pct,nuq3-1pct}.json \
        --out benchmarks/results/serve_kv_h200/serve_kv
writes OUT.md and OUT.png: KV bytes a token, blocks, sequences at once, and the one load level each run measured.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plotting import pyplot  # noqa: E402


def rows(paths: list[str]) -> list[dict]:
    out = []
    for p in paths:
        d = json.loads(Path(p).read_text())
        if len(d["levels"]) != 1:
            raise SystemExit(f"{p}: {len(d['levels'])} load levels; this table compares runs of one level each")
        out.append({"kv": d["kv"] or "float16", "blocks": d["kv_blocks"], "block_size": d["kv_block_size"],
                    "seqs": d["kv_sequences_at_once"], "gib": d["kv_cache_gib"], "device": d["device"],
                    **d["levels"][0]})
    return out


def markdown(rs: list[dict]) -> str:
    base = rs[0]["throughput_tok_s"]
    lines = [f"{rs[0]['device']}, {rs[0]['gib']} GiB of KV, {rs[0]['concurrency']} clients", "",
             f"| KV format | blocks of {rs[0]['block_size']} | sequences at once | throughput tok/s | vs {rs[0]['kv']} "
             "| TTFT p50 / p99 s | TPOT p50 / p99 ms |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rs:
        lines.append(f"| {r['kv']} | {r['blocks']} | {r['seqs']} | {r['throughput_tok_s']:.0f} | "
                     f"{r['throughput_tok_s'] / base:.2f}x | {r['ttft_ms_p50'] / 1e3:.1f} / {r['ttft_ms_p99'] / 1e3:.1f} | "
                     f"{r['tpot_ms_p50']:.1f} / {r['tpot_ms_p99']:.1f} |")
    return "\n".join(lines) + "\n"


def plot(rs: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    names = [r["kv"] for r in rs]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, key, label in ((axes[0], "seqs", "sequences at once"), (axes[1], "throughput_tok_s", "tokens/s"),
                           (axes[2], "ttft_ms_p50", "TTFT p50 (ms)")):
        ax.bar(names, [r[key] for r in rs], color=["0.5", "C0", "C1", "C2", "C3"][:len(rs)])
        ax.set_title(label)
    fig.suptitle(f"ssmq serve at equal KV memory ({rs[0]['gib']} GiB, {rs[0]['device']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="serve.json of each run; the first is the baseline")
    ap.add_argument("--out", required=True, help="path prefix of OUT.md and OUT.png")
    args = ap.parse_args()
    rs = rows(args.runs)
    md = markdown(rs)
    Path(args.out + ".md").write_text(md)
    plot(rs, Path(args.out + ".png"))
    print(md)


if __name__ == "__main__":
    main()
