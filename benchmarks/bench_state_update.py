"""The Mamba-2 state update alone at serving batches: µs a layer and achieved bandwidth against the device-to-device
copy bandwidth measured in the same run, for an fp16 state, an int8 state with dynamic row scales on fp16 inputs
(the ``int8-state`` recipe) and an int8 state with a 16-group table on int8 inputs (Quamba2), at Mamba2-2.7B's and
Mamba2-8B's layer shapes; ``--baseline FILE`` also times another copy of ``ssmq/kernels/state_update.py`` (e.g. the
main branch's) in the same process. ``--sweep`` times ``STEP_CFG`` variants at batch 128; ``--e2e`` adds TPOT of
Mamba2-2.7B (random weights, CUDA graphs) FP16 and FP16 + int8 state.

    python benchmarks/bench_state_update.py --out out/su [--baseline ../ssmq/kernels/state_update.py] [--sweep]

Each call is one layer's step of ``batch`` rows; the calls of one CUDA graph walk through slot blocks spanning
>= 512 MB, so every call reads its rows from DRAM (not L2). Bytes a call: the state read and written (2 bytes a
value fp16, 1 int8) plus x, B, C, Δ, y and the row scales (read and written) as the model passes them.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ssmq.kernels import state_update as su  # noqa: E402
from ssmq.ops.quant_ssm import RowScales  # noqa: E402

DEV = "cuda"
SHAPES = {"mamba2-2.7b": (80, 64, 128, 1), "mamba2-8b": (128, 64, 128, 8)}  # (h, p, n, g)
KINDS = ("fp16", "int8rows", "int8table")
SPAN_BYTES = 512 << 20


def copy_bandwidth() -> float:
    """Bytes read + written a second by a 1 GiB device-to-device copy (median of 20, CUDA events)."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    times = []
    for _ in range(20):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1))
    del a, b
    return 2 * (1 << 30) / (sorted(times)[10] / 1e3)


