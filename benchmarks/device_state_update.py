"""The plain Mamba-2 state update's achieved bandwidth against the device-to-device copy bandwidth, per state format,
batch and launch-settings variant, on one GPU (run on the device machine).

    python3 benchmarks/device_state_update.py --rows 32,128,256 --variants benchmarks/state_update_variants.json \
        --label tree --out $OUT

Each call is one layer's step on a block of ``batch`` slots; K blocks span >= 512 MB so that every call reads its
rows from DRAM; K calls, one a block, are captured in a CUDA graph (no host gaps) and the graph replayed, the time a
call = the replays' median / K. Bytes = state read + written plus x, B, C, dt, y and row scales (as
``ssmq bench kernels --only state-update`` counts them); % of the 1 GiB device-to-device copy bandwidth (read +
written) measured in the same run. A variant sets entries of ``STEP_CFG[format]`` (``ssmq/kernels/configs/
state_update.json``) in place ("one.KEY": of the one-tile kernel's settings, ``CFG["int8"]`` for an int8 state);
each variant's output is checked against the reference first (y, codes within one step, as the GPU tests).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import os

import torch

from ssmq.bench.kernels import state_update_inputs
from ssmq.bench.timing import copy_bandwidth, graph_us
from ssmq.kernels import state_update as su
from ssmq.ops.quant_ssm import RowScales, quant_state_update_ref

H, P, N, G = 80, 64, 128, 1  # Mamba2-2.7B's layer
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # (the CPU: a smoke test under the Triton interpreter)
if DEV == "cpu":
    H = int(os.environ.get("SMOKE_HEADS", "2"))
FMTS = {"fp16": "float", "int8 row scales": "int8_rows", "int8 table": "int8_table"}


def case(kind: str, b: int, gen):
    """(calls, check, nbytes): K calls on K slot blocks, a check of block 0 against the reference."""
    dev, f = DEV, torch.float16
    int8 = kind != "fp16"
    per_slot = H * P * N * (1 if int8 else 2)
    K = max(2, -(-(512 << 20) // (b * per_slot))) if DEV == "cuda" else 2
    S = K * b
    args, io = state_update_inputs("16-bit" if kind == "fp16" else kind, b, S, (H, P, N, G), dev, f, gen)
    state, table, index = args[:3]
    idx = [torch.arange(k * b, (k + 1) * b, device=dev, dtype=torch.int32) for k in range(K)]
    rest = args[3:]

    def call(k):
        return su.quant_state_update(state, table, index, *rest, state_batch_indices=idx[k], out_dtype=f)

    def check():
        st0 = state.clone()
        tb0 = RowScales(table.scale.clone()) if isinstance(table, RowScales) else table
        y = su.quant_state_update(st0, tb0, index, *rest, state_batch_indices=idx[0], out_dtype=f)
        st1 = state.clone()
        tb1 = RowScales(table.scale.clone()) if isinstance(table, RowScales) else table
        yr = quant_state_update_ref(st1, tb1, index, *rest, state_batch_indices=idx[0], out_dtype=f)
        ey = ((y.float() - yr.float()).norm() / yr.float().norm()).item()
        rows = idx[0].long()
        if int8:
            d = (st0[rows].int() - st1[rows].int()).abs()
            ok = ey < 1e-2 and d.max().item() <= 1 and (d > 0).float().mean().item() < 1e-3
            return ok, f"y {ey:.1e}, codes off {(d > 0).float().mean().item():.1e}"
        es = ((st0[rows].float() - st1[rows].float()).norm() / st1[rows].float().norm()).item()
        return ey < 1e-2 and es < 1e-3, f"y {ey:.1e}, state {es:.1e}"

    return call, K, check, 2 * b * per_slot + io


def time_graph(call, K, reps=20) -> float:
    """Microseconds a call: K calls (one a block) in a CUDA graph, its replays' median / K."""
    if DEV == "cpu":
        t0 = time.perf_counter()
        call(0)
        return (time.perf_counter() - t0) * 1e6
    return graph_us([lambda k=k: call(k) for k in range(K)], reps=1, timings=reps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="32,128,256")
    ap.add_argument("--variants", default=None, help="JSON file: {format: {name: {STEP_CFG entries}}}")
    ap.add_argument("--kinds", default=",".join(FMTS))
    ap.add_argument("--label", default="tree")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    variants = json.loads(Path(args.variants).read_text()) if args.variants else {}
    bw = copy_bandwidth() if DEV == "cuda" else 1e10
    name = torch.cuda.get_device_name() if DEV == "cuda" else "cpu"
    print(f"{name}: copy bandwidth {bw / 1e9:.0f} GB/s (read + written)", flush=True)
    rows = []
    gen = torch.Generator(device=DEV).manual_seed(0)
    for kind in args.kinds.split(","):
        fmt = FMTS[kind]
        for b in (int(r) for r in args.rows.split(",")):
            call, K, check, nbytes = case(kind, b, gen)
            for vname, over in {"shipped": {}, **variants.get(fmt, {})}.items():
                saved = dict(su.STEP_CFG[fmt])
                one = su.CFG["int8"] if fmt != "float" else su.CFG  # the one-tile kernel's ("one.KEY" entries)
                saved_one = dict(one)
                su.STEP_CFG[fmt].update({k: v for k, v in over.items() if not k.startswith("one.")})
                one.update({k[4:]: v for k, v in over.items() if k.startswith("one.")})
                t0 = time.time()
                try:
                    ok, why = check()
                    us = time_graph(call, K)
                    nt = su._step_grid(b, H, P, N, fmt, torch.device(DEV))[3]
                    row = {"label": args.label, "state": kind, "batch": b, "variant": vname, "NT": nt, "us": us,
                           "GB_s": nbytes / us / 1e3, "pct_copy": 100 * nbytes / (us * 1e-6) / bw, "check": why,
                           "ok": ok}
                except Exception as e:  # a variant that cannot launch is reported, the others still run
                    row = {"label": args.label, "state": kind, "batch": b, "variant": vname,
                           "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"}
                finally:
                    su.STEP_CFG[fmt].clear()
                    su.STEP_CFG[fmt].update(saved)
                    one.clear()
                    one.update(saved_one)
                rows.append(row)
                print(json.dumps(row), f"({time.time() - t0:.1f} s)", flush=True)
            del call, check
            torch.cuda.empty_cache()
    res = {"gpu": name, "date": time.strftime("%Y-%m-%d"), "copy_GBps": bw / 1e9,
           "torch": torch.__version__, "rows": rows}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"state-update-{args.label}.json").write_text(json.dumps(res, indent=1))
    print(f"\n{args.label}: {res['gpu']}, copy {bw / 1e9:.0f} GB/s")
    for r in rows:
        if "error" in r:
            print(f"{r['state']:16s} {r['batch']:4d} {r['variant']:24s} ERROR {r['error'][:80]}")
        else:
            print(f"{r['state']:16s} {r['batch']:4d} {r['variant']:24s} NT {r['NT']:2d} {r['us']:8.1f} us "
                  f"{r['pct_copy']:5.1f}% {'ok' if r['ok'] else 'BAD ' + r['check']}")


if __name__ == "__main__":
    main()
