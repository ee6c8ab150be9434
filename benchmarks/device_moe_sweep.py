"""Device script: time launch settings of the grouped MoE (``ssmq.kernels.moe``) on weight-only int4 / int8 experts
at a published MoE shape and write the fastest as the GPU's entry of ``configs/moe.json``.

GPU time only: each point is a CUDA graph of calls that rotate through copies of the expert stacks (together at least
twice the L2) and through different routings, replayed and timed with CUDA events, per call = graph time / calls. A
point is one whole ``moe_experts`` call (block tables, up, down): the up launch's candidates are timed with the down
launch at the shipped settings and vice versa, so differences between candidates are the launch's own. Compilation
first, in parallel worker processes (``sweep_common``), each checking its point against the reference
(``ops.moe.moe_experts_ref``). Per token count the block rows (BM, shared by both launches) with the least summed
best-up + best-down time win; the table gets one entry a token count (max_rows: the mean pairs an expert).
Usage: python benchmarks/device_moe_sweep.py OUT_DIR [workers] [--write]."""

import copy
import json
import math
import os
import sys
import time

import torch

SMOKE = os.environ.get("SMOKE") == "1"  # the CPU: tiny experts under Triton's interpreter (a check of this script)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
SHAPE = "granite-4.0-h-tiny"
TOKENS = [1, 64] if SMOKE else [1, 64, 1024]
BMS = {1: [16], 64: [16, 32], 1024: [16, 32, 64]}
FMTS = ["int4", "int8"]
BASE = {"BN": 64, "BK": 64, "warps": 8, "stages": 3, "CVT": 0}  # the settings before this sweep
STRUCT = {"int4": [dict(POST=p, XS=x, SWAP=s) for p, x, s in ((False, 2, False), (True, 2, False), (False, 0, True),
                                                                (False, 1, False))],
          "int8": [dict(POST=p, XS=0, SWAP=s) for p, s in ((False, False), (True, False), (False, True))]}
TILES = [dict(BN=16, BK=128, warps=4, stages=3), dict(BN=32, BK=128, warps=4, stages=3),
         dict(BN=64, BK=128, warps=4, stages=3), dict(BN=128, BK=128, warps=8, stages=3)]
LAUNCHES = {fmt: [BASE] + [dict(CVT=1, **st, **t) for st in STRUCT[fmt] for t in TILES] for fmt in FMTS}
POINTS = [(fmt, which, i, bm) for fmt in FMTS for which in ("up", "down") for i in range(len(LAUNCHES[fmt]))
          for bm in sorted({b for bs in BMS.values() for b in bs})]


def dims():
    from ssmq.bench.models import published_config

    if SMOKE:
        return 256, 128, 8, 2
    cfg = published_config(SHAPE)
    return cfg.d_model, cfg.moe_hidden, cfg.moe_experts, cfg.moe_top_k


