"""Device script: tune and time ``ssmq.kernels.qgemm_mid`` against quant_gemm's kernels and FP16 F.linear.

GPU time only: each point is a CUDA graph of calls that rotate through copies of the weight (together at least
twice the L2), replayed and timed with CUDA events, per call = graph time / calls; so no host launch time and no
weight in L2 (a model streams each layer's weight from HBM once a step). Compilation first, in parallel worker
processes (Triton's disk cache), each checking its point's result against the reference. Every (structure, tile,
waves) point is timed on Mamba2-2.7B and -8B in_proj / out_proj at 16-256 rows; per row count the point with the
least summed time wins. The winners become configs/qgemm_mid.json (ROWS_W4 / ROWS_W8, and ROUTE: the row counts
whose summed time beat quant_gemm's; EXCEPT: the shapes and rows of that route where quant_gemm was faster), written
for the device's name and as the default. Decode batches of 2-8 rows run the 16-row setting (its tiles pad them):
they are timed with it and the route extends down to them where it wins there too (1 row is the GEMVs').
--keep: time the shipped settings only (no sweep), to derive the route and EXCEPT again.
Usage: python benchmarks/device_qgemm_mid.py OUT_DIR [workers] [--keep]."""

import json
import sys
import time

import torch
import torch.nn.functional as F

from ssmq.bench.timing import copy_bandwidth, graph_us
from sweep_common import compile_points, logger, route_of, time_points, weight_copies

ROWS = [16, 32, 64, 128, 256]
LOW_ROWS = [2, 4, 8]  # served by the 16-row setting
CODE = {"w4": "int4", "w8": "int8"}  # the sweep's code names -> ROUTE / EXCEPT keys
SHAPES = {"2.7b in_proj": (10576, 2560), "2.7b out_proj": (2560, 5120), "8b in_proj": (18560, 4096),
          "8b out_proj": (4096, 8192)}
STRUCT = {"w4": [dict(SWAP=s, X_SPLIT=x, POST_SCALE=p) for s, x, p in ((True, 0, False), (True, 0, True),
                                                                     (False, 2, False))],
          "w8": [dict(SWAP=s, X_SPLIT=0, POST_SCALE=False) for s in (True, False)]}
TILES = [dict(BN=64, warps=4, stages=3), dict(BN=64, warps=4, stages=4), dict(BN=128, warps=8, stages=3)]
WAVES = {"w4": (1, 2), "w8": (1,)}
# GPS: groups (int4) or 128-wide steps (int8) a loop step, independent loads in flight
POINTS = [(code, rows, {**st, **t, "waves": wv, "GPS": gps, "BM": min(128, rows)}) for code in ("w4", "w8")
          for rows in ROWS for st in STRUCT[code] for t in TILES for wv in WAVES[code] for gps in (1, 2)]


