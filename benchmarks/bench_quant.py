"""Quantized speed: end-to-end TTFT / TPOT / memory of quantized models on the low-bit kernels vs FP16,
and a GEMV / GEMM micro-benchmark of the kernels vs cuBLAS FP16 and the weight-bandwidth limit.

    python benchmarks/bench_quant.py --models mamba2-2.7b --out out/quant [--micro] [--sweep] [--peers mamba_ssm]

Models have random weights at published configs (``published_configs.py``), quantized on the GPU by each
recipe (static scales calibrated on random tokens); with ``--via-disk`` (default: rtn-w4a16-g128) the
quantized model is saved and loaded back with ``ssmq.load_model(dir, device="cuda")``, recording the
loader's peak GPU memory. TTFT: prefill of --prompt-len tokens at batch 1 from CUDA graphs. TPOT: one
decode step from CUDA-graph replays at each batch. Limit: (model bytes + 2 * batch * state bytes) /
measured copy bandwidth (model bytes: every parameter and buffer, i.e. codes and scales).
Micro (--micro): each op at the in_proj / out_proj / lm_head shapes of the first model, for 1 ... 1024
rows, weights rotated through copies larger than L2, timed as CUDA-graph replays; dynamic-activation
formats include their activation quantization. --sweep: decode launch settings tried at batch 1.
Writes quant.json, quant.md and quant.png to --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_e2e import (bench_mamba_ssm, bench_model, copy_bandwidth, model_bytes, profile_prefill,  # noqa: E402
                       profile_step, time_ms)
from published_configs import PUBLISHED  # noqa: E402
from random_model import random_model  # noqa: E402

import ssmq  # noqa: E402
from ssmq import kernels  # noqa: E402
from ssmq.ops.quant_linear import pack_int4  # noqa: E402
from ssmq.quant import CalibrationData, quantize, save_quantized  # noqa: E402
from ssmq.quant.recipe import Recipe, get_recipe  # noqa: E402
from plotting import pyplot  # noqa: E402

RECIPES = "fp16,rtn-w8a16,rtn-w4a16-g128,static-w8a8,dynamic-w8a8,fp8-w8a8"


# ------------------------------------------------------------------------------------------ end to end

def timing_recipe(name: str, weights_rtn: bool) -> Recipe:
    """The recipe ``name``; with ``weights_rtn`` its GPTQ weights rounded to nearest instead (same stored format,
    same kernels, other code values: for timing only, GPTQ takes ~150 s per Mamba2-2.7B on the H100)."""
    recipe = get_recipe(name)
    if not weights_rtn:
        return recipe
    d = recipe.to_dict()
    for rule in d["linears"]:
        rule["weight"]["method"] = "rtn"
    return Recipe.from_dict(d)


def build(cfg, recipe: str, dtype, via_disk: bool, weights_rtn: bool = False) -> tuple[torch.nn.Module, dict]:
    """A random model quantized by ``recipe`` (on the GPU), optionally through a save / load round trip."""
    model = random_model(cfg, dtype=dtype)
    info: dict = {}
    if recipe == "fp16":
        return model, info
    spec = timing_recipe(recipe, weights_rtn)
    if spec.to_dict() != get_recipe(recipe).to_dict():
        info["weights"] = "rtn in place of gptq (timing only)"
    calib = CalibrationData(torch.randint(0, 50000, (4, 256)), source="random tokens", seed=0) \
        if spec.needs_calibration() else None
    t0 = time.time()
    quantize(model, spec, calib, progress=False)
    info["quantize_s"] = round(time.time() - t0, 1)
    if via_disk:
        with tempfile.TemporaryDirectory() as tmp:
            save_quantized(model, Path(tmp) / "q")
            del model
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            t0 = time.time()
            model = ssmq.load_model(Path(tmp) / "q", dtype=dtype, device="cuda")
            torch.cuda.synchronize()
            info["load_s"] = round(time.time() - t0, 1)
            info["load_peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    gc.collect()
    torch.cuda.empty_cache()
    return model, info


def run_e2e(args, bw, results) -> None:
    dtype = getattr(torch, args.dtype)
    batches = [int(b) for b in args.batches.split(",")]
    for name in args.models.split(","):
        cfg = PUBLISHED[name]
        entry = results["models"].setdefault(name, {})
        for recipe in tqdm(args.recipes.split(","), desc=name):
            gc.collect()
            torch.cuda.empty_cache()
            t0 = time.time()
            try:
                model, info = build(cfg, recipe, dtype, recipe in args.via_disk.split(","), args.weights_rtn)
                r = bench_model(model, [args.prompt_len], batches, args.steps)
                r["model_bytes"], r["state_bytes"] = model_bytes(model)
                r.update(info)
                r["limit"] = {f"tpot_b{b}_ms": (r["model_bytes"] + 2 * b * r["state_bytes"]) / bw * 1e3
                              for b in batches}
                if args.profile:
                    for b in (int(x) for x in args.profile_batches.split(",")):
                        r[f"profile_b{b}"] = profile_step(model, b, top=8)
                    r["profile_prefill"] = profile_prefill(model, args.prompt_len, top=10)
                del model
            except Exception as e:  # one recipe that cannot run is reported, not fatal
                r = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
            r["wall_s"] = round(time.time() - t0, 1)
            entry[recipe] = r
            print(name, recipe, json.dumps({k: v for k, v in r.items() if not k.startswith("profile")}), flush=True)
            save(results, args)
        if "mamba_ssm" in args.peers.split(","):
            gc.collect()
            torch.cuda.empty_cache()
            try:
                entry["mamba_ssm fp16"] = bench_mamba_ssm(cfg, [args.prompt_len], batches, dtype, args.steps)
            except Exception as e:
                entry["mamba_ssm fp16"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            print(name, "mamba_ssm", json.dumps(entry["mamba_ssm fp16"]), flush=True)
            save(results, args)


# ------------------------------------------------------------------------------------------ micro-benchmark

def shapes(cfg) -> dict[str, tuple[int, int]]:
    """(n, k) of the linears a decode step streams: in_proj, out_proj, lm_head."""
    d, di = cfg.d_model, cfg.d_inner
    n_in = 2 * di + 2 * cfg.ngroups * cfg.d_state + cfg.nheads if cfg.arch == "mamba2" else 2 * di
    return {"in_proj": (n_in, d), "out_proj": (d, di), "lm_head": (cfg.vocab_size, d)}


def make_op(fmt: str, n: int, k: int, dev="cuda"):
    """(weights tuple, bytes, op(x, weights) -> y) of one format; codes and scales random."""
    ch = torch.rand(n, device=dev) * 0.01 + 1e-3
    g = torch.rand(n, k // 128, device=dev) * 0.01 + 1e-3
    i8 = lambda: torch.randint(-128, 128, (n, k), device=dev, dtype=torch.int8)  # noqa: E731
    i4 = lambda: pack_int4(torch.randint(-8, 8, (n, k), device=dev, dtype=torch.int8))  # noqa: E731
    base, _, path = fmt.partition(":")
    # ":qmm": decode rows on the kernels before the word GEMV (WORD_MAX_ROWS = 0), for comparison
    cfg = {"cublas": {"PREFILL_A16": "cublas"}, "triton": {"PREFILL_A8": "triton"},
           "qmm": {"WORD_MAX_ROWS": 0}}.get(path)
    ql = kernels.dispatch._kernels("quant_gemm").quant_linear
    qla = kernels.dispatch._kernels("quant_gemm").quant_linear_act

    def a8(x, w, s, dtype=torch.int8):  # dynamic per-token codes, quantized inside the GEMM at decode sizes
        return qla(x, w, s, None, True, dtype, None, x.dtype, cfg=cfg)

    if base == "fp16-cublas":
        return (lambda: (torch.randn(n, k, device=dev, dtype=torch.float16),)), lambda x, w: F.linear(x, w[0])
    if base == "fp16-gemv":
        return (lambda: (torch.randn(n, k, device=dev, dtype=torch.float16),)), lambda x, w: kernels.linear(x, w[0])
    if base == "w8a16":
        return (lambda: (i8(), ch)), lambda x, w: ql(x, w[0], w[1], cfg=cfg)
    if base == "w4a16-g128":
        return (lambda: (i4(), g)), lambda x, w: ql(x, w[0], w[1], cfg=cfg)
    if base == "w4a16-g128-asym":
        z = torch.randint(-8, 8, (n, k // 128), device=dev, dtype=torch.int32)
        return (lambda: (i4(), g, z)), lambda x, w: ql(x, w[0], w[1], w[2], cfg=cfg)
    if base == "w8a8":
        return (lambda: (i8(), ch)), lambda x, w: a8(x, w[0], w[1])
    if base == "w4a8-g128":
        return (lambda: (i4(), g)), lambda x, w: a8(x, w[0], w[1])
    if base == "fp8":
        f8 = lambda: torch.randn(n, k, device=dev).clamp(-400, 400).to(torch.float8_e4m3fn)  # noqa: E731
        return (lambda: (f8(), ch)), lambda x, w: a8(x, w[0], w[1], torch.float8_e4m3fn)
    raise ValueError(fmt)


def time_op(make_w, op, rows: int, k: int, min_bytes: int = 400 << 20) -> tuple[float, int]:
    """Median µs of op(x, w) with weights rotated through copies over ``min_bytes`` (past L2), graph-replayed."""
    w0 = make_w()
    wbytes = sum(t.numel() * t.element_size() for t in w0)
    copies = [w0] + [make_w() for _ in range(min(31, max(1, math.ceil(min_bytes / wbytes)) - 1))]
    x = torch.randn(rows, k, device="cuda", dtype=torch.float16)
    for w in copies[:2]:
        op(x, w)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in copies:
            op(x, w)
    ms = time_ms(graph.replay, warmup=2, reps=10)
    del graph
    return ms * 1e3 / len(copies), wbytes


FORMATS = ("fp16-cublas,fp16-gemv,w8a16,w8a16:cublas,w4a16-g128,w4a16-g128:cublas,w4a16-g128-asym,w8a8,w8a8:triton,"
           "w4a8-g128,fp8")


def run_micro(args, bw, results) -> None:
    cfg = PUBLISHED[args.models.split(",")[0]]
    rows_list = [int(r) for r in args.micro_rows.split(",")]
    formats = args.formats.split(",")
    micro = results.setdefault("micro", {"model": args.models.split(",")[0], "rows": rows_list, "ops": {}})
    for sname, (n, k) in shapes(cfg).items():
        for fmt in tqdm(formats, desc=f"micro {sname}"):
            make_w, op = make_op(fmt, n, k)
            row = {}
            for rows in rows_list:
                try:
                    us, wbytes = time_op(make_w, op, rows, k)
                    row[rows] = us
                    row["limit_us"] = wbytes / bw * 1e6
                except Exception as e:
                    row[rows] = None
                    row["error"] = f"{type(e).__name__}: {str(e)[:150]}"
                gc.collect()
                torch.cuda.empty_cache()
            micro["ops"][f"{sname} {n}x{k} {fmt}"] = row
            print(sname, fmt, json.dumps(row), flush=True)
            save(results, args)  # after each op: a run cut short by a time limit keeps what it measured


SWEEP_FMA = [dict(FMA_MAX_ROWS=2, TILE_FMA=t, BK_FMA=bk, warps_fma=nw, stages_fma=ns)
             for t in (2048, 4096) for bk in (512, 1024) for nw in (2, 4) for ns in (1, 3)]
SWEEP_DOT = [dict(FMA_MAX_ROWS=0, BN_DEC=bn, warps_dec=4, stages_dec=ns) for bn in (16, 32, 64) for ns in (3, 5)]
# the tensor-core path's K split and K tile (SWEEP_FMA and SWEEP_DOT were measured on 2026-11-23, see CFG)
SWEEP_SPLIT = [dict(FMA_MAX_ROWS=0, BN_DEC=bn, stages_dec=ns, WAVES=wv, MIN_SPLIT_K=mk, BK_DEC=bk)
               for bn in (32, 64) for ns in (3, 5) for wv in (2, 6) for mk in (256, 512) for bk in (128, 256)]
# int -> fp16 by bit assembly or by conversion instructions (CFG's FAST_CVT), on the tensor-core decode path
# int4 decode: x's even / odd columns loaded apart (X_STRIDED) or split from one tile
SWEEP_W4 = [dict(FMA_MAX_ROWS=0, X_STRIDED=xs, BN_DEC=bn, stages_dec=ns, WAVES=wv)
            for xs in (True, False) for bn in (32, 64) for ns in (3, 5) for wv in (2, 6)]
SWEEP_CVT = [dict(FMA_MAX_ROWS=0, FAST_CVT=fc, BN_DEC=bn, stages_dec=ns, WAVES=wv)
             for fc in (True, False) for bn in (32, 64) for ns in (3, 5) for wv in (2, 6)]


# the word-load decode GEMV (_qgemv_words, CFG's WORD_MAX_ROWS): tile size and programs per SM before a K split
# (the first H100 sweep of TILE_W 128-512 x WAVES_W 2 / 6 measured within 1.4x of each other: the K loop's serial
# steps, not the tile, set the time; ITERS_W bounds them)
SWEEP_WORDS = [dict(TILE_W=t, ITERS_W=it, PREFETCH_W=pf) for t in (128, 256) for it in (1, 2, 4, 8, 16)
               for pf in (True, False) if (it > 1) == pf]


# weight-only batches of 17-128 rows (--micro-rows) on the Triton GEMM with one row tile and a K split in MID_SPLIT
# parts (the "mid" path up to 128 rows), against today's settings ({}) and the dequantize + cuBLAS route; split
# 1 / 2 / 4 bounds the float32 partials (M x N x split) that a K split writes
SWEEP_MID = [{}, dict(PREFILL_A16="cublas")] + [
    dict(MID_MAX_ROWS=128, BN_MID=bn, warps_mid=nw, stages_mid=ns, MID_SPLIT=sp)
    for bn in (32, 64, 128) for nw in (4, 8) for ns in (3,) for sp in (1, 2, 4)]


SWEEP_FORMATS = {"cvt": ("w4a16-g128", "w8a16"), "w4": ("w4a16-g128", "w4a8-g128"),
                 "words": ("w4a16-g128", "w8a16", "w8a8", "fp8"), "mid": ("w4a16-g128", "w8a16")}


def run_sweep(args, bw, results) -> None:
    """Launch settings of the quantized GEMV / GEMM at in_proj and out_proj, per format: at batch 1 the CUDA-core
    path (SWEEP_FMA), the tensor-core path with rows padded to 16 (SWEEP_DOT, FMA_MAX_ROWS=0) and the others; the
    "mid" sweep at each of --micro-rows. The best overall is applied (to the end-to-end run that follows).

    Best overall: the smallest sum over (shape, format, rows) of time / the best time of that (shape, format, rows).
    """
    qk = kernels.dispatch._kernels("quant_gemm")
    cfg = PUBLISHED[args.models.split(",")[0]]
    variants = {"all": SWEEP_FMA + SWEEP_DOT, "split": SWEEP_SPLIT, "cvt": SWEEP_CVT, "w4": SWEEP_W4,
                "words": SWEEP_WORDS, "mid": SWEEP_MID}[args.sweep]
    rows_list = [int(r) for r in args.micro_rows.split(",")] if args.sweep == "mid" else [1]
    times: dict = {}  # (shape, format, rows, variant) -> us
    for sname, (n, k) in list(shapes(cfg).items())[:2]:
        if args.sweep == "mid":  # the FP16 GEMM at the same rows, for scale
            make_w, op = make_op("fp16-cublas", n, k)
            print("sweep", sname, "fp16-cublas", {r: round(time_op(make_w, op, r, k)[0], 2) for r in rows_list},
                  flush=True)
        for fmt in SWEEP_FORMATS.get(args.sweep, ("w4a16-g128", "w8a16", "w8a8", "fp8")):
            make_w, _ = make_op(fmt, n, k)
            for rows in rows_list:
                for i, v in enumerate(tqdm(variants, desc=f"sweep {sname} {fmt} {rows} rows")):
                    def op(x, w, v=v, fmt=fmt):
                        if fmt in ("w8a8", "w4a8-g128", "fp8"):
                            act = torch.float8_e4m3fn if fmt == "fp8" else torch.int8
                            return qk.quant_linear_act(x, w[0], w[1], None, True, act, None, x.dtype, cfg=v)
                        return qk.quant_linear(x, *w, cfg=v)
                    try:
                        us, wbytes = time_op(make_w, op, rows, k, min_bytes=200 << 20)
                        times[(sname, fmt, rows, i)] = us
                    except Exception as e:
                        print("sweep", sname, fmt, rows, v, "failed", str(e)[:200])
                    gc.collect()
                mine = {i: t for (a, b, r, i), t in times.items() if (a, b, r) == (sname, fmt, rows)}
                if mine:
                    i = min(mine, key=mine.get)
                    print("sweep", sname, fmt, rows, f"best {mine[i]:.2f} us with {variants[i]} (today's "
                          f"{mine.get(0, float('nan')):.2f}), limit {wbytes / bw * 1e6:.2f} us", flush=True)
                results["sweep"] = {"variants": variants, "times_us": {
                    f"{a} {b} {r} {i}": round(t, 2) for (a, b, r, i), t in times.items()}}
                save(results, args)
    keys = {key[:3] for key in times}
    best = {key: min(t for kk, t in times.items() if kk[:3] == key) for key in keys}
    score = {i: sum(times.get((*key, i), 1e9) / best[key] for key in keys) for i in range(len(variants))}
    pick = min(score, key=score.get)
    qk.CFG.update(variants[pick])
    results["sweep"]["picked"] = variants[pick]
    print("sweep picked", variants[pick], "score", round(score[pick], 3), flush=True)
    save(results, args)


# ------------------------------------------------------------------------------------------ output

def save(results, args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "quant.json").write_text(json.dumps(results, indent=1))


def markdown(results, args) -> str:
    batches = [int(b) for b in args.batches.split(",")]
    L = args.prompt_len
    lines = [f"{results['device']}, {results['dtype']}, {results['date']}, copy bandwidth "
             f"{results['copy_bandwidth_GBps']:.0f} GB/s; times in ms (median), memory in GiB\n"]
    if any(results["models"].values()):
        cols = [f"TTFT {L}"] + [f"TPOT b{b}" for b in batches] + ["model GB", "peak b1 GiB", "load peak GiB"]
        lines += ["| model | recipe | " + " | ".join(cols) + " |", "|---" * (len(cols) + 2) + "|"]
        for name, entry in results["models"].items():
            for recipe, r in entry.items():
                if "error" in r:
                    lines.append(f"| {name} | {recipe} | {r['error'][:80]} |")
                    continue
                cells = [r.get(f"ttft_{L}_ms")] + [r.get(f"tpot_b{b}_ms") for b in batches]
                cells = [f"{c:.2f}" if c is not None else "" for c in cells]
                mb = r.get("model_bytes")
                cells += [f"{mb / 1e9:.2f}" if mb else "", f"{r['tpot_b1_peak_gib']:.2f}" if "tpot_b1_peak_gib" in r
                          else "", f"{r['load_peak_gib']:.2f}" if "load_peak_gib" in r else ""]
                lines.append(f"| {name} | {recipe} | " + " | ".join(cells) + " |")
                if "limit" in r:
                    lim = [""] + [f"{r['limit'].get(f'tpot_b{b}_ms', 0):.2f}" for b in batches] + ["", "", ""]
                    lines.append(f"| {name} | {recipe} limit | " + " | ".join(lim) + " |")
    if "micro" in results:
        m = results["micro"]
        lines += ["", f"GEMV / GEMM at {m['model']} shapes, µs per call (A8 formats include the activation quantize)",
                  "", "| op | " + " | ".join(f"{r} rows" for r in m["rows"]) + " | weight-read limit |",
                  "|---" * (len(m["rows"]) + 2) + "|"]
        for op, row in m["ops"].items():
            cells = [f"{row[r]:.1f}" if row.get(r) is not None else "—" for r in m["rows"]]
            lim = row.get("limit_us")
            lines.append(f"| {op} | " + " | ".join(cells) + f" | {'' if lim is None else f'{lim:.1f}'} |")
    return "\n".join(lines) + "\n"


def plot(results, args, path) -> None:
    plt = pyplot()
    if plt is None:
        return
    batches = [int(b) for b in args.batches.split(",")]
    models = [m for m, e in results["models"].items() if e]
    if not models:
        return
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, name in zip(axes[0], models):
        for recipe, r in results["models"][name].items():
            ys = [r.get(f"tpot_b{b}_ms") for b in batches]
            if any(y is not None for y in ys):
                ax.plot(batches, [y if y is not None else float("nan") for y in ys], marker="o", label=recipe)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch")
        ax.set_ylabel("TPOT (ms)")
        ax.set_title(name)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mamba2-2.7b,mamba2-8b,mamba-2.8b")
    ap.add_argument("--recipes", default=RECIPES)
    ap.add_argument("--peers", default="", help="comma list: mamba_ssm (FP16 peer in the same run)")
    ap.add_argument("--batches", default="1,8,32,128,256")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=32, help="decode steps per TPOT timing")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    ap.add_argument("--weights-rtn", action="store_true",
                    help="time GPTQ recipes with round-to-nearest weights (same format and kernels, no GPTQ solve)")
    ap.add_argument("--via-disk", default="rtn-w4a16-g128", help="recipes saved and loaded back before timing")
    ap.add_argument("--micro", action="store_true", help="GEMV / GEMM micro-benchmark at the first model's shapes")
    ap.add_argument("--micro-rows", default="1,2,8,16,32,1024")
    ap.add_argument("--formats", default=FORMATS)
    ap.add_argument("--sweep", nargs="?", const="all", choices=["all", "split", "cvt", "w4", "words", "mid"],
                    help="decode launch-setting sweep at batch 1: all paths, or the tensor-core path's K split")
    ap.add_argument("--no-e2e", action="store_true")
    ap.add_argument("--profile", action="store_true",
                    help="kernels of one eager decode step (at each --profile-batches) and one eager prefill per recipe")
    ap.add_argument("--profile-batches", default="1", help="batches of the profiled decode steps")
    ap.add_argument("--cfg", default="", help="JSON object of kernel launch settings (kernels.quant_gemm.CFG)")
    ap.add_argument("--out", default=os.environ.get("OUT", "out/quant"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_quant: needs a CUDA GPU")
    if args.cfg:
        kernels.dispatch._kernels("quant_gemm").CFG.update(json.loads(args.cfg))
    bw = copy_bandwidth()
    results = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "dtype": args.dtype,
               "torch": torch.__version__, "copy_bandwidth_GBps": bw / 1e9, "command": " ".join(sys.argv),
               "models": {}}
    if args.sweep:
        run_sweep(args, bw, results)
    results["kernel_cfg"] = dict(kernels.dispatch._kernels("quant_gemm").CFG)
    if args.micro:
        run_micro(args, bw, results)
    if not args.no_e2e:
        run_e2e(args, bw, results)
    save(results, args)
    table = markdown(results, args)
    (Path(args.out) / "quant.md").write_text(table)
    print(table)
    plot(results, args, Path(args.out) / "quant.png")


if __name__ == "__main__":
    main()
