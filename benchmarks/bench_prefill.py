"""Chunked prefill over a long KV cache: the attention of each chunk over the prefix before it, float16 and KVQuant.

Two parts (``--parts``):

``layer``: one attention layer of Llama-3.1-8B's shape (32 query / 8 KV heads x 128), the last chunk of a prompt
(--chunk queries over a prefix of --prompt tokens, random contents): ms of ``kernels.prefill_attention`` against
``attention_ref`` (the path before 2026-11-28) and torch's ``scaled_dot_product_attention`` (flash, causal from
the lower right, GQA), and for KVQuant formats the read of the cache, ``kernels.quant_kv_read`` against the
reference's; the hardware limit of the attention, 4·lq·lk·hq·e FLOP at the GPU's dense float16 peak (--peak-tflops).

``sweep``: ``kernels.kv_read``'s outlier pass's launch settings (tokens a program, warps) at --prompt tokens, keys
and values apart, against a copy of the bytes the read writes.

``serve``: the same model in ``ssmq serve``'s runner (paged cache, prefill from CUDA graphs, which read the cache
at its whole capacity, --max-model-len), one prompt prefilled in chunks of --chunk: seconds a KV format.

``model``: a whole Llama-3.1-8B (random weights, float16), one prompt of --prompt tokens prefilled in chunks of
--chunk (``ssmq serve``'s --prefill-tokens) into its cache, eager: seconds for the whole prompt (time to first token
without the queue) a KV format (fp16, or a preset with placeholder quantizers, written by the fused append).

    python benchmarks/bench_prefill.py --prompt 16384 --chunk 512 --kv fp16,nuq4-1%,nuq3-1% --out DIR

Prints a JSON line a row; writes prefill.json, prefill.md and prefill.png to --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kvquant import ONE_PCT, quant_cache, timeit  # noqa: E402
from bench_kv_e2e import set_kv  # noqa: E402
from plotting import pyplot  # noqa: E402
from published_configs import PUBLISHED  # noqa: E402
from random_model import random_model  # noqa: E402

from ssmq import kernels, ops  # noqa: E402

HQ, HKV, E = 32, 8, 128


def sdpa(q, k, v):
    """torch's SDPA for one row whose chunk ends its keys (causal from the lower right), GQA."""
    from torch.nn.attention.bias import causal_lower_right

    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    mask = causal_lower_right(q.shape[1], k.shape[1])
    return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=True).transpose(1, 2)


def layer_rows(prompt: int, chunk: int, kvs: list[str], peak_tflops: float) -> list[dict]:
    from ssmq.ops.kv_quant import quant_kv_read_ref  # here: the model part also runs on trees without it

    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, chunk, HQ, E, device="cuda", dtype=torch.float16, generator=gen)
    k, v = (torch.randn(1, prompt, HKV, E, device="cuda", dtype=torch.float16, generator=gen) for _ in range(2))
    lens = torch.tensor([prompt], device="cuda")
    flop = 4 * chunk * prompt * HQ * E
    row = {"part": "layer", "prompt": prompt, "chunk": chunk, "limit ms": flop / (peak_tflops * 1e9),
           "kernel ms": timeit(lambda: kernels.prefill_attention(q, k, v, lens), flush_l2=False),
           "reference ms": timeit(lambda: ops.attention_ref(q, k, v, lens), graph=False, flush_l2=False)}
    try:
        row["sdpa ms"] = timeit(lambda: sdpa(q, k, v), flush_l2=False)
        row["max |kernel - sdpa|"] = (kernels.prefill_attention(q, k, v, lens) - sdpa(q, k, v)).abs().max().item()
    except RuntimeError as e:  # no SDPA backend for these arguments: say so
        row["sdpa error"] = str(e)[:200]
    rows = [row]
    print(json.dumps(row), flush=True)
    slots = torch.arange(1, device="cuda")
    for kv in kvs:
        if kv == "fp16":
            continue
        bits, outliers = int(kv.removeprefix("nuq").split("-")[0]), kv.endswith("-1%")
        ks, vs = quant_cache(1, prompt, *(ONE_PCT if outliers else (0, 0)), gen, bits)
        r = {"part": "layer", "prompt": prompt, "chunk": chunk, "kv": kv,
             "read kernel ms": timeit(lambda: (kernels.quant_kv_read(ks, slots, prompt, E, 5e5, torch.float16),
                                              kernels.quant_kv_read(vs, slots, prompt, 0, 1e4, torch.float16)),
                                      flush_l2=True),
             "read reference ms": timeit(lambda: (quant_kv_read_ref(ks, slots, prompt, E, 5e5, torch.float16),
                                                  quant_kv_read_ref(vs, slots, prompt, 0, 1e4, torch.float16)),
                                         graph=False)}
        got = kernels.quant_kv_read(ks, slots, prompt, E, 5e5, torch.float16).float()
        r["max |read kernel - reference|"] = (got - quant_kv_read_ref(ks, slots, prompt, E, 5e5)).abs().max().item()
        print(json.dumps(r), flush=True)
        rows.append(r)
    return rows


