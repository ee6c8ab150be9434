"""Device script: tune and time ``ssmq.kernels.qgemm_mid`` against quant_gemm's kernels and FP16 F.linear.

Stage 1 picks the structure (SWAP, X_SPLIT, POST_SCALE) at 32 and 128 rows on Mamba2-2.7B's in_proj and out_proj,
stage 2 the tiles (BN, warps, stages, waves) for each row count on Mamba2-2.7B and -8B in_proj / out_proj, both
scored by the sum of medians (CUDA events, L2 flushed). The winners become configs/qgemm_mid.json (ROWS_W4 /
ROWS_W8, and ROUTE: the row counts where the new kernel's sum beat the old one's), written for the device's name
and as the default. Usage: python benchmarks/device_qgemm_mid.py OUT_DIR [sweep seconds]."""

import copy
import json
import sys
import time

import torch
import torch.nn.functional as F

from ssmq.bench.timing import time_fn
from ssmq.kernels import configs
from ssmq.kernels import qgemm_mid as QM
from ssmq.kernels import quant_gemm as QG
from ssmq.ops.quant_linear import pack_int4, quant_linear_ref

OUT = sys.argv[1]
BUDGET = float(sys.argv[2]) if len(sys.argv) > 2 else 170.0
T0 = time.time()
dev = torch.device("cuda")
torch.manual_seed(0)
ROWS = [16, 32, 64, 128, 256]
SHAPES = {"2.7b in_proj": (10576, 2560), "2.7b out_proj": (2560, 5120), "8b in_proj": (18560, 4096),
          "8b out_proj": (4096, 8192)}
log = open(f"{OUT}/sweep_log.txt", "w")


