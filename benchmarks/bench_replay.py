"""State checkpointing (ReplaySSM) benchmark, one GPU: the checkpointed decode step (state written once every K
steps, the steps since replayed from a ring of their inputs) vs the plain write-every-step one, fp16 and int8 state.

    PYTHONPATH=. python benchmarks/bench_replay.py --out out/replay [--batches 1,32,128,256] [--e2e] [--k 16]

Micro: Mamba2-2.7B's state update (h 80, p 64, n 128, g 1), one layer per call, over >= 256 MB of states (one block
of ``batch`` slots per call, the calls of one CUDA graph walking the blocks: DRAM, not L2, as 64 layers would).
fp16 state: fp16 x, B, C; int8 state: int8 codes with scales (Quamba2), a 16-group state table. The rings' counts
are staggered (slot i starts at i mod K): every call mixes all ring fills, the steady state of a server whose
sequences started at different times. Bytes moved per call, and their limit at 3.35 TB/s (H100 SXM HBM3):
    plain   state read + write (2 bytes a value fp16, 1 int8) + x, B, C, Δ, y
    replay  state read + write / K + the ring read (on average (K-1)/2 entries of x, Δ, B) + one entry appended
            · (K-1)/K + the same x, B, C, Δ, y + the counts
E2E (``--e2e``): TPOT of Mamba2-2.7B (random weights, fp16) at batch 1 / 128 / 256 from CUDA graphs, fp16 and int8
state (scales set, not calibrated: timing only), each plain and checkpointed, over 2·K steps (whole ring cycles).
Writes replay.json and replay.png to --out (after every number: a timeout keeps what was measured).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_int8_ssm import graph_ms, tpot  # noqa: E402
from published_configs import PUBLISHED  # noqa: E402
from random_model import random_model  # noqa: E402

from ssmq.kernels import state_update  # noqa: E402
from ssmq.kernels.state_update import quant_state_update, replay_state_update  # noqa: E402
from ssmq.ops.replay_ssm import StateRing  # noqa: E402
from plotting import log_axes, pyplot  # noqa: E402

DEV = "cuda"
H, P, N, G = 80, 64, 128, 1  # Mamba2-2.7B: 80 heads of 64, d_state 128, one B/C group
STATE_GROUPS = 16
HBM_BPS = 3.35e12
SPAN_BYTES = 256 << 20


def _inputs(b: int, int8: bool, gen):
    """Step arguments after the state (``quant_state_update`` order from x on): codes + scales or fp16 values."""
    codes = lambda *shape: torch.randint(-128, 128, shape, device=DEV, dtype=torch.int8, generator=gen)  # noqa: E731
    x_q, B_q, C_q = codes(b, H, P), codes(b, G, N), codes(b, G, N)
    xs = torch.rand(H, P, device=DEV, generator=gen) * 0.01 + 1e-3
    Bs, Cs = torch.full((G, N), 0.01, device=DEV), torch.full((G, N), 0.01, device=DEV)
    dt = torch.randn(b, H, device=DEV, dtype=torch.float16, generator=gen)[:, :, None].expand(b, H, P)
    A = (-torch.rand(H, device=DEV, generator=gen))[:, None, None].expand(H, P, N)  # a view: one Δ·A per head
    if int8:
        return [x_q, xs, dt, A, B_q, Bs, C_q, Cs]
    return [(x_q * xs).half(), None, dt, A, (B_q * Bs).half(), None, (C_q * Cs).half(), None]


def bytes_moved(b: int, int8: bool, k: int | None, ring_bytes: int) -> int:
    """Bytes a call moves (module docstring); ``ring_bytes``: one ring entry of one slot."""
    sb = 1 if int8 else 2
    io = b * (H * P * (sb + (4 if int8 else 2)) + 2 * G * N * sb + H * 2)  # x, y; B, C; Δ
    state = b * H * P * N * sb
    if k is None:
        return 2 * state + io
    return state + state // k + b * ring_bytes * ((k - 1) / 2 + (k - 1) / k) + io + 2 * b * 4


def micro_row(b: int, int8: bool, k: int, ring_dtype, plain: bool = True) -> dict:
    gen = torch.Generator(device=DEV).manual_seed(b)
    sb = 1 if int8 else 2
    blocks = max(1, math.ceil(SPAN_BYTES / (b * H * P * N * 2)))
    s = blocks * b
    slots = [torch.arange(j * b, (j + 1) * b, device=DEV, dtype=torch.int32) for j in range(blocks)]
    if int8:
        state = torch.randint(-128, 128, (s, H, P, N), device=DEV, dtype=torch.int8, generator=gen)
        table = torch.rand(STATE_GROUPS, N, device=DEV, generator=gen) * 0.01 + 1e-3
        index = torch.randint(0, STATE_GROUPS, (H * P,), device=DEV, generator=gen)
    else:
        state, table, index = torch.randn(s, H, P, N, device=DEV, dtype=torch.float16, generator=gen) * 0.1, None, None
    args = _inputs(b, int8, gen)
    D = torch.randn(H, device=DEV, generator=gen)[:, None].expand(H, P)
    dtb = torch.randn(H, device=DEV, generator=gen)[:, None].expand(H, P)
    common = dict(D=D, dt_bias=dtb, dt_softplus=True)
    ms_plain = math.nan if not plain else graph_ms(
        [lambda sl=sl: quant_state_update(state, table, index, *args, **common, state_batch_indices=sl) for sl in slots])
    ring = StateRing.allocate(s, k, H, P, G, N, per_head_dt=True, device=DEV, dtype=ring_dtype)
    ring.count.copy_(torch.arange(s, device=DEV, dtype=torch.int32) % k)  # staggered fills (docstring)
    ms_replay = graph_ms([lambda sl=sl: replay_state_update(state, table, index, ring, *args, **common,
                                                            state_batch_indices=sl) for sl in slots])
    entry = ring.x[0, 0].nbytes + ring.dt[0, 0].nbytes + ring.B[0, 0].nbytes
    bp, br = bytes_moved(b, int8, None, entry), bytes_moved(b, int8, k, entry)
    del state, ring
    torch.cuda.empty_cache()
    return {"batch": b, "state": "int8" if int8 else "fp16", "K": k, "ring_dtype": str(ring_dtype),
            "plain_ms": ms_plain, "replay_ms": ms_replay, "speedup": ms_plain / ms_replay,
            "plain_bytes": bp, "replay_bytes": int(br), "plain_limit_ms": bp / HBM_BPS * 1e3,
            "replay_limit_ms": br / HBM_BPS * 1e3, "state_bytes_per_value": sb, "slot_blocks": blocks}


# launch settings of the checkpointed step (state_update.CFG["replay"]): rows a program (BP), warps, register cap,
# columns a chunk (BNC) and chunks in flight (fold_stages; BNC 128 = the whole tile in registers, no pipelining),
# entries in flight when a full ring is replayed (ring_stages); the first row is the default
SWEEP = [dict(BP=64, num_warps=4, maxnreg=None, BNC=32, fold_stages=4, ring_stages=1),
         dict(BP=64, num_warps=4, maxnreg=None, BNC=32, fold_stages=4, ring_stages=2),
         dict(BP=64, num_warps=4, maxnreg=None, BNC=32, fold_stages=4, ring_stages=4),
         dict(BP=64, num_warps=4, maxnreg=None, BNC=32, fold_stages=3, ring_stages=1),
         dict(BP=64, num_warps=4, maxnreg=None, BNC=32, fold_stages=2, ring_stages=1),
         dict(BP=64, num_warps=4, maxnreg=72, BNC=32, fold_stages=3, ring_stages=1),
         dict(BP=64, num_warps=8, maxnreg=None, BNC=32, fold_stages=4, ring_stages=1),
         dict(BP=32, num_warps=4, maxnreg=None, BNC=32, fold_stages=4, ring_stages=1),
         dict(BP=32, num_warps=4, maxnreg=None, BNC=64, fold_stages=2, ring_stages=1),
         dict(BP=32, num_warps=4, maxnreg=None, BNC=128, fold_stages=1, ring_stages=1),
         dict(BP=16, num_warps=4, maxnreg=None, BNC=32, fold_stages=4, ring_stages=1)]
# the int8 checkpoint's: unchunked tiles (its chunked rows above ran 2-2.5x slower on the H100); rows a program set
# how far the per-program ring work (B_j . C, the fold's reductions) is amortized; the first row is the default
SWEEP_INT8 = [dict(BP=32, num_warps=4, maxnreg=None, BNC=128, fold_stages=1, ring_stages=1),
              dict(BP=64, num_warps=4, maxnreg=None, BNC=128, fold_stages=1, ring_stages=1),
              dict(BP=64, num_warps=8, maxnreg=None, BNC=128, fold_stages=1, ring_stages=1),
              dict(BP=64, num_warps=4, maxnreg=None, BNC=64, fold_stages=2, ring_stages=1),
              dict(BP=16, num_warps=4, maxnreg=None, BNC=128, fold_stages=1, ring_stages=1)]


def run_sweep(batches, k: int, ring_dtype, out: dict, save, states=("fp16", "int8")) -> None:
    """The checkpointed step's launch settings (``SWEEP``) at the given batches."""
    print(f"{'state':>5} {'batch':>5} {'BP':>3} {'warps':>5} {'maxnreg':>7} {'BNC':>4} {'stages':>6} {'ring':>4} "
          f"{'replay ms':>9} {'limit ms':>9}")
    cfg = state_update.CFG["replay"]
    default, int8_defaults = dict(cfg), state_update.CFG["replay_int8"]
    state_update.CFG["replay_int8"] = {}  # the sweep's settings apply to the int8 state as they are
    try:
        _sweep(batches, k, ring_dtype, out, save, cfg, default, states)
    finally:
        state_update.CFG["replay_int8"] = int8_defaults


