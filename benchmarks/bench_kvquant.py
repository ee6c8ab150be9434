"""KVQuant decode kernels vs our FP16 attention decode (one GPU), 4K-128K tokens of context.

Shape (--shape): a hybrid's attention layer (8b, the default: the heads of Llama-3.1-8B and Nemotron-H-8B, 32 query
heads, 8 KV heads, head dim 128, with Llama's full RoPE on keys cached before it), Bamba-9B's (bamba: the same heads,
RoPE on 64 of the 128 channels), SmolLM2-135M's (smollm2: 9 / 3 x 64, full RoPE) or our trained hybrid's (hybrid:
6 / 2 x 64, RoPE on 32 channels); batch 1 (and --batch), one new token per row. Rows per context length:
    fp16 ours        ``kernels.kv_decode.float_kv_decode``: the first-generation kernel's float path over the fp16
                     cache (keys post-RoPE; float32-exact 3xTF32 products): the models' float16 decode until session 30
    fp16 fast        ``kernels.kv_decode_fast.float_kv_decode``: the fast kernel's float path (float16 tensor-core
                     products) over the same cache, the models' float16 decode since session 30 (2026-11-28): the
                     float16 row the kvquant rows are to be read against
    fp16 sdpa        torch's fused ``scaled_dot_product_attention`` over the same fp16 cache (a strong baseline)
    fp16 ref         ``ops.attention_ref`` (float32 copies, GQA by repeat_interleave): "fp16 ours" until issue 17
    kvquant X-bit    ``kernels.quant_kv_decode`` (the dispatch: ``kv_decode_warp`` for the formats it serves, the
                     4-bit rows since session 32 and every row here since session 33, 2026-11-29;
                     ``kv_decode_fast`` before, every row from 2026-11-26; else ``kv_decode``): codes packed at
                     4, 3, 2 bits, per-channel keys (pre-RoPE, RoPE on the fly), per-token values, sink 1;
                     without outliers, and with 1% (20 key / 10 value outlier slots per token, as
                     ``KVQuantizer.outlier_slots`` gives for 8 x 128 channels);
                     every row also timed on the first-generation kernel ("... first gen") and on
                     ``kv_decode_fast`` ("... fast")
Times are medians of CUDA-graph replays with the L2 flushed before each (``timeit``; ms); "KV MB" the cache bytes
read, "limit ms" the time those bytes take at the card's datasheet bandwidth (``hbm_tbps``: H100 SXM 3.35 TB/s,
H200 4.8). The first length's rows also record the kernels' max |error| against ``quant_kv_decode_ref`` /
``attention_ref``. JSON and PNG to --out. --cfg overrides
``kernels.kv_decode_fast.CFG`` (launch settings; --sweep times several).

    python benchmarks/bench_kvquant.py --out out/ [--lengths 4096,8192,...] [--batch 1]
        [--shape 8b|bamba|smollm2|hybrid]
        [--cfg num_warps=4,...]
        [--sweep "GP_MIN=8;SPARSE_SLOTS=256" --sweep-lengths 16384,131072 --sweep-bits 4,3,2]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plotting import log_axes, pyplot  # noqa: E402

from ssmq.ops.attention import attention_ref  # noqa: E402
from ssmq.ops.kv_quant import KVSideView, order_slots, outlier_codes, pack_codes, quant_kv_decode_ref  # noqa: E402

# hq, hkv, e, rotary dim
SHAPES = {"8b": (32, 8, 128, 128), "bamba": (32, 8, 128, 64), "smollm2": (9, 3, 64, 64), "hybrid": (6, 2, 64, 32)}


def set_shape(name: str) -> None:
    """The attention shape the rows run at (module globals, as --device's DEV): heads, head dim, rotary dim, and
    the 1% outlier slots of hkv x e channels (``KVQuantizer.outlier_slots``: 2 x 1% for keys, 1% for values)."""
    global HQ, HKV, E, R, ONE_PCT, QUANT_ROWS
    if name not in SHAPES:
        raise SystemExit(f"bench_kvquant: unknown --shape {name!r}; one of {', '.join(SHAPES)}")
    HQ, HKV, E, R = SHAPES[name]
    ONE_PCT = (2 * round(0.01 * HKV * E), round(0.01 * HKV * E))
    QUANT_ROWS = [(f"kvquant {bits}-bit{' 1%' if o else ''}", bits, ONE_PCT if o else (0, 0))
                  for bits in (4, 3, 2) for o in (False, True)]


set_shape("8b")
HBM_TBPS = {"H100": 3.35, "H200": 4.8}  # datasheet bandwidths (SXM), TB/s


def hbm_tbps(name: str) -> float:
    """The datasheet memory bandwidth of the GPU named ``name`` (torch's device name), TB/s: the "limit" columns'.
    Before 2026-11-29 every run used the H100's 3.35, the H200's runs included (their limits 1.4x too long)."""
    for card, tbps in HBM_TBPS.items():
        if card in name:
            return tbps
    raise SystemExit(f"bench_kvquant: no datasheet bandwidth for {name!r}; add it to HBM_TBPS")
DEV = "cuda"  # --device cpu with TRITON_INTERPRET=1: a smoke run of this script (tiny lengths)


def quant_cache(b: int, L: int, k_slots: int, v_slots: int, gen, bits: int = 4,
                key_live: float = 1.0) -> tuple[KVSideView, KVSideView]:
    """Random ``bits``-bit codes (packed at their width), codebooks, scales and outliers of a (b, L) cache (the
    kernels' speed does not depend on the values). Every outlier slot holds one, or a random ``key_live`` share of
    each token's key slots (per-channel thresholds fill their 2 × 1% slots about half on average; the rest -1)."""
    levels = 2 ** bits

    def side(per_token, slots):
        codes = torch.randint(0, levels, (b, L, HKV, E), generator=gen, device=DEV, dtype=torch.uint8)
        book = torch.sort(torch.rand(levels, generator=gen, device=DEV) * 2 - 1).values
        if per_token:
            mid = torch.randn(b, L, HKV, generator=gen, device=DEV).half() * 0.1
            half = torch.rand(b, L, HKV, generator=gen, device=DEV).half() + 0.5
        else:
            mid = torch.randn(HKV, E, generator=gen, device=DEV) * 0.1
            half = torch.rand(HKV, E, generator=gen, device=DEV) + 0.5
        # distinct within a token, as quantization picks them (the reference's scatter of duplicates is racy)
        first = torch.randint(0, HKV * E, (b, L, 1), generator=gen, device=DEV)
        idx = ((first + torch.arange(slots, device=DEV) * (HKV * E // max(slots, 1))) % (HKV * E)).to(torch.int16)
        val = torch.randn(b, L, slots, generator=gen, device=DEV).half()
        if not per_token and key_live < 1.0:
            idx = torch.where(torch.rand(idx.shape, generator=gen, device=DEV) < key_live, idx, -1).to(torch.int16)
        idx, val = order_slots(idx, val)  # slots and the codes under them as quantization stores them
        codes = pack_codes(outlier_codes(codes, idx, val, mid.float()[..., None] if per_token else mid, levels), bits)
        sink = torch.randn(b, 1, HKV, E, generator=gen, device=DEV)
        return KVSideView(codes, book, mid, half, per_token, idx, val, sink, bits)
    return side(False, k_slots), side(True, v_slots)


def nbytes(*views) -> int:
    """Bytes a decode step reads per layer: codes, outliers and per-token scales (offline scales are tiny)."""
    tensors = [t for v in views for t in (v.codes, v.out_idx, v.out_val, *((v.mid, v.half) if v.per_token else ()))]
    return sum(t.numel() * t.element_size() for t in tensors)


def timeit(fn, reps: int = 40, graph: bool = True, flush_l2: bool = True) -> float:
    """Median GPU ms of ``fn`` replayed as a CUDA graph (as decode runs it: no host launch cost in the number; the
    first session's rows timed eager calls, ~0.05-0.1 ms of Python launch overhead included), the L2 flushed before
    each replay (a 256 MB write outside the timed span; unless ``flush_l2`` is False) so that short caches are read
    from HBM; eager
    ``do_bench`` when ``graph`` is False (the reference: it reads lengths on the host) or capture fails."""
    import time

    import triton.testing as tt

    if DEV == "cpu":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    try:
        fn()
        torch.cuda.synchronize()
        if not graph:
            return tt.do_bench(fn, warmup=5, rep=50, return_mode="median")
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
        except RuntimeError:
            return tt.do_bench(fn, warmup=5, rep=50, return_mode="median")
        flush = torch.empty(256 * 2**20, dtype=torch.int8, device=DEV)
        times = []
        for _ in range(reps):
            if flush_l2:
                flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return math.inf


def run(lengths: list[int], batch: int) -> list[dict]:
    from ssmq.kernels import kv_decode, kv_decode_fast, quant_kv_decode
    from ssmq.kernels.kv_decode import float_kv_decode

    rows = []
    gen = torch.Generator(device=DEV).manual_seed(0)
    tbps = hbm_tbps(torch.cuda.get_device_name()) if DEV == "cuda" else math.nan  # the CPU smoke run has no limit
    for L in lengths:
        q = torch.randn(batch, HQ, E, generator=gen, device=DEV, dtype=torch.float16)
        slots = torch.arange(batch, device=DEV)
        lens = torch.full((batch,), L, device=DEV)
        k16 = torch.randn(batch, L, HKV, E, generator=gen, device=DEV, dtype=torch.float16)
        v16 = torch.randn_like(k16)
        kv_mb = 2 * k16.numel() * 2 / 1e6
        r = {"context": L, "batch": batch, "tbps": tbps, "fp16 KV MB": kv_mb, "fp16 limit ms": kv_mb / tbps / 1e3}
        r["fp16 ours ms"] = timeit(lambda: float_kv_decode(q, slots, lens, k16, v16))
        r["fp16 fast ms"] = timeit(lambda: kv_decode_fast.float_kv_decode(q, slots, lens, k16, v16))
        qs, ks, vs = q[:, :, None], k16.transpose(1, 2), v16.transpose(1, 2)  # (b, h, T, e)
        r["fp16 sdpa ms"] = timeit(lambda: F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True))
        r["fp16 ref ms"] = timeit(lambda: attention_ref(q[:, None], k16, v16, lens), graph=False)
        if L == lengths[0]:
            want = attention_ref(q.float()[:, None], k16.float(), v16.float(), lens)[:, 0]
            r["fp16 ours max err"] = float((float_kv_decode(q, slots, lens, k16, v16) - want).abs().max())
            r["fp16 fast max err"] = float((kv_decode_fast.float_kv_decode(q, slots, lens, k16, v16) - want).abs()
                                           .max())
        del k16, v16, ks, vs
        for label, bits, (ko, vo) in QUANT_ROWS:
            K, V = quant_cache(batch, L, ko, vo, gen, bits)
            r[f"{label} KV MB"] = nbytes(K, V) / 1e6
            r[f"{label} limit ms"] = r[f"{label} KV MB"] / tbps / 1e3
            r[f"{label} ms"] = timeit(lambda: quant_kv_decode(q, slots, lens, K, V, R, 10000.0))
            r[f"{label} first gen ms"] = timeit(lambda: kv_decode.quant_kv_decode(q, slots, lens, K, V, R, 10000.0))
            # the Triton fast kernel on every row (the dispatch sends the formats kv_decode_warp serves there)
            r[f"{label} fast ms"] = timeit(lambda: kv_decode_fast.quant_kv_decode(q, slots, lens, K, V, R, 10000.0))
            if L == lengths[0]:
                want = quant_kv_decode_ref(q.float(), slots, lens, K, V, R, 10000.0)
                r[f"{label} max err"] = float((quant_kv_decode(q, slots, lens, K, V, R, 10000.0) - want).abs().max())
            del K, V
        torch.cuda.empty_cache()
        print(json.dumps(r), flush=True)
        rows.append(r)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    x = [r["context"] for r in rows]
    for key in ("fp16 ours", "fp16 fast", "fp16 sdpa", *(label for label, _, _ in QUANT_ROWS)):
        ax.plot(x, [r[f"{key} ms"] for r in rows], marker="o", label=key, ls=":" if key.endswith("1%") else "-")
    for key in ("fp16", "kvquant 4-bit", "kvquant 2-bit"):
        ax.plot(x, [r[f"{key} limit ms"] for r in rows], ls="--", label=f"{key} bytes at {rows[0]['tbps']} TB/s")
    log_axes(ax, "context (tokens)", "decode attention, ms (one layer)",
             f"KV decode, {HQ} q / {HKV} kv heads x {E} (RoPE {R}), batch {rows[0]['batch']}", legend_size=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def set_cfg(text: str) -> None:
    """Apply "KEY=VALUE,..." overrides to ``kernels.kv_decode_fast.CFG`` (the kernel every row here takes)."""
    from ssmq.kernels import kv_decode_fast

    for item in filter(None, text.split(",")):
        key, value = item.split("=")
        kv_decode_fast.CFG[key] = int(value) if value.isdigit() else value


def sweep(cfgs: list[str], lengths: list[int], batch: int, bits: tuple[int, ...] = (4,)) -> list[dict]:
    """The fp16 cache on the fast kernel and the kvquant rows (codes of ``bits``, without and with outliers): their
    times under each launch setting of ``cfgs`` (each "KEY=VALUE,..." over the CFG found)."""
    from ssmq.kernels import kv_decode_fast as kv_decode
    from ssmq.kernels import quant_kv_decode

    base, out = dict(kv_decode.CFG), []
    gen = torch.Generator(device=DEV).manual_seed(1)
    for L in lengths:
        q = torch.randn(batch, HQ, E, generator=gen, device=DEV, dtype=torch.float16)
        slots, lens = torch.arange(batch, device=DEV), torch.full((batch,), L, device=DEV)
        k16 = torch.randn(batch, L, HKV, E, generator=gen, device=DEV, dtype=torch.float16)
        # the fp16 cache through the fast kernel's float path, then the kvquant rows (caches made one at a time)
        cases = [("fp16 fast", lambda: (k16, torch.randn_like(k16)), lambda K, V: kv_decode.float_kv_decode(
            q, slots, lens, K, V))]
        cases += [(label, lambda b=b, ko=ko, vo=vo: quant_cache(batch, L, ko, vo, gen, b),
                   lambda K, V: quant_kv_decode(q, slots, lens, K, V, R, 10000.0))
                  for label, b, (ko, vo) in QUANT_ROWS if b in bits]
        for label, make, fn in cases:
            K, V = make()
            for cfg in cfgs:
                kv_decode.CFG.clear()
                kv_decode.CFG.update(base)
                set_cfg(cfg)
                r = {"context": L, "row": label, "cfg": cfg}
                try:  # a setting this Triton cannot compile is a row with its error, not the end of the sweep
                    r["ms"] = timeit(lambda: fn(K, V))
                except Exception as exc:  # noqa: BLE001
                    r["ms"], r["error"] = math.nan, f"{type(exc).__name__}: {str(exc)[:200]}"
                print(json.dumps(r), flush=True)
                out.append(r)
            del K, V
        del k16
    kv_decode.CFG.clear()
    kv_decode.CFG.update(base)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out")
    ap.add_argument("--lengths", default="4096,8192,16384,32768,65536,131072")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--shape", default="8b", help=f"attention shape: {', '.join(SHAPES)}")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cfg", default="",
                    help="kv_decode_fast.CFG overrides, e.g. BLOCK_T=32,num_warps=4,WAVES=4,ROPE=direct")
    ap.add_argument("--sweep", default="", help="launch settings to time the kvquant rows under, ';'-separated "
                    "--cfg strings (e.g. 'num_warps=4;BLOCK_T=32'), at --sweep-lengths; to JSON 'sweep'")
    ap.add_argument("--sweep-lengths", default="131072")
    ap.add_argument("--sweep-bits", default="4", help="code widths of the swept rows (each without and with outliers)")
    args = ap.parse_args()
    global DEV
    DEV = args.device
    set_shape(args.shape)
    from ssmq.kernels import kv_decode, kv_decode_fast

    set_cfg(args.cfg)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = run([int(x) for x in args.lengths.split(",")], args.batch)
    swept = sweep(["", *filter(None, args.sweep.split(";"))], [int(x) for x in args.sweep_lengths.split(",")],
                  args.batch, tuple(int(x) for x in args.sweep_bits.split(","))) if args.sweep else []
    meta = {"device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu (Triton interpreter)",
            "torch": torch.__version__, "shape": {"name": args.shape, "hq": HQ, "hkv": HKV, "e": E, "rotary_dim": R},
            "cfg": kv_decode.CFG,
            "fast_cfg": kv_decode_fast.CFG}
    stem = f"kvquant_kernels{'' if args.shape == '8b' else '_' + args.shape}_b{args.batch}"
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows, "sweep": swept}, indent=2))
    plot(rows, out / f"{stem}.png")
    for r in rows:
        print(f"{r['context']:>7} | ours {r['fp16 ours ms']:.3f} | fast {r['fp16 fast ms']:.3f} | "
              f"sdpa {r['fp16 sdpa ms']:.3f} | "
              f"ref {r['fp16 ref ms']:.3f} | fp16 limit {r['fp16 limit ms']:.3f} | "
              + " | ".join(f"{label.removeprefix('kvquant ')} {r[f'{label} ms']:.3f} "
                           f"(fast {r[f'{label} fast ms']:.3f}) "
                           f"(limit {r[f'{label} limit ms']:.3f})" for label, _, _ in QUANT_ROWS) + " ms")
    for r in swept:
        print(f"sweep {r['context']:>7} | {r['row']:<18} | {r['cfg'] or 'CFG'}: {r['ms']:.3f} ms")


if __name__ == "__main__":
    main()