def say(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    log.write(s + "\n")
    log.flush()


def t_us(fn, reps=30):
    reps = min(reps, int(__import__("os").environ.get("MAXREPS", 1000)))
    return time_fn(fn, dev, 5, reps, l2_flush=True).median_ms * 1e3


# copy bandwidth (bytes read + written / time of a 1 GiB copy)
a = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
b = torch.empty_like(a)
copy_us = time_fn(lambda: b.copy_(a), dev, 3, 10).median_ms * 1e3
COPY_GBS = 2 * a.numel() / copy_us / 1e3
del a, b
say(f"device {torch.cuda.get_device_name()}; copy bandwidth {COPY_GBS:.0f} GB/s")

W = {}
for name, (n, k) in SHAPES.items():
    w16 = torch.randn(n, k, device=dev, dtype=torch.float16) * 0.02
    c4 = torch.randint(-8, 8, (n, k), device=dev, dtype=torch.int8)
    c8 = torch.randint(-127, 128, (n, k), device=dev, dtype=torch.int8)
    W[name] = dict(w16=w16, w4=(pack_int4(c4), torch.rand(n, k // 128, device=dev) * 0.01 + 1e-3),
                   w8=(c8, torch.rand(n, device=dev) * 0.01 + 1e-3))
X = {(name, m): torch.randn(m, SHAPES[name][1], device=dev, dtype=torch.float16) for name in SHAPES for m in ROWS}


def cfg_with(code, over, rows):
    """CFG with every ROWS_<code> entry up to ``rows`` replaced by one entry (``over``) for exactly these rows."""
    key = "ROWS_W4" if code == "w4" else "ROWS_W8"
    base = QM._entry(rows, dict(bits=4 if code == "w4" else 8), QM.CFG)
    return {key: [{**base, **over, "max_rows": 1 << 20}]}


def new_fn(code, name, m, cfg):
    w, s = W[name][code]
    x = X[(name, m)]
    return lambda: QM.quant_linear_mid(x, w, s, cfg=cfg)


def check(code, name, m, cfg):
    w, s = W[name][code]
    x = X[(name, m)]
    out = QM.quant_linear_mid(x, w, s, cfg=cfg)
    ref = quant_linear_ref(x, w, s)
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    if not (err < 3e-3):
        raise RuntimeError(f"wrong result: rel err {err:.2e}")


def score(code, over, rows, shapes, reps=20):
    cfg = cfg_with(code, over, rows)
    tot = 0.0
    for name in shapes:
        check(code, name, rows, cfg)
        tot += t_us(new_fn(code, name, rows, cfg), reps)
    return tot


def search(code, cands, rows_list, shapes, tag):
    best = {}
    for rows in rows_list:
        res = []
        for over in cands:
            if time.time() - T0 > BUDGET:
                say(f"  [{tag}] time budget reached")
                break
            try:
                s = score(code, over, rows, shapes)
            except Exception as e:  # a variant that fails to compile or is wrong is reported and skipped
                say(f"  [{tag}] {code} rows {rows} {over}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:160]}")
                continue
            say(f"  [{tag}] {code} rows {rows} {over}: {s:.1f} us")
            res.append((s, over))
        if res:
            best[rows] = min(res, key=lambda r: r[0])[1]
    return best


STRUCT_W4 = [dict(SWAP=True, X_SPLIT=x, POST_SCALE=p) for x in (0, 1, 2) for p in (False, True)] + \
    [dict(SWAP=False, X_SPLIT=0, POST_SCALE=p) for p in (False, True)]
STRUCT_W8 = [dict(SWAP=s, X_SPLIT=0, POST_SCALE=False) for s in (True, False)]
TILES = [dict(BN=64, warps=4, stages=3), dict(BN=64, warps=4, stages=4), dict(BN=128, warps=8, stages=3)]
tuned = copy.deepcopy(configs.entry(json.loads(configs.path("qgemm_mid").read_text()), "default"))
s1 = ["2.7b in_proj", "2.7b out_proj"]
for code, struct, share in (("w4", STRUCT_W4, 0.7), ("w8", STRUCT_W8, 1.0)):
    key = "ROWS_W4" if code == "w4" else "ROWS_W8"
    BUDGET_ALL, BUDGET = BUDGET, (time.time() - T0) + share * (BUDGET - (time.time() - T0))
    b1 = search(code, struct, [32, 128], s1, "structure")
    # one structure a row range: the best at 32 rows for up to 64, the best at 128 above; tiles per row count,
    # the most served counts first (a count left untuned when the time is up takes its nearest tuned neighbour's)
    b2 = {}
    for rows in (32, 128, 64, 256, 16):
        st = b1.get(32 if rows <= 64 else 128) or b1.get(32) or b1.get(128) or {}
        cands = [{**st, **t, "waves": wv} for t in TILES for wv in (1, 2)]
        b2.update(search(code, cands, [rows], list(SHAPES), "tiles"))
    entries = []
    for rows in ROWS:
        near = min(b2, key=lambda r: abs(r - rows)) if b2 else None
        st = b1.get(32 if rows <= 64 else 128) or {}
        e = {**QM._entry(rows, dict(bits=4 if code == "w4" else 8), QM.CFG), **st,
             **(b2[near] if near is not None else {}), "max_rows": rows if rows < ROWS[-1] else 512,
             "BM": min(128, rows)}
        entries.append(e)
    tuned[key] = entries
    BUDGET = BUDGET_ALL
QM.CFG.update(tuned)
say(f"tuned settings: {json.dumps(tuned)}")

# final table: old path (quant_gemm as routed before), new (tuned), FP16 F.linear
rows_out = []
route = {}
for code in ("w4", "w8"):
    wins = {}
    for m in ROWS:
        sums = [0.0, 0.0]
        for name, (n, k) in SHAPES.items():
            w, s = W[name][code]
            x = X[(name, m)]
            old = t_us(lambda: QG.quant_linear(x, w, s), 50)
            new = t_us(lambda: QM.quant_linear_mid(x, w, s), 50)
            f16 = t_us(lambda: F.linear(x, W[name]["w16"]), 50)
            nbytes = w.numel() * w.element_size() + s.numel() * 4 + x.numel() * 2 + m * n * 2
            rows_out.append(dict(code=code, shape=name, rows=m, old_us=old, new_us=new, fp16_us=f16,
                                 new_GBs=nbytes / new / 1e3, copy_GBs=COPY_GBS))
            sums[0] += old
            sums[1] += new
        wins[m] = sums[1] < sums[0]
    ok = [m for m in ROWS if wins[m]]
    lo_i = next((i for i, m in enumerate(ROWS) if wins[m]), None)
    if lo_i is None:
        route["int4" if code == "w4" else "int8"] = [1, 0]
        continue
    hi_i = lo_i
    while hi_i + 1 < len(ROWS) and wins[ROWS[hi_i + 1]]:
        hi_i += 1
    lo = ROWS[lo_i] if lo_i == 0 else ROWS[lo_i - 1] + 1
    route["int4" if code == "w4" else "int8"] = [lo, ROWS[hi_i] if hi_i < len(ROWS) - 1 else 256]
    say(f"{code}: wins at {ok}")
tuned["ROUTE"] = route
data = json.loads(configs.path("qgemm_mid").read_text())
data["devices"]["default"] = tuned
data["devices"][torch.cuda.get_device_name()] = tuned
configs.path("qgemm_mid").write_text(json.dumps(data, indent=2) + "\n")
json.dump(dict(device=torch.cuda.get_device_name(), copy_GBs=COPY_GBS, rows=rows_out, settings=tuned),
          open(f"{OUT}/qgemm_mid.json", "w"), indent=1)
say(f"{'code':4} {'shape':14} {'rows':>4} {'old us':>8} {'new us':>8} {'fp16 us':>8} {'new/fp16':>8} {'GB/s':>6}")
for r in rows_out:
    say(f"{r['code']:4} {r['shape']:14} {r['rows']:4d} {r['old_us']:8.1f} {r['new_us']:8.1f} {r['fp16_us']:8.1f} "
        f"{r['fp16_us'] / r['new_us']:8.2f} {r['new_GBs']:6.0f}")
say(f"route {route}; sweep+table {time.time() - T0:.0f} s")