def stacks(fmt, dev, seed=0):
    """(up, down, gate, s_up, s_down, s_gate) of E experts in fmt (float16 for "float": no scales)."""
    from ssmq.ops.quant_linear import pack_int4

    d, f, E, k = dims()
    g = torch.Generator(device=dev).manual_seed(seed)
    out, scales = [], []
    for n, kk in ((f, d), (d, f), (f, d)):
        if fmt == "float":
            out.append(torch.randn(E, n, kk, device=dev, generator=g).half() / kk ** 0.5)
            continue
        if fmt == "fp8-w8a8":
            out.append((torch.randn(E, n, kk, device=dev, generator=g) * 100).clamp(-448, 448).to(
                torch.float8_e4m3fn))
            scales.append(torch.rand(E, n, device=dev, generator=g) * 0.01 + 1e-3)
            continue
        lim = 8 if fmt == "int4" else 128
        q = torch.randint(-lim, lim, (E, n, kk), device=dev, dtype=torch.int8, generator=g)
        out.append(pack_int4(q) if fmt == "int4" else q)
        scales.append(torch.rand(E, n, *((kk // 128,) if fmt == "int4" else ()), device=dev, generator=g) * 0.01
                      + 1e-3)
    return (*out, *scales)


def routing(t, dev, seed):
    d, f, E, k = dims()
    g = torch.Generator(device=dev).manual_seed(1000 + seed)
    x = torch.randn(t, d, device=dev, dtype=torch.float16, generator=g)
    idx = torch.stack([torch.randperm(E, device=dev, generator=g)[:k] for _ in range(t)])
    rw = torch.rand(t, k, device=dev, generator=g).softmax(-1)
    return x, rw, idx


def table_for(fmt, which, launch, bm):
    """A table whose only ``fmt`` entry runs ``launch`` for ``which`` ("up" / "down"), the other at BASE."""
    from ssmq.kernels import moe

    cfg = copy.deepcopy(moe.CFG)
    other = "down" if which == "up" else "up"
    cfg[fmt] = [{"max_rows": None, "BM": bm, which: launch, other: BASE}]
    return cfg


def point(which, i, bm) -> dict:
    """A point's settings as compile_points keys them (with its format and token count)."""
    return {"which": which, "launch": i, "BM": bm}


def _compile(chunk):
    """Worker: run each point once at each token count it serves (Triton compiles it into the disk cache) and check
    it against the reference."""
    from ssmq.kernels import moe
    from ssmq.ops.moe import moe_experts_ref

    dev = torch.device(DEV)
    W, R, bad = {}, {}, []
    for fmt, which, i, bm in chunk:
        if fmt not in W:
            W[fmt] = stacks(fmt, dev)
        up, down, gate, *sc = W[fmt]
        sc = tuple(sc) or None
        for t in (t for t in TOKENS if bm in BMS[t]):
            x, rw, idx = routing(t, dev, 0)
            if (fmt, t) not in R:
                R[(fmt, t)] = moe_experts_ref(x, rw, idx, up, down, gate, "silu", sc)
            ref = R[(fmt, t)]
            try:
                out = moe.moe_experts(x, rw, idx, up, down, gate, "silu", sc,
                                      cfg=table_for(fmt, which, LAUNCHES[fmt][i], bm))
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                if not err < 3e-3:
                    bad.append((fmt, t, point(which, i, bm), SHAPE, f"rel err {err:.2e}"))
            except Exception as e:  # reported, the point is left out of the timing
                why = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                bad.append((fmt, t, point(which, i, bm), SHAPE, why))
    if DEV == "cuda":
        torch.cuda.synchronize()
    return bad


def main():
    out_dir = sys.argv[1]
    workers = int(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2].isdigit() else 14
    write = "--write" in sys.argv
    t0 = time.time()
    if SMOKE:  # a few points of each kind, one process
        sys.path.insert(0, "tests")
        from test_kernels import _patch_interpreter_scalars

        _patch_interpreter_scalars()
        bad = _compile([p for p in POINTS if p[2] in (0, 2, 5, 9, 13) and p[3] == 16])
        print(f"smoke: {len(bad)} failed", bad[:5])
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from sweep_common import compile_points, logger, weight_copies

    say = logger(out_dir)
    failed = compile_points(_compile, POINTS, workers, say, 1)

    from ssmq.bench.timing import graph_us
    from ssmq.bench.tune import save
    from ssmq.kernels import configs, moe

    dev = torch.device("cuda")
    d, f, E, k = dims()
    name = torch.cuda.get_device_name()
    say(f"device {name}; {SHAPE}: d {d}, f {f}, {E} experts, top-{k}")
    # copies of the stacks (and their scales) together at least twice the L2
    W = {fmt: weight_copies(lambda seed, fmt=fmt: stacks(fmt, dev, seed), dev) for fmt in FMTS + ["float", "fp8-w8a8"]}
    ROUT = {t: [routing(t, dev, s) for s in range(8)] for t in TOKENS}

    def t_call(fmt, t, cfg):
        ws = W[fmt]
        n = max(len(ws), 8)
        return graph_us([lambda i=i: moe.moe_experts(*ROUT[t][i % 8], *ws[i % len(ws)][:3], "silu",
                                                     tuple(ws[i % len(ws)][3:]) or None, fmt == "fp8-w8a8",
                                                     cfg=cfg)
                         for i in range(n)])

    rows = []
    for fmt, which, i, bm in POINTS:
        for t in (t for t in TOKENS if bm in BMS[t]):
            if (fmt, t, json.dumps(point(which, i, bm), sort_keys=True)) in failed:
                continue
            us = t_call(fmt, t, table_for(fmt, which, LAUNCHES[fmt][i], bm))
            rows.append(dict(fmt=fmt, which=which, launch=i, BM=bm, tokens=t, us=us, **LAUNCHES[fmt][i]))
    say(f"timed {len(rows)} points by {time.time() - t0:.0f} s")

    # per (fmt, tokens): the best launch per kernel at each BM; the BM with the least best-up + best-down
    best, entries = {}, {}
    for fmt in FMTS:
        entries[fmt] = []
        for t in TOKENS:
            base = next(r["us"] for r in rows if r["fmt"] == fmt and r["tokens"] == t and r["launch"] == 0
                        and r["BM"] == 16 and r["which"] == "up")
            choice = None
            for bm in BMS[t]:
                pick = {}
                for which in ("up", "down"):
                    cand = [r for r in rows if r["fmt"] == fmt and r["tokens"] == t and r["BM"] == bm
                            and r["which"] == which]
                    if cand:
                        pick[which] = min(cand, key=lambda r: r["us"])
                if len(pick) < 2:
                    continue
                # each candidate's time holds the other launch at BASE: the gains over BASE add up
                both = next(r["us"] for r in rows if r["fmt"] == fmt and r["tokens"] == t and r["BM"] == bm
                            and r["launch"] == 0 and r["which"] == "up")
                score = pick["up"]["us"] + pick["down"]["us"] - both
                if choice is None or score < choice[0]:
                    choice = (score, bm, pick)
            _, bm, pick = choice
            entry = {"max_rows": -(-t * k // E), "BM": bm,
                     **{w: {kk: pick[w][kk] for kk in LAUNCHES[fmt][pick[w]["launch"]]} for w in ("up", "down")}}
            entries[fmt].append(entry)
            best[(fmt, t)] = (base, pick["up"]["us"], pick["down"]["us"], bm)
            say(f"{fmt:5s} {t:5d} tokens: base {base:8.1f} us; best up {pick['up']['us']:8.1f} "
                f"({LAUNCHES[fmt][pick['up']['launch']]}), best down {pick['down']['us']:8.1f} "
                f"({LAUNCHES[fmt][pick['down']['launch']]}), BM {bm}")
        # ranges between the token counts timed: the geometric middle of their mean rows an expert
        for a, b in zip(entries[fmt], entries[fmt][1:]):
            a["max_rows"] = int(math.sqrt(a["max_rows"] * b["max_rows"]))
        entries[fmt][-1]["max_rows"] = None

    tuned = copy.deepcopy(moe.CFG)
    for fmt in FMTS:
        tuned[fmt] = entries[fmt]
    # the chosen table against the shipped one, and float16 / FP8 W8A8 experts, whole calls
    final = []
    for t in TOKENS:
        ref = {fmt: t_call(fmt, t, None) for fmt in ("float", "fp8-w8a8")}
        for fmt in FMTS:
            before, after = t_call(fmt, t, None), t_call(fmt, t, tuned)
            final.append(dict(fmt=fmt, tokens=t, before_us=before, after_us=after, float16_us=ref["float"],
                              fp8_w8a8_us=ref["fp8-w8a8"]))
    json.dump({"gpu": name, "date": time.strftime("%Y-%m-%d"), "shape": SHAPE, "rows": rows, "final": final,
               "entries": entries, "failed": sorted(failed)}, open(f"{out_dir}/moe_sweep.json", "w"), indent=1)
    if write:
        settings = configs.entry(json.loads(configs.path("moe").read_text()), name)
        settings.update(entries)
        say(f"wrote {save('moe', name, settings)}")
    say(f"\n{name}, {SHAPE}, whole moe_experts call (block tables + up + down), us, CUDA graphs, weights from HBM")
    say(f"{'fmt':5s} {'tokens':>6s} {'before':>8s} {'after':>8s} {'float16':>8s} {'fp8-w8a8':>8s}")
    for r in final:
        say(f"{r['fmt']:5s} {r['tokens']:6d} {r['before_us']:8.1f} {r['after_us']:8.1f} {r['float16_us']:8.1f} "
            f"{r['fp8_w8a8_us']:8.1f}")
    for fmt in FMTS:
        say(fmt, json.dumps(entries[fmt]))
    say(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