# tokens a program of the outlier pass, its warps (the read itself at its CFG)
SWEEP = ((32, 4), (16, 4), (64, 4), (128, 4), (32, 1), (32, 2), (64, 2), (128, 8))


def sweep_rows(prompt: int) -> list[dict]:
    """``kv_read``'s launch settings (module docstring: ``sweep``), K and V apart, nuq4 / nuq4-1% / nuq3-1%."""
    from ssmq.kernels import kv_read as kr

    gen = torch.Generator(device="cuda").manual_seed(0)
    slots = torch.arange(1, device="cuda")
    x = torch.empty(2 * prompt * HKV * E, dtype=torch.float16, device="cuda")
    rows = [{"part": "sweep", "copy of the K + V written ms": timeit(lambda: x.clone())}]
    saved = dict(kr.CFG)
    for fmt, bits, outliers in (("nuq4", 4, False), ("nuq4-1%", 4, True), ("nuq3-1%", 3, True)):
        ks, vs = quant_cache(1, prompt, *(ONE_PCT if outliers else (0, 0)), gen, bits)
        for bt, warps in SWEEP if outliers else SWEEP[:1]:
            kr.CFG.update(BT_OUTLIERS=bt, OUTLIER_WARPS=warps)
            rows.append({"part": "sweep", "kv": fmt, "BT_OUTLIERS": bt, "OUTLIER_WARPS": warps,
                         "K ms": timeit(lambda: kr.quant_kv_read(ks, slots, prompt, E, 5e5, torch.float16)),
                         "V ms": timeit(lambda: kr.quant_kv_read(vs, slots, prompt, 0, 1e4, torch.float16))})
            print(json.dumps(rows[-1]), flush=True)
    kr.CFG.update(saved)
    return rows


@torch.no_grad()
def model_rows(name: str, prompt: int, chunk: int, kvs: list[str]) -> list[dict]:
    model = random_model(PUBLISHED[name], dtype=torch.float16)
    ids = torch.randint(0, model.config.vocab_size, (1, prompt), device="cuda")
    rows = []
    for kv in kvs:
        set_kv(model, kv)
        cache = model.allocate_cache(1, prompt + 8, dtype=torch.float16)
        model(ids[:, :chunk], cache, slots=[0])  # warm up: compile, allocate
        cache.reset()
        torch.cuda.synchronize()
        t0, chunks = time.perf_counter(), []
        for a in tqdm(range(0, prompt, chunk), desc=f"{name} {kv}", leave=False):
            s = time.perf_counter()
            logits = model(ids[:, a:a + chunk], cache, slots=[0])
            torch.cuda.synchronize()
            chunks.append(time.perf_counter() - s)
        r = {"part": "model", "model": name, "kv": kv, "prompt": prompt, "chunk": chunk,
             "prefill s": time.perf_counter() - t0, "last chunk ms": chunks[-1] * 1e3,
             "first chunk ms": chunks[0] * 1e3, "finite": bool(torch.isfinite(logits).all())}
        print(json.dumps(r), flush=True)
        rows.append(r)
        del cache
        gc.collect()
        torch.cuda.empty_cache()
    return rows