def _sweep(batches, k, ring_dtype, out, save, cfg, default, states) -> None:
    for int8 in [s == "int8" for s in states]:
        for b in batches:
            for setting in SWEEP_INT8 if int8 else SWEEP:
                st = {**default, **setting}
                cfg.update(st)
                try:
                    r = micro_row(b, int8, k, ring_dtype, plain=False)
                finally:
                    cfg.update(default)
                out["sweep"].append({**r, **st})
                print(f"{r['state']:>5} {b:>5} {st['BP']:>3} {st['num_warps']:>5} {str(st['maxnreg']):>7} "
                      f"{st['BNC']:>4} {st['fold_stages']:>6} {st['ring_stages']:>4} {r['replay_ms']:>9.4f} "
                      f"{r['replay_limit_ms']:>9.4f}", flush=True)
                save()


def run_micro(batches, k: int, ring_dtype, out: dict, save) -> None:
    print(f"{'state':>5} {'batch':>5} {'plain ms':>9} {'replay ms':>9} {'speedup':>7} {'plain lim':>9} "
          f"{'replay lim':>10}")
    for int8 in (False, True):
        for b in batches:
            r = micro_row(b, int8, k, ring_dtype)
            out["micro"].append(r)
            print(f"{r['state']:>5} {b:>5} {r['plain_ms']:>9.4f} {r['replay_ms']:>9.4f} {r['speedup']:>7.2f} "
                  f"{r['plain_limit_ms']:>9.4f} {r['replay_limit_ms']:>10.4f}", flush=True)
            save()