def weights(name, code, dev, seed=0):
    from ssmq.ops.quant_linear import pack_int4

    n, k = SHAPES[name]
    g = torch.Generator(device=dev).manual_seed(seed)
    if code == "w16":
        return (torch.randn(n, k, device=dev, dtype=torch.float16, generator=g) * 0.02,)
    if code == "w4":
        c = torch.randint(-8, 8, (n, k), device=dev, dtype=torch.int8, generator=g)
        return pack_int4(c), torch.rand(n, k // 128, device=dev, generator=g) * 0.01 + 1e-3
    return (torch.randint(-127, 128, (n, k), device=dev, dtype=torch.int8, generator=g),
            torch.rand(n, device=dev, generator=g) * 0.01 + 1e-3)


def cfg_for(code, over):
    return {"ROWS_W4" if code == "w4" else "ROWS_W8": [{"BK": 128, **over, "max_rows": 1 << 20}]}


def _compile(chunk):
    """Worker: run each point once (Triton compiles it into the disk cache) and check it against the reference."""
    from ssmq.kernels import qgemm_mid as QM
    from ssmq.kernels import quant_gemm as QG
    from ssmq.ops.quant_linear import quant_linear_ref

    dev = torch.device("cuda")
    W, bad = {}, []
    for code, rows, over in chunk:
        for name, (n, k) in SHAPES.items():
            if (name, code) not in W:
                W[(name, code)] = weights(name, code, dev)
            w, s = W[(name, code)]
            x = torch.randn(rows, k, device=dev, dtype=torch.float16)
            try:
                if over is None:
                    QG.quant_linear(x, w, s)
                    continue
                out = QM.quant_linear_mid(x, w, s, cfg=cfg_for(code, over))
                ref = quant_linear_ref(x, w, s)
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                if not err < 3e-3:
                    bad.append((code, rows, over, name, f"rel err {err:.2e}"))
            except Exception as e:  # reported, the point is left out of the timing
                bad.append((code, rows, over, name, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"))
    torch.cuda.synchronize()
    return bad


def except_of(table: list, route: dict, rows_all: list) -> list:
    """EXCEPT entries: per code type and shape, the routed row counts where qgemm_mid measured slower than quant_gemm,
    each covering the rows from the measured count before it (the last one up to the route's end), adjacent ones
    merged."""
    out = []
    for code in ("w4", "w8"):
        lo_r, hi_r = route[CODE[code]]
        for name, (n, k) in SHAPES.items():
            lost = {r["rows"] for r in table if r["code"] == code and r["shape"] == name and r["new_us"] > r["old_us"]}
            spans = []
            for i, m in enumerate(rows_all):
                if m in lost and lo_r <= m <= hi_r:
                    lo, hi = (rows_all[i - 1] + 1 if i else lo_r), (m if i + 1 < len(rows_all) else hi_r)
                    if spans and spans[-1][1] + 1 == lo:
                        spans[-1][1] = hi
                    else:
                        spans.append([lo, hi])
            out += [dict(code=CODE[code], n=n, k=k, rows=sp) for sp in spans]
    return out


def main():
    out_dir = sys.argv[1]
    args = [a for a in sys.argv[2:] if a != "--keep"]
    keep = "--keep" in sys.argv
    workers = int(args[0]) if args else 14
    t0 = time.time()
    say = logger(out_dir)
    failed = set()
    if not keep:  # compile (and check) every point in parallel; the old path's kernels too
        jobs = POINTS + [(code, rows, None) for code in ("w4", "w8") for rows in ROWS]
        failed = compile_points(_compile, jobs, workers, say, len(SHAPES))

    from ssmq.kernels import configs
    from ssmq.kernels import qgemm_mid as QM
    from ssmq.kernels import quant_gemm as QG
    from ssmq.kernels._common import rows_entry

    dev = torch.device("cuda")
    copy_gbs = copy_bandwidth(dev) / 1e9
    say(f"device {torch.cuda.get_device_name()}; copy bandwidth {copy_gbs:.0f} GB/s")
    W = {(name, code): weight_copies(lambda seed, name=name, code=code: weights(name, code, dev, seed), dev)
         for name in SHAPES for code in ("w16", "w4", "w8")}
    all_rows = LOW_ROWS + ROWS
    X = {(name, m): torch.randn(m, SHAPES[name][1], device=dev, dtype=torch.float16) for name in SHAPES
         for m in all_rows}

    def t_new(code, name, m, over):
        cfg = cfg_for(code, over)
        x = X[(name, m)]
        return graph_us([lambda w=w, s=s: QM.quant_linear_mid(x, w, s, cfg=cfg) for w, s in W[(name, code)]], timings=3)

    def t_old(code, name, m):
        x = X[(name, m)]
        return graph_us([lambda w=w, s=s: QG.quant_linear(x, w, s) for w, s in W[(name, code)]], timings=3)

    def t_f16(name, m):
        x = X[(name, m)]
        return graph_us([lambda w=w: F.linear(x, w) for (w,) in W[(name, "w16")]], timings=3)

    data = json.loads(configs.path("qgemm_mid").read_text())
    tuned = data["devices"]["default"]
    if keep:  # the shipped entry of each row count, timed
        shipped = [(code, rows, {k: v for k, v in rows_entry(rows, 4 if code == "w4" else 8, tuned).items()
                                 if k != "max_rows"}) for code in ("w4", "w8") for rows in ROWS]
        best, res = time_points(shipped, failed, t_new, SHAPES, say, t0)
    else:
        best, res = time_points(POINTS, failed, t_new, SHAPES, say, t0)

    rows_out, route = [], {}
    for code in ("w4", "w8"):
        entries, wins = [], {}
        for rows in all_rows:
            near = min((r for c, r in best if c == code), key=lambda r: abs(r - rows))  # every point failed: nearest
            if rows in ROWS:
                entries.append({"BK": 128, **best[(code, near)]["over"], "BM": min(128, rows),
                                "max_rows": rows if rows < ROWS[-1] else 512})
            if near != rows and rows in ROWS:
                wins[rows] = False
                continue
            sums = [0.0, 0.0]
            for i, (name, (n, k)) in enumerate(SHAPES.items()):
                if rows in ROWS:
                    new = best[(code, rows)]["us"][i]
                else:  # decode rows: the nearest swept setting (16 rows), timed at this row count
                    new = t_new(code, name, rows, best[(code, near)]["over"])
                old, f16 = t_old(code, name, rows), t_f16(name, rows)
                w, s = W[(name, code)][0]
                nbytes = w.numel() * w.element_size() + s.numel() * 4 + rows * k * 2 + rows * n * 2
                rows_out.append(dict(code=code, shape=name, rows=rows, old_us=old, new_us=new, fp16_us=f16,
                                     new_GBs=nbytes / new / 1e3, copy_GBs=copy_gbs))
                sums[0] += old
                sums[1] += new
            wins[rows] = sums[1] < sums[0]
        tuned["ROWS_W4" if code == "w4" else "ROWS_W8"] = entries
        route[CODE[code]] = route_of(wins, all_rows, ROWS[-1])
        say(f"{code}: wins at {[m for m in all_rows if wins[m]]}")
    tuned["ROUTE"] = route
    tuned["EXCEPT"] = except_of(rows_out, route, all_rows)
    data["devices"]["default"] = tuned
    data["devices"][torch.cuda.get_device_name()] = tuned
    configs.path("qgemm_mid").write_text(json.dumps(data, indent=2) + "\n")
    json.dump(dict(device=torch.cuda.get_device_name(), copy_GBs=copy_gbs, table=rows_out, settings=tuned,
                   points=res), open(f"{out_dir}/qgemm_mid.json", "w"), indent=1)
    say(f"{'code':4} {'shape':14} {'rows':>4} {'old us':>7} {'new us':>7} {'fp16 us':>7} {'fp16/new':>8} {'GB/s':>5}")
    for r in rows_out:
        say(f"{r['code']:4} {r['shape']:14} {r['rows']:4d} {r['old_us']:7.1f} {r['new_us']:7.1f} {r['fp16_us']:7.1f} "
            f"{r['fp16_us'] / r['new_us']:8.2f} {r['new_GBs']:5.0f}")
    say(f"route {route}; except {tuned['EXCEPT']}; {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