@torch.no_grad()
def serve_rows(name: str, prompt: int, chunk: int, kvs: list[str], capacity: int) -> list[dict]:
    """``ssmq serve``'s prefill: the engine's runner (``LocalRunner``: a paged KV cache of --kv-block-size 32 blocks,
    prefill from CUDA graphs, which read the cache at its whole capacity, --max-model-len ``capacity``) takes one
    prompt in chunks, as the engine's steps hand them over; seconds for the prompt."""
    from ssmq.runtime.engine import EngineConfig, LocalRunner
    from ssmq.runtime.kv_blocks import BlockAllocator

    model = random_model(PUBLISHED[name], dtype=torch.float16)
    ids = torch.randint(0, model.config.vocab_size, (1, prompt), device="cuda")
    rows = []
    for kv in kvs:
        set_kv(model, kv)
        cfg = EngineConfig(max_batch=1, max_model_len=capacity, prefill_tokens=chunk, kv_blocks=prompt // 32 + 8)
        runner = LocalRunner(model, cfg)
        alloc = BlockAllocator(*runner.kv_blocks)
        times = []
        for _ in range(2):  # the first pass warms up
            runner.reset(0)
            alloc.release(0)
            alloc.admit(0, prompt)
            runner.assign_blocks(0, *alloc.grow(0, prompt))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for a in range(0, prompt, chunk):
                runner.prefill(ids[:, a:a + chunk], 0, all_logits=False)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        r = {"part": "serve", "model": name, "kv": kv, "prompt": prompt, "chunk": chunk, "capacity": capacity,
             "prefill s": times[-1]}
        print(json.dumps(r), flush=True)
        rows.append(r)
        del runner
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def markdown(rows: list[dict]) -> str:
    out = []
    att = [r for r in rows if r["part"] == "layer" and "kernel ms" in r]
    if att:
        out += ["| prompt | chunk | kernel ms | SDPA ms | reference ms | limit ms |", "|---:|---:|---:|---:|---:|---:|"]
        out += [f"| {r['prompt']} | {r['chunk']} | {r['kernel ms']:.3f} | {r.get('sdpa ms', float('nan')):.3f} | "
                f"{r['reference ms']:.3f} | {r['limit ms']:.3f} |" for r in att]
    reads = [r for r in rows if r["part"] == "layer" and "read kernel ms" in r]
    if reads:
        out += ["", "| KV | prompt | read kernel ms (K + V) | read reference ms |", "|---|---:|---:|---:|"]
        out += [f"| {r['kv']} | {r['prompt']} | {r['read kernel ms']:.3f} | {r['read reference ms']:.3f} |"
                for r in reads]
    whole = [r for r in rows if r["part"] == "model"]
    if whole:
        out += ["", "| model | KV | prompt | chunk | prefill s | first chunk ms | last chunk ms |",
                "|---|---|---:|---:|---:|---:|---:|"]
        out += [f"| {r['model']} | {r['kv']} | {r['prompt']} | {r['chunk']} | {r['prefill s']:.2f} | "
                f"{r['first chunk ms']:.1f} | {r['last chunk ms']:.1f} |" for r in whole]
    served = [r for r in rows if r["part"] == "serve"]
    if served:
        out += ["", "| model | KV | prompt | chunk | max-model-len | prefill s (engine runner, graphs) |",
                "|---|---|---:|---:|---:|---:|"]
        out += [f"| {r['model']} | {r['kv']} | {r['prompt']} | {r['chunk']} | {r['capacity']} | "
                f"{r['prefill s']:.3f} |" for r in served]
    return "\n".join(out) + "\n"


def plot(rows: list[dict], path: Path, device: str) -> None:
    """Seconds to prefill the prompt, a bar a KV format and tree (rows of several runs: their --tag)."""
    plt = pyplot()
    whole = [r for r in rows if r["part"] == "model"]
    if plt is None or not whole:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([f"{r['kv']}\n{r.get('tree', '')}" for r in whole], [r["prefill s"] for r in whole],
           color=["tab:gray" if r.get("tree") == "before" else "tab:blue" for r in whole])
    ax.set_ylabel(f"s to prefill {whole[0]['prompt']} tokens")
    ax.set_title(f"{whole[0]['model']}, chunks of {whole[0]['chunk']}, {device}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="layer,model")
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--prompt", type=int, default=16384)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--kv", default="fp16,nuq4-1%,nuq3-1%")
    ap.add_argument("--max-model-len", type=int, default=32768, help="serve: the cache's capacity a sequence")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense float16 tensor peak (H100 / H200 SXM)")
    ap.add_argument("--tag", default="", help="a label written in each row (e.g. the tree measured)")
    ap.add_argument("--out", default=os.environ.get("OUT", "out/prefill"))
    ap.add_argument("--plot", nargs="+", metavar="JSON", help="no run: plot these runs' rows (their tags) to "
                    "--out/prefill.png")
    args = ap.parse_args()
    if args.plot:
        runs = [json.loads(Path(f).read_text()) for f in args.plot]
        Path(args.out).mkdir(parents=True, exist_ok=True)
        plot([r for run in runs for r in run["rows"]], Path(args.out) / "prefill.png", runs[0]["meta"]["device"])
        return
    kvs, parts, rows = args.kv.split(","), args.parts.split(","), []
    if "layer" in parts:
        rows += layer_rows(args.prompt, args.chunk, kvs, args.peak_tflops)
    if "sweep" in parts:
        rows += sweep_rows(args.prompt)
    if "model" in parts:
        rows += model_rows(args.model, args.prompt, args.chunk, kvs)
    if "serve" in parts:
        rows += serve_rows(args.model, args.prompt, args.chunk, kvs, args.max_model_len)
    for r in rows:
        r["tree"] = args.tag
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefill.json").write_text(json.dumps({"meta": {"device": torch.cuda.get_device_name(), "args": vars(args)},
                                                  "rows": rows}, indent=1))
    (out / "prefill.md").write_text(markdown(rows))
    plot(rows, out / "prefill.png", torch.cuda.get_device_name())
    print(markdown(rows))


if __name__ == "__main__":
    main()