# ------------------------------------------------------------------------------------------ end to end

def run_e2e(batches, k: int, out: dict, save, states=("fp16", "int8")) -> None:
    model = random_model(PUBLISHED["mamba2-2.7b"], dtype=torch.float16)
    steps = 2 * k
    for state in states:
        if state == "int8":  # an int8 state format with uniform scales: the timing of the format, not its accuracy
            for layer in model.layers:
                layer.mixer.enable_int8_state(1)
                layer.mixer.state_scale.fill_(0.01)
        if state == "int8rows":  # the int8 state with dynamic row scales (recipe cache.state_scales "dynamic")
            for layer in model.layers:
                layer.mixer.enable_int8_state(0, rows=True)
        for label, kk in (("plain", None), (f"checkpoint K={k}", k)):
            key = f"{state} state, {label}"
            out["e2e"][key] = {}
            for b in batches:
                try:
                    out["e2e"][key][f"b{b}"] = tpot(model, b, steps, None if state == "fp16" else torch.int8, kk)
                except Exception as e:  # noqa: BLE001 - report, go on
                    out["e2e"][key][f"b{b}"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                print(key, b, out["e2e"][key][f"b{b}"], flush=True)
                save()


def plot(out: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    ax = axes[0]
    for state, color in (("fp16", "C0"), ("int8", "C1")):
        rows = [r for r in out["micro"] if r["state"] == state]
        if not rows:
            continue
        bs = [r["batch"] for r in rows]
        ax.plot(bs, [r["plain_ms"] * 1e3 for r in rows], "o-", color=color, label=f"{state} state, plain")
        ax.plot(bs, [r["replay_ms"] * 1e3 for r in rows], "s--", color=color, label=f"{state} state, checkpoint")
        ax.plot(bs, [r["replay_limit_ms"] * 1e3 for r in rows], ":", color=color, label=f"{state} checkpoint bytes")
    log_axes(ax, "batch", "µs per layer", f"state update, h {H} p {P} n {N}", legend_size=7)
    ax = axes[1]
    for key, rows in out["e2e"].items():
        pts = [(int(b[1:]), r["tpot_ms"]) for b, r in rows.items() if "tpot_ms" in r]
        if pts:
            ax.plot(*zip(*pts), "o-", label=key)
    log_axes(ax, "batch", "TPOT ms", "Mamba2-2.7B (random weights) decode", ylog=False, legend_size=7)
    fig.suptitle(f"ReplaySSM state checkpointing — {out['device']}, {out['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,32,128,256")
    ap.add_argument("--k", type=int, default=16, help="checkpoint interval K")
    ap.add_argument("--ring-dtype", default="float32", choices=["float32", "float16"])
    ap.add_argument("--no-micro", action="store_true")
    ap.add_argument("--sweep", default="", help="batches (comma list) of a replay launch-setting sweep, e.g. 128,256")
    ap.add_argument("--sweep-states", default="fp16,int8", help="state dtypes of --sweep (comma list)")
    ap.add_argument("--e2e", action="store_true", help="Mamba2-2.7B TPOT, plain vs checkpointed, fp16 / int8 state")
    ap.add_argument("--e2e-batches", default="1,128,256")
    ap.add_argument("--e2e-states", default="fp16,int8",
                    help="state formats of --e2e (comma list: fp16, int8 = a static table, int8rows = row scales)")
    ap.add_argument("--out", default=os.environ.get("OUT", "out/replay"))
    args = ap.parse_args()
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    out = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
           "shape": dict(h=H, p=P, n=N, g=G, state_groups=STATE_GROUPS), "K": args.k, "hbm_Bps": HBM_BPS,
           "cfg": dict(state_update.CFG["replay"]), "micro": [], "sweep": [], "e2e": {}}

    def save():
        (outdir / "replay.json").write_text(json.dumps(out, indent=2))

    if not args.no_micro:
        run_micro([int(b) for b in args.batches.split(",")], args.k, getattr(torch, args.ring_dtype), out, save)
    if args.sweep:
        run_sweep([int(b) for b in args.sweep.split(",")], args.k, getattr(torch, args.ring_dtype), out, save,
                  args.sweep_states.split(","))
    if args.e2e:
        run_e2e([int(b) for b in args.e2e_batches.split(",")], args.k, out, save, args.e2e_states.split(","))
    save()
    plot(out, outdir / "replay.png")
    print(f"wrote {outdir / 'replay.json'}")


if __name__ == "__main__":
    main()