def graph_ms(calls, reps: int = 15) -> float:
    """Median ms of one call, from replays of a CUDA graph of ``calls`` (closures run in order)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls[:2]:
            c()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) / len(calls))
    del g
    return sorted(times)[reps // 2]


def case(shape, b: int, kind: str, seed: int = 0):
    """(argument lists of ``quant_state_update`` for each slot block, bytes a call)."""
    h, p, n, g = shape
    gen = torch.Generator(device=DEV).manual_seed(seed)
    int8 = kind != "fp16"
    row_bytes = h * p * n * (1 if int8 else 2)
    blocks = max(2, math.ceil(SPAN_BYTES / (b * row_bytes)))
    s = blocks * b
    if int8:
        state = torch.randint(-128, 128, (s, h, p, n), device=DEV, dtype=torch.int8, generator=gen)
    else:
        state = torch.randn(s, h, p, n, device=DEV, dtype=torch.float16, generator=gen) * 0.1
    dt = torch.randn(b, h, device=DEV, dtype=torch.float16, generator=gen)[:, :, None].expand(b, h, p)
    A = (-torch.rand(h, device=DEV, generator=gen))[:, None, None].expand(h, p, n)
    D = torch.randn(h, device=DEV, generator=gen)[:, None].expand(h, p)
    dtb = torch.randn(h, device=DEV, generator=gen)[:, None].expand(h, p)
    io = b * h * 2  # Δ
    if kind == "int8table":
        table = torch.rand(16, n, device=DEV, generator=gen) * 0.01 + 1e-3
        index = torch.randint(0, 16, (h * p,), device=DEV, generator=gen)
        x = torch.randint(-128, 128, (b, h, p), device=DEV, dtype=torch.int8, generator=gen)
        B = torch.randint(-128, 128, (b, g, n), device=DEV, dtype=torch.int8, generator=gen)
        C = torch.randint(-128, 128, (b, g, n), device=DEV, dtype=torch.int8, generator=gen)
        xs = torch.rand(h, p, device=DEV, generator=gen) * 0.01 + 1e-3
        Bs, Cs = torch.full((g, n), 0.01, device=DEV), torch.full((g, n), 0.01, device=DEV)
        io += b * h * p * (1 + 2) + 2 * b * g * n  # x codes, y fp16, B, C codes
    else:
        table = RowScales(torch.rand(s, h, p, device=DEV, generator=gen) * 0.01 + 1e-3) if int8 else None
        index = None
        x = torch.randn(b, h, p, device=DEV, dtype=torch.float16, generator=gen)
        B = torch.randn(b, g, n, device=DEV, dtype=torch.float16, generator=gen)
        C = torch.randn(b, g, n, device=DEV, dtype=torch.float16, generator=gen)
        xs = Bs = Cs = None
        io += b * h * p * (2 + 2) + 2 * b * g * n * 2
        if int8:
            io += b * h * p * 4 * 2  # row scales read and written
    state_bytes = 2 * b * h * p * n * (1 if int8 else 2)
    slots = [torch.arange(k * b, (k + 1) * b, device=DEV) for k in range(blocks)]
    args = [[state, table, index, x, xs, dt, A, B, Bs, C, Cs, D, None, dtb, True, sl] for sl in slots]
    return args, state_bytes + io, {"out_dtype": torch.float16}


def time_impl(mod, shape, b: int, kind: str) -> tuple[float, int]:
    args, nbytes, kw = case(shape, b, kind)
    ms = graph_ms([lambda a=a: mod.quant_state_update(*a, **kw) for a in args])
    del args
    torch.cuda.empty_cache()
    return ms, nbytes


def load_baseline(path: str):
    spec = importlib.util.spec_from_file_location("ssmq.kernels._state_update_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_micro(batches, baseline, bw: float, out: dict) -> None:
    rows = out.setdefault("micro", [])
    for (model, shape), kind, b in itertools.product(SHAPES.items(), KINDS, batches):
        r = {"model": model, "kind": kind, "batch": b}
        for name, mod in (("new", su), ("old", baseline)):
            if mod is None:
                continue
            ms, nbytes = time_impl(mod, shape, b, kind)
            r[f"{name}_us"], r["bytes"] = ms * 1e3, nbytes
            r[f"{name}_TBps"] = nbytes / (ms * 1e-3) / 1e12
            r[f"{name}_of_copy"] = nbytes / (ms * 1e-3) / bw
        rows.append(r)
        print(json.dumps(r), flush=True)


KEYS = {"fp16": "float", "int8rows": "int8_rows", "int8table": "int8_table"}  # STEP_CFG's entry of each kind


def run_sweep(batch: int, bw: float, out: dict) -> dict:
    """STEP_CFG variants (tile, warps, NT tiles a program, prefetch; one slot's tiles first) on Mamba2-2.7B's layer at
    one batch; returns the settings they select: each kind's fastest, with programs_per_sm the programs an SM its NT
    gave (the rule that sets NT at other batches)."""
    rows = out.setdefault("sweep", [])
    saved = {k: dict(v) for k, v in su.STEP_CFG.items()}
    h, p, n, _ = SHAPES["mamba2-2.7b"]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # NT set directly: few programs an SM asked for, NT capped. 8 warps: a 128-register cap, two programs an SM
    grid = [dict(tile=t, num_warps=w, maxnreg=r, programs_per_sm=1e-3, max_tiles=nt, prefetch=pf, tiles_first=True)
            for (t, w, r), (nt, pf) in itertools.product(((4096, 4, None), (2048, 2, None), (8192, 8, 128)),
                                                         ((1, False), (2, False), (4, False), (8, False), (4, True)))]
    best = {}
    for kind in KINDS:
        key = KEYS[kind]
        timed = []
        for cfg in grid:
            su.STEP_CFG[key] = {**saved[key], **cfg}
            try:
                ms, nbytes = time_impl(su, SHAPES["mamba2-2.7b"], batch, kind)
                r = {"kind": kind, "batch": batch, **cfg, "us": ms * 1e3, "of_copy": nbytes / (ms * 1e-3) / bw}
                timed.append((ms, cfg))
            except Exception as e:  # noqa: BLE001 - a variant that fails to build is reported, not fatal
                r = {"kind": kind, "batch": batch, **cfg, "error": f"{type(e).__name__}: {str(e)[:160]}"}
            rows.append(r)
            print(json.dumps(r), flush=True)
        su.STEP_CFG[key] = saved[key]
        ms, cfg = min(timed, key=lambda m: m[0])
        tiles = h * -(-p // min(p, cfg["tile"] // n))
        best[key] = {**saved[key], **cfg, "max_tiles": 16,
                     "programs_per_sm": round(batch * tiles / cfg["max_tiles"] / sms, 2)}
    out["selected"] = best
    return best


def run_order(batches, bw: float, out: dict, repeats: int = 2) -> None:
    """The grid's order (batch rows first, or one slot's tiles first) at a few settings, each timed ``repeats``
    times (the spread between repeats is the noise), beside the baseline when given."""
    rows = out.setdefault("order", [])
    saved = {k: dict(v) for k, v in su.STEP_CFG.items()}
    variants = [dict(tile=4096, num_warps=4, maxnreg=None, programs_per_sm=1e-3, max_tiles=nt, prefetch=False,
                     tiles_first=tf) for nt in (1, 4) for tf in (False, True)]
    for kind, b in itertools.product(KINDS, batches):
        key = KEYS[kind]
        for rep in range(repeats):
            for cfg in variants:
                su.STEP_CFG[key] = {**saved[key], **cfg}
                ms, nbytes = time_impl(su, SHAPES["mamba2-2.7b"], b, kind)
                r = {"kind": kind, "batch": b, "rep": rep, **cfg, "us": ms * 1e3, "of_copy": nbytes / (ms * 1e-3) / bw}
                rows.append(r)
                print(json.dumps(r), flush=True)
            su.STEP_CFG[key] = saved[key]
            if BASELINE is not None:
                ms, nbytes = time_impl(BASELINE, SHAPES["mamba2-2.7b"], b, kind)
                r = {"kind": kind, "batch": b, "rep": rep, "impl": "old", "us": ms * 1e3,
                     "of_copy": nbytes / (ms * 1e-3) / bw}
                rows.append(r)
                print(json.dumps(r), flush=True)
    print(f"{'kind':10s} {'b':>4s} {'NT':>3s} {'order':>6s} "
          + " ".join(f"{'rep' + str(i):>7s}" for i in range(repeats)))
    groups = {}
    for r in rows:
        k = (r["kind"], r["batch"], r.get("max_tiles", "-"), "old" if r.get("impl") else
             ("tiles" if r["tiles_first"] else "rows"))
        groups.setdefault(k, []).append(100 * r["of_copy"])
    for (kind, b, nt, order), v in groups.items():
        print(f"{kind:10s} {b:4d} {nt!s:>3s} {order:>6s} " + " ".join(f"{x:7.1f}" for x in v))


BASELINE = None


def run_e2e(batches, steps: int, out: dict) -> None:
    """TPOT of Mamba2-2.7B (random weights) FP16 and FP16 + int8 state (the ``int8-state`` recipe) from replays of
    one captured decode graph a batch."""
    from bench_e2e import time_ms
    from published_configs import PUBLISHED
    from random_model import random_model

    from ssmq.quant import CalibrationData, quantize
    from ssmq.quant.recipe import get_recipe
    from ssmq.runtime.cuda_graph import CudaGraphDecoder

    def tpot(model, b, ssm_dtype):
        dec = CudaGraphDecoder(model, max_batch=b, max_seqlen=steps + 64, buckets=(b,), ssm_dtype=ssm_dtype)
        dec(torch.randint(0, 50000, (b,), device=DEV), torch.arange(b, device=DEV))
        graph = dec.graphs[b][0]

        def run():
            for _ in range(steps):
                graph.replay()

        ms = time_ms(run, warmup=1, reps=5) / steps
        del dec
        torch.cuda.empty_cache()
        return ms

    e2e = out.setdefault("e2e", {})
    model = random_model(PUBLISHED["mamba2-2.7b"], dtype=torch.float16)
    for b in batches:
        e2e[f"fp16_b{b}_ms"] = tpot(model, b, None)
        print("fp16", b, e2e[f"fp16_b{b}_ms"], flush=True)
    quantize(model, get_recipe("int8-state"), CalibrationData(torch.randint(0, 50000, (2, 64)), source="random tokens",
                                                              seed=0), progress=False)
    for b in batches:
        e2e[f"int8state_b{b}_ms"] = tpot(model, b, torch.int8)
        print("int8 state", b, e2e[f"int8state_b{b}_ms"], flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out/state_update"))
    ap.add_argument("--batches", default="32,64,128,256")
    ap.add_argument("--baseline", default="", help="another state_update.py to time beside this one")
    ap.add_argument("--sweep", default="", help="the batch to sweep STEP_CFG at (e.g. 128)")
    ap.add_argument("--e2e", default="", help="batches for Mamba2-2.7B TPOT (e.g. 32,128,256)")
    ap.add_argument("--skip-micro", action="store_true")
    ap.add_argument("--order", default="", help="batches to time the grid's order at (e.g. 32,128)")
    ap.add_argument("--tune", action="store_true", help="time the rest with the sweep's selection (step_cfg.json)")
    ap.add_argument("--step-cfg", default="", help="STEP_CFG entries to use (a step_cfg.json)")
    ap.add_argument("--steps", type=int, default=32)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_state_update: needs a CUDA GPU")
    out = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
           "torch": torch.__version__, "step_cfg": getattr(su, "STEP_CFG", None)}
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    bw = copy_bandwidth()
    out["copy_bandwidth_TBps"] = bw / 1e12
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s on {out['device']}", flush=True)
    global BASELINE
    if args.baseline:
        BASELINE = load_baseline(args.baseline)
    if args.order:
        run_order([int(b) for b in args.order.split(",")], bw, out)
        (path / "state_update.json").write_text(json.dumps(out, indent=1))
    if args.step_cfg:
        su.STEP_CFG.update(json.loads(Path(args.step_cfg).read_text()))
        out["step_cfg"] = su.STEP_CFG
    if args.sweep:
        best = run_sweep(int(args.sweep), bw, out)
        (path / "state_update.json").write_text(json.dumps(out, indent=1))
        if args.tune:
            su.STEP_CFG.update(best)
            out["step_cfg"] = su.STEP_CFG
            (path / "step_cfg.json").write_text(json.dumps(best, indent=1))
            print("selected", json.dumps(best), flush=True)
    if not args.skip_micro:
        run_micro([int(b) for b in args.batches.split(",")], BASELINE, bw, out)
        (path / "state_update.json").write_text(json.dumps(out, indent=1))
    if args.e2e:
        run_e2e([int(b) for b in args.e2e.split(",")], args.steps, out)
        (path / "state_update.json").write_text(json.dumps(out, indent=1))
    print(f"\ncopy {bw / 1e12:.3f} TB/s, {out['device']}")
    print(f"{'model':12s} {'kind':10s} {'batch':>5s} {'old us':>8s} {'new us':>8s} {'old %':>6s} {'new %':>6s}")
    for r in out.get("micro", []):
        print(f"{r['model']:12s} {r['kind']:10s} {r['batch']:5d} {r.get('old_us', math.nan):8.1f} {r['new_us']:8.1f} "
              f"{100 * r.get('old_of_copy', math.nan):6.1f} {100 * r['new_of_copy']:6.1f}")


if __name__ == "__main__":
    main()
