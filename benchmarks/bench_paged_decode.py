"""Decode attention over the paged KV cache of ``ssmq serve`` (``ssmq.models.paged_kv``, ``ssmq.models.quant_kv``):
the flash-decoding kernel reading the blocks in place through the block table, against the same kernel over a
gathered copy of the rows' blocks (float16: ``PagedKVState.decode`` before 2026-11-28; quantized: what the dispatch
does for the formats the fast kernel does not take) and over a contiguous cache of the same contents.

One attention layer of Llama-3.1-8B's shape (32 query / 8 KV heads x 128), blocks of --block-size tokens (the
engine's default, 32 since 2026-11-28) shuffled in the pool, every row at --context tokens; --formats: fp16 and
KVQuant codes (``BITS`` or ``BITS-1%``: random codes, codebooks, scales and 1% outlier slots, as
``bench_kvquant.quant_cache``; per-channel keys, per-token values, one sink token). ms per call as CUDA-graph
replays with the L2 flushed (``bench_kvquant.timeit``); bytes per token of the layer's cache; KVQuant: the peak of
a paged call's transient memory. JSON and a PNG (in place / contiguous) to --out.

    python benchmarks/bench_paged_decode.py --cases 1:32768,1:131072,8:32768 --formats fp16,4,4-1%,3-1% --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kvquant import ONE_PCT, nbytes, quant_cache, timeit  # noqa: E402
from plotting import pyplot  # noqa: E402

from ssmq import kernels  # noqa: E402

HQ, HKV, E = 32, 8, 128


def quant_case(rows: int, context: int, block: int, fmt: str, capacity: int = 0) -> dict:
    """A KVQuant format ``fmt`` (module docstring), paged / gathered / contiguous, and its max difference; the
    paged call's peak of transient GPU memory. ``capacity`` > context: the block table has room for that many
    tokens a row (a serving slot of --max-model-len), its entries past the row's blocks at the null block."""
    m = -(-context // block)
    gen = torch.Generator(device="cuda").manual_seed(0)
    bits, outliers = int(fmt.split("-")[0]), fmt.endswith("-1%")
    k, v = quant_cache(rows, m * block, *(ONE_PCT if outliers else (0, 0)), gen, bits)
    table = (1 + torch.randperm(rows * m, device="cuda", generator=gen)).view(rows, m)
    kp, vp = k.paged(table, block), v.paged(table, block)
    if capacity > context:
        table = torch.cat([table, table.new_zeros(rows, -(-capacity // block) - m)], 1)
    q = torch.randn(rows, HQ, E, device="cuda", dtype=torch.float16)
    slots = torch.arange(rows, device="cuda")
    lens = torch.full((rows,), context, device="cuda")
    paged = lambda: kernels.quant_kv_decode(q, slots, lens, kp, vp, E, 5e5, block_table=table)  # noqa: E731
    contiguous = lambda: kernels.quant_kv_decode(q, slots, lens, k, v, E, 5e5)  # noqa: E731

    def gathered():
        return kernels.quant_kv_decode(q, slots, lens, kp.gathered(table, slots), vp.gathered(table, slots), E, 5e5)

    r = {"format": fmt, "batch": rows, "context": context, "block": block, "capacity": table.shape[1] * block,
         "in place ms": timeit(paged), "gathered copy ms": timeit(gathered), "contiguous ms": timeit(contiguous),
         "bytes/token": nbytes(k, v) / (rows * m * block)}
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    paged()
    r["in place peak MiB"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20  # its workspaces and output
    r["max |in place - contiguous|"] = (paged() - contiguous()).abs().max().item()
    return r


def case(rows: int, context: int, block: int) -> dict:
    m = -(-context // block)
    gen = torch.Generator(device="cuda").manual_seed(0)
    pool = [torch.randn(1 + rows * m, block, HKV, E, device="cuda", dtype=torch.float16, generator=gen)
            for _ in range(2)]
    table = (1 + torch.randperm(rows * m, device="cuda", generator=gen)).view(rows, m)
    dense = [p[table].flatten(1, 2) for p in pool]  # the same contents, each row contiguous
    q = torch.randn(rows, HQ, E, device="cuda", dtype=torch.float16)
    slots = torch.arange(rows, device="cuda")
    lens = torch.full((rows,), context, device="cuda")

    def gathered():  # the former path: the rows' blocks copied out, then the kernel over the copy
        k, v = (p[table[slots]].flatten(1, 2) for p in pool)
        return kernels.float_kv_decode(q, slots, lens, k, v)

    r = {"format": "fp16", "batch": rows, "context": context, "block": block, "bytes/token": 2 * HKV * E * 2,
         "in place ms": timeit(lambda: kernels.float_kv_decode(q, slots, lens, *pool, block_table=table)),
         "gathered copy ms": timeit(gathered),
         "contiguous ms": timeit(lambda: kernels.float_kv_decode(q, slots, lens, *dense))}
    got = kernels.float_kv_decode(q, slots, lens, *pool, block_table=table)
    r["max |in place - contiguous|"] = (got - kernels.float_kv_decode(q, slots, lens, *dense)).abs().max().item()
    return r


def plot(runs: dict[int, list[dict]], path: Path, device: str) -> None:
    """In place / contiguous per format and shape, one group of bars a block size (``runs``: block size → rows)."""
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(9, 4))
    rows = next(iter(runs.values()))
    labels = [f"{r['format']}\n{r['batch']}x{r['context'] // 1024}K" for r in rows]
    width = 0.8 / len(runs)
    for k, (bs, rs) in enumerate(sorted(runs.items())):
        ax.bar([i + k * width for i in range(len(rs))], [r["in place ms"] / r["contiguous ms"] for r in rs], width,
               label=f"blocks of {bs}")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([i + width * (len(runs) - 1) / 2 for i in range(len(labels))], labels, fontsize=6)
    ax.set_ylabel("in place / contiguous cache (time)")
    ax.set_ylim(0.9, max(r["in place ms"] / r["contiguous ms"] for rs in runs.values() for r in rs) + 0.05)
    ax.set_title(f"Paged KV decode, one layer of {HQ} q / {HKV} kv heads x {E}, {device}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="1:32768,1:131072,8:32768",
                    help="BATCH:CONTEXT[:CAPACITY],... (CAPACITY: KVQuant formats, a table of that many tokens a row)")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--formats", default="fp16", help="fp16 and KVQuant BITS[-1%%], comma-separated")
    ap.add_argument("--out", default=os.environ.get("OUT", "out/paged_decode"))
    ap.add_argument("--plot", nargs="+", metavar="JSON", help="no run: plot these runs' paged_decode.json (one a "
                    "block size) to --out/paged_decode.png")
    args = ap.parse_args()
    if args.plot:
        runs, devices = {}, set()
        for f in args.plot:
            d = json.loads(Path(f).read_text())
            runs[d["rows"][0]["block"]] = d["rows"]
            devices.add(d.get("meta", {}).get("device", "GPU"))
        Path(args.out).mkdir(parents=True, exist_ok=True)
        plot(runs, Path(args.out) / "paged_decode.png", " / ".join(sorted(devices)))
        return
    rows = []
    for c in args.cases.split(","):
        b, n, *cap = (int(x) for x in c.split(":"))
        for fmt in args.formats.split(","):
            rows.append(case(b, n, args.block_size) if fmt == "fp16" else
                        quant_case(b, n, args.block_size, fmt, *cap))
            print(json.dumps(rows[-1]), flush=True)
            torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "paged_decode.json").write_text(json.dumps({"meta": {"device": torch.cuda.get_device_name()},
                                                       "rows": rows}, indent=1))
    plot({args.block_size: rows}, out / "paged_decode.png", torch.cuda.get_device_name())
    print("| format | bytes / token | batch | context | in place | gathered copy | contiguous | peak MiB |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['format']} | {r['bytes/token']:.0f} | {r['batch']} | {r['context']} | {r['in place ms']:.3f} | "
              f"{r['gathered copy ms']:.3f} | {r['contiguous ms']:.3f} | {r.get('in place peak MiB', 0):.1f} |")


if __name__ == "__main__":
    main()
