"""End-to-end decode over a long KV cache: ms per token of the whole model (CUDA-graph decode, one token per row)
with the float16 KV cache against quantized KV formats, at a published config with random weights.

    python benchmarks/bench_kv_e2e.py --model llama-3.1-8b --cases 1:131072,8:32768 \
        --kv fp16,fp16-ref,nuq4,nuq4-1%,nuq3-1%,nuq2-1%,nuq4-1%+ref --out DIR

Rows (``--kv``): ``fp16`` the float16 cache, decoded by our flash-decoding kernel (``KVState.decode``: the fast
kernel's float path, float16 tensor-core products);
``fp16-first`` the same cache on the first-generation kernel (float32-exact 3xTF32 products; as
SSMQ_KV_FAST=0); ``fp16-ref`` the same cache through the prefix read + ``attention_ref``; any KV preset name (``ssmq.models.kv_format``):
every attention layer gets a ``KVQuantizer`` of the format with placeholder codebooks and scales (speed, not
accuracy), writes the new tokens with the fused
quantize-and-append kernel (``kernels.kv_append``) and decodes through the LUT kernels; a name ending in ``+ref``
(``nuq4-1%+ref``) writes them with the reference ops instead (as SSMQ_KV_FUSED_APPEND=0). A case
B:C fills B rows of the cache to C tokens with random contents (the kernels' speed does not depend on the values;
every outlier slot filled, distinct and in index order, as ``bench_kvquant.py`` does: an upper bound on their
work; ``--key-live 0.5`` leaves a random half of the keys' slots empty, about what the 1% per-channel thresholds
leave of their 2 x 1% slots) and times ``--steps`` graph replays (median ms a step, CUDA events); ``--profile``
prints the kernels of one eager step a row. "KV GB" is the cache's attention bytes for the B rows. Writes kv_e2e.json, kv_e2e.md and kv_e2e.png to --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_plan_memory import quantize_kv  # noqa: E402
from plotting import pyplot  # noqa: E402
from published_configs import PUBLISHED  # noqa: E402
from random_model import random_model  # noqa: E402

from ssmq.kernels import policy  # noqa: E402
from ssmq.models.quant_kv import QuantKVState  # noqa: E402
from ssmq.models.state import KVState  # noqa: E402
from ssmq.ops.kv_quant import order_slots  # noqa: E402
from ssmq.models.kv_format import kv_format  # noqa: E402
from ssmq.runtime.cuda_graph import CudaGraphDecoder  # noqa: E402


def set_kv(model, kv: str) -> None:
    """Every attention layer caches in ``kv``: float16 (no quantizer) or a KV preset (placeholder quantizers)."""
    if kv in ("fp16", "fp16-ref", "fp16-first"):
        for layer in model.layers:
            if hasattr(layer.mixer, "kv_quant"):
                layer.mixer.kv_quant = None
    else:
        quantize_kv(model, kv_format(kv))


@torch.no_grad()
def fill(cache, rows: int, context: int, key_live: float = 1.0) -> int:
    """Random contents for the attention states of ``cache``, the first ``rows`` slots at ``context`` tokens (a
    random ``key_live`` share of the keys' outlier slots holding one, the rest empty and last); their attention
    bytes."""
    nbytes = 0
    for st in cache.states:
        if isinstance(st, KVState):
            st.k.normal_()
            st.v.normal_()
            nbytes += st.nbytes() * rows // st.k.shape[0]
        elif isinstance(st, QuantKVState):
            for side in (st.k, st.v):
                side.codes.random_(0, 256)
                if side.mid is not None:
                    side.mid.normal_(0, 0.1)
                    side.half.uniform_(0.5, 1.5)
                n, width = side.out_idx.shape[-1], side.sink.shape[-2] * side.sink.shape[-1]
                if n:  # n distinct indices a token, spread over the row, ascending
                    first = torch.randint(0, width // n, side.out_idx.shape[:-1] + (1,), device=side.codes.device)
                    idx = first + torch.arange(n, device=side.codes.device) * (width // n)
                    if side is st.k and key_live < 1.0:
                        idx = torch.where(torch.rand(idx.shape, device=idx.device) < key_live, idx, -1)
                    side.out_idx.copy_(order_slots(idx))
                    side.out_val.normal_()
                side.sink.normal_()
            nbytes += st.nbytes() * rows // st.k.codes.shape[0]
    cache.seqlens[:rows] = context
    return nbytes


def time_steps(dec, rows: int, steps: int) -> float:
    tokens = torch.zeros(rows, dtype=torch.long, device="cuda")
    slots = torch.arange(rows, device="cuda")
    for _ in range(2):  # capture, warm up
        dec(tokens, slots)
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dec(tokens, slots)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def profile_step(model, cache, rows: int, top: int = 12) -> str:
    """The GPU kernels of one eager decode step over the filled ``cache``, by total time (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    tokens = torch.zeros(rows, dtype=torch.long, device="cuda")
    slots = torch.arange(rows, device="cuda")
    with torch.inference_mode():
        model.step(tokens, cache, slots)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model.step(tokens, cache, slots)
            torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=top, max_name_column_width=60)


def run(name: str, cases: list[tuple[int, int]], kvs: list[str], steps: int, prof: bool = False,
        key_live: float = 1.0) -> list[dict]:
    cfg = PUBLISHED[name]
    model = random_model(cfg, dtype=torch.float16)
    rows = []
    kernel, before = KVState.decode, policy.active()
    for rows_, context in cases:
        for kv in tqdm(kvs, desc=f"{name} b{rows_} ctx {context}"):
            fmt = kv.removesuffix("+ref")
            set_kv(model, fmt)
            policy.set_policy(before.with_changes(kv_fused_append=not kv.endswith("+ref"),
                                                  kv_decode=("kv_decode",) if kv == "fp16-first" else before.kv_decode))
            KVState.decode = kernel if kv != "fp16-ref" else (lambda self, *a: None)
            r = {"model": name, "batch": rows_, "context": context, "kv": kv, "key_live": key_live}
            try:
                dec = CudaGraphDecoder(model, max_batch=rows_, max_seqlen=context + 2 * steps + 8, buckets=(rows_,))
                r["kv_GB"] = fill(dec.cache, rows_, context, key_live) / 1e9
                r["ms_per_step"] = time_steps(dec, rows_, steps)
                r["tokens_per_s"] = rows_ * 1e3 / r["ms_per_step"]
                if prof:
                    print(f"--- {kv}, batch {rows_}, {context} tokens: one eager step", flush=True)
                    print(profile_step(model, dec.cache, rows_), flush=True)
            except torch.cuda.OutOfMemoryError as e:
                r["error"] = f"OutOfMemoryError: {str(e)[:200]}"
            finally:
                KVState.decode = kernel
                policy.set_policy(before)
                dec = None
                gc.collect()
                torch.cuda.empty_cache()
            print(json.dumps(r), flush=True)
            rows.append(r)
    return rows


def markdown(rows: list[dict]) -> str:
    out = ["| model | batch | context | KV format | KV GB | ms / step | tokens / s | vs fp16 |",
           "|---|---:|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        base = next((x for x in rows if x["batch"] == r["batch"] and x["context"] == r["context"]
                     and x["kv"] == "fp16" and "ms_per_step" in x), None)
        if "ms_per_step" not in r:
            out.append(f"| {r['model']} | {r['batch']} | {r['context']} | {r['kv']} | | {r.get('error', '')} | | |")
            continue
        ratio = f"{base['ms_per_step'] / r['ms_per_step']:.2f}×" if base else ""
        out.append(f"| {r['model']} | {r['batch']} | {r['context']} | {r['kv']} | {r['kv_GB']:.2f} | "
                   f"{r['ms_per_step']:.2f} | {r['tokens_per_s']:.0f} | {ratio} |")
    return "\n".join(out) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    cases = sorted({(r["batch"], r["context"]) for r in rows})
    fig, axes = plt.subplots(1, len(cases), figsize=(5 * len(cases), 3.6), squeeze=False)
    for ax, (b, c) in zip(axes[0], cases):
        sel = [r for r in rows if (r["batch"], r["context"]) == (b, c) and "ms_per_step" in r]
        ax.bar([r["kv"] for r in sel], [r["ms_per_step"] for r in sel], color="tab:blue")
        ax.set_title(f"{sel[0]['model'] if sel else ''}, batch {b}, {c} tokens")
        ax.set_ylabel("ms per decode step")
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--cases", default="1:131072,8:32768", help="BATCH:CONTEXT,...")
    ap.add_argument("--kv", default="fp16,fp16-ref,nuq4,nuq4-1%,nuq3-1%,nuq2-1%")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--profile", action="store_true", help="also print the GPU kernels of one eager step a row")
    ap.add_argument("--key-live", type=float, default=1.0,
                    help="share of the keys' outlier slots holding one (1: all, the upper bound; calibrated 1%% "
                         "thresholds fill about half)")
    ap.add_argument("--out", default=os.environ.get("OUT", "out/kv_e2e"))
    args = ap.parse_args()
    cases = [tuple(int(x) for x in c.split(":")) for c in args.cases.split(",")]
    if not 0.0 <= args.key_live <= 1.0:
        raise SystemExit(f"bench_kv_e2e: --key-live must be in [0, 1], got {args.key_live}")
    rows = run(args.model, cases, args.kv.split(","), args.steps, args.profile, args.key_live)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    (out / "kv_e2e.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / "kv_e2e.md").write_text(markdown(rows))
    plot(rows, out / "kv_e2e.png")
    print(markdown(rows))


if __name__ == "__main__":
    main()
