"""SSDi8 kernel benchmark (one GPU): int8 SSD vs our FP16 SSD vs mamba_ssm's ``mamba_chunk_scan_combined``.

Shape: Mamba2-2.7B's SSD (80 heads of 64, d_state 128, ngroups 1, chunk 256), batch 1 and 32, L = 256 ... 8192,
fp16 inputs. The int8 SSD takes int8 B / C (quantized once per layer, outside the timing, as the model does) and
static scales from ``ssd_int8_ranges`` of the same inputs. Each row also gives the share of each of the five
launches of the int8 SSD (torch.profiler CUDA time by kernel name; "torch glue" = any other kernel: the few
elementwise ops on (h, p) scales).

    PYTHONPATH=.:/path/to/mamba_ssm python benchmarks/bench_ssdi8.py --json out.json [--lengths 256,1024] [--cfg JSON]

A row whose timing fails prints the exception and records it under "errors" (the time is then null).
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import triton.testing as tt

from ssmq.kernels import ssd, ssdi8
from ssmq.ops.quant_ssm import quantize_ref
from ssmq.ops.ssd_int8 import ssd_int8_ranges
from peers import mamba_ssm_op  # noqa: E402
from plotting import log_axes, pyplot  # noqa: E402

DEV = "cuda"
H, P, N, G, T = 80, 64, 128, 1, 256
STAGES = {"_chunk_cumsum": "ChunkCumsum (float)", "_chunk_state_q": "X_scaled quant+ChunkState+requant (int8)",
          "_state_passing_q": "StatePassing (int8)", "_chunk_bmm_q": "ChunkBMM (int8)",
          "_chunk_scan_q": "ChunkScan1 (int8)+ChunkScan2 (float)+D/z"}


def peer():
    return mamba_ssm_op("ops.triton.ssd_combined", "mamba_chunk_scan_combined")


def inputs(b: int, l: int):
    g = torch.Generator(device=DEV).manual_seed(0)
    r = lambda *s: torch.randn(*s, device=DEV, generator=g, dtype=torch.float16)  # noqa: E731
    x, dt, B, C = r(b, l, H, P), r(b, l, H), r(b, l, G, N), r(b, l, G, N)
    A = -torch.rand(H, device=DEV) - 0.5
    kw = dict(D=torch.randn(H, device=DEV), dt_bias=torch.randn(H, device=DEV) - 3, dt_softplus=True)
    return x, dt, A, B, C, kw


def timeit(fn, name: str, errors: dict) -> float:
    """Median ms of fn; a failure (out of memory included) is printed, kept in errors[name] and timed as NaN."""
    try:
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        return tt.do_bench(fn, warmup=10, rep=100, return_mode="median")
    except Exception as e:  # noqa: BLE001 - a failing row must not end the table
        errors[name] = f"{type(e).__name__}: {str(e)[:300]}"
        print(f"  {name} failed: {errors[name]}", flush=True)
        torch.cuda.empty_cache()
        return math.nan


def shares(fn) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        print(f"  profiling failed: {type(e).__name__}: {e}", flush=True)
        torch.cuda.empty_cache()
        return {}
    total, out = 0.0, {v: 0.0 for v in (*STAGES.values(), "torch glue")}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if e.key.startswith(("aten::", "cuda", "Memcpy", "Memset")) or t <= 0:
            continue  # aten ops are parents of the kernels counted below
        total += t
        out[next((v for k, v in STAGES.items() if k in e.key), "torch glue")] += t
    return {k: round(v / total, 3) for k, v in out.items()} if total else {}


# --sweep: launch settings of the kernels that take 90%+ of the int8 SSD (the fused scan, the chunk state), each varied
# with the others at their defaults; the int8 SSD timed alone at each (batch, L). The first sweep (2026-11-26, before
# the float16 products; benchmarks/results/ssdi8_h100/sweep_s16.json) also tried scan BM 128 / BP 32 / 8 warps /
# 3 stages and state BT 64 / 256 / BP 32 / 8 warps / 3 stages / BN 64: all slower or within 1%; the second (same
# day, float16 products in; sweep_s17.json) BN 64, BT 64 + BN 64, 8 warps, scan BK 64, BM 128 + 8 warps, BP 32.
SWEEP = [("scan", dict(maxnreg=168)), ("scan", dict(FACTORED=True)), ("scan", dict(FACTORED=True, maxnreg=168)),
         ("state", dict(BT=64)), ("state", dict(BP=32)), ("state", dict(maxnreg=128)), ("state", dict(BP=32, BT=64))]


def run_sweep(shapes, errors: dict) -> list[dict]:
    rows = []
    default = {k: dict(v) for k, v in ssdi8.CFG.items()}
    for kernel, over in [(None, {})] + SWEEP:
        if kernel:
            ssdi8.CFG[kernel].update(over)
        for b, l in shapes:
            x, dt, A, B, C, kw = inputs(b, l)
            sc = {k: v / 127 for k, v in ssd_int8_ranges(x, dt, A, B, C, T, kw["dt_bias"], True).items()}
            Bq, Cq = quantize_ref(B.float(), sc["B"][:, None]), quantize_ref(C.float(), sc["C"][:, None])
            ms = timeit(lambda: ssdi8.ssd_int8(x, dt, A, Bq, sc["B"], Cq, sc["C"], sc["xs"], sc["state"], T, **kw),
                        f"{kernel}:{over}:{b}x{l}", errors)
            rows.append({"kernel": kernel or "defaults", **{f"{kernel}.{k}": v for k, v in over.items()}, "batch": b,
                         "L": l, "int8_ssd_ms": ms if math.isfinite(ms) else None})
            print(f"{kernel or 'defaults':>8} {json.dumps(over):<36} b{b:<3} L{l:<5} {ms:8.3f}", flush=True)
            del x, dt, B, C, Bq, Cq
        for k, v in default.items():
            ssdi8.CFG[k].clear()
            ssdi8.CFG[k].update(v)
    return rows


def plot(rows: list[dict], device: str, path: str) -> None:
    """ms per call vs L, one panel a batch: our FP16 SSD, the int8 SSD and mamba_ssm."""
    plt = pyplot()
    if plt is None:
        return
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4.5), squeeze=False)
    for ax, b in zip(axes[0], batches):
        rs = sorted((r for r in rows if r["batch"] == b), key=lambda r: r["L"])
        for key, label in (("fp16_ssd_ms", "ssmq FP16 SSD"), ("int8_ssd_ms", "ssmq int8 SSD (SSDi8)"),
                           ("mamba_ssm_ms", "mamba_ssm mamba_chunk_scan_combined")):
            pts = [(r["L"], r[key]) for r in rs if r.get(key)]
            if pts:
                ax.plot(*zip(*pts), "o-", label=label)
        log_axes(ax, "L (tokens)", "ms per call", f"batch {b}, Mamba2-2.7B SSD shape — {device}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="256,512,1024,2048,4096,8192")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--json", default=None, help="write the rows here, and a PNG beside it")
    ap.add_argument("--plot-from", default=None, help="only draw the PNG of an earlier --json (no GPU needed)")
    ap.add_argument("--cfg", default=None,
                    help='JSON merged into ssmq.kernels.ssdi8.CFG, e.g. \'{"scan": {"FACTORED": false, "BM": 128}}\'')
    ap.add_argument("--sweep", action="store_true", help="time the int8 SSD alone at each SWEEP launch setting")
    args = ap.parse_args()
    if args.plot_from:
        doc = json.loads(open(args.plot_from).read())
        plot(doc["rows"], doc["device"], args.plot_from.removesuffix(".json") + ".png")
        return
    for kernel, over in json.loads(args.cfg or "{}").items():
        ssdi8.CFG[kernel].update(over)
    if args.sweep:
        errors: dict[str, str] = {}
        shapes = [(b, l) for b in map(int, args.batches.split(",")) for l in map(int, args.lengths.split(","))]
        rows = run_sweep(shapes, errors)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "default_cfg": ssdi8.CFG, "sweep": rows,
                           "errors": errors}, f, indent=2)
        return
    pk = peer()
    rows = []
    print(f"{'batch':>5} {'L':>5} {'fp16 ssd ms':>11} {'int8 ssd ms':>11} {'mamba_ssm ms':>12} {'fp16/int8':>9}  shares")
    for b in map(int, args.batches.split(",")):
        for l in map(int, args.lengths.split(",")):
            x, dt, A, B, C, kw = inputs(b, l)
            sc = {k: v / 127 for k, v in ssd_int8_ranges(x, dt, A, B, C, T, kw["dt_bias"], True).items()}
            Bq, Cq = quantize_ref(B.float(), sc["B"][:, None]), quantize_ref(C.float(), sc["C"][:, None])
            errors: dict[str, str] = {}
            fp16 = timeit(lambda: ssd.ssd_chunk_scan(x, dt, A, B, C, T, **kw), "fp16_ssd", errors)
            int8_fn = lambda: ssdi8.ssd_int8(x, dt, A, Bq, sc["B"], Cq, sc["C"], sc["xs"], sc["state"], T,  # noqa: E731
                                                **kw)
            i8 = timeit(int8_fn, "int8_ssd", errors)
            ms = timeit(lambda: pk(x, dt, A, B, C, T, **kw), "mamba_ssm", errors) if pk else math.nan
            sh = shares(int8_fn) if math.isfinite(i8) else {}
            ok = lambda v: v if math.isfinite(v) else None  # noqa: E731  (JSON has no NaN)
            row = {"batch": b, "L": l, "fp16_ssd_ms": ok(fp16), "int8_ssd_ms": ok(i8), "mamba_ssm_ms": ok(ms),
                   "speedup_vs_fp16": fp16 / i8 if i8 > 0 and math.isfinite(fp16 / i8) else None, "shares": sh,
                   "errors": errors}
            rows.append(row)
            print(f"{b:>5} {l:>5} {fp16:>11.3f} {i8:>11.3f} {ms:>12.3f} {row['speedup_vs_fp16'] or 0:>9.2f}  "
                  + ", ".join(f"{k} {v:.0%}" for k, v in sh.items()), flush=True)
            del x, dt, B, C, Bq, Cq
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "shape": dict(h=H, p=P, n=N, g=G, T=T),
                       "int8_cfg": ssdi8.CFG, "rows": rows}, f, indent=2)
        plot(rows, torch.cuda.get_device_name(), args.json.removesuffix(".json") + ".png")


if __name__ == "__main__":
    main()
