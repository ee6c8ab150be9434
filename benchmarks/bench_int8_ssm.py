"""int8 SSM decode benchmark (one GPU): the int8-state selective state update vs our FP16 kernel vs mamba_ssm's,
and (``--e2e``) TPOT of Mamba2-2.7B (random weights) FP16 vs Quamba2 W8A8 with the int8 state cache, on the int8
decode path and on the fake-quant path (the mixers' ``float`` executor, asked for explicitly).

    PYTHONPATH=.:/tmp/peer python benchmarks/bench_int8_ssm.py --out out/int8_ssm [--e2e] [--batches 1,32,128,256]

Micro: Mamba2-2.7B's state update (h 80, p 64, n 128, g 1), one layer per call; the state spans many slot blocks
(>= 256 MB, one block of ``batch`` rows per call, the calls of one CUDA graph walking through them), so each call
reads its rows from DRAM as 64 layers would, not from L2. Inputs as the model feeds them: x, B, C int8 codes with
per-channel / per-state scales, a 16-group (4 x 4 sort-and-cluster) state table, Δ per head, no z (Mamba-2 gates
in the norm). Bytes moved per call: state read + write (1 byte a value int8, 2 fp16) plus x, B, C, Δ, y; its limit
is those bytes at 3.35 TB/s (H100 SXM HBM3). Writes int8_ssm.json and int8_ssm.png to --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_e2e import time_ms  # noqa: E402
from published_configs import PUBLISHED  # noqa: E402
from random_model import random_model  # noqa: E402

from ssmq.kernels import state_update  # noqa: E402
from ssmq.kernels.state_update import quant_state_update, selective_state_update  # noqa: E402
from ssmq.quant import CalibrationData, quantize  # noqa: E402
from ssmq.ops.quant_ssm import RowScales  # noqa: E402
from ssmq.quant.recipe import STATE_SCALES, Cache, get_recipe  # noqa: E402
from ssmq.runtime.cuda_graph import CudaGraphDecoder  # noqa: E402
from peers import mamba_ssm_op  # noqa: E402
from plotting import pyplot  # noqa: E402

DEV = "cuda"
H, P, N, G = 80, 64, 128, 1  # Mamba2-2.7B: 80 heads of 64, d_state 128, one B/C group
STATE_GROUPS = 16  # Quamba2's m x n = 4 x 4 scale groups of x (and of the state)
HBM_BPS = 3.35e12
SPAN_BYTES = 256 << 20  # the states one graph walks through: larger than L2 (50 MB)
# the slot indices' dtype (--index-dtype; the state table's index is int64, as the models'): Triton builds a kernel
# per pointer dtype. The models pass int64; int32 by default, as the README's figures ran. H200, 2026-11-29: the int8
# int64 build 7-8% slower here at batch 32-256, not inside Mamba2-2.7B's decode graph (results/index_dtype_h200/)
INDEX_DTYPE = torch.int32


def peer():
    return mamba_ssm_op("ops.triton.selective_state_update", "selective_state_update")


def graph_ms(calls, reps: int = 10) -> float:
    """Median ms of one call, from replays of a CUDA graph of ``calls`` (a list of closures, run in order)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls[:2]:
            c()  # compile / autotune outside the capture
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
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / len(calls))
    times.sort()
    return times[len(times) // 2]


def micro_row(b: int, pk, only_int8: bool = False) -> dict:
    gen = torch.Generator(device=DEV).manual_seed(b)
    row_fp16 = H * P * N * 2
    blocks = max(1, math.ceil(SPAN_BYTES / (b * row_fp16)))
    s = blocks * b
    slots = [torch.arange(k * b, (k + 1) * b, device=DEV, dtype=INDEX_DTYPE) for k in range(blocks)]
    codes = lambda *shape: torch.randint(-128, 128, shape, device=DEV, dtype=torch.int8, generator=gen)  # noqa: E731
    state16 = torch.randn(s, H, P, N, device=DEV, dtype=torch.float16, generator=gen) * 0.1
    state8 = codes(s, H, P, N)
    if STATE_GROUPS < 0:  # dynamic row scales: one per (slot, channel), rewritten with the codes
        table, index = RowScales(torch.rand(s, H, P, device=DEV, generator=gen) * 0.01 + 1e-3), None
    else:
        groups = STATE_GROUPS or H * P  # 0: per-channel, a (d, n) table read row by row (no index)
        table = torch.rand(groups, N, device=DEV, generator=gen) * 0.01 + 1e-3
        index = torch.randint(0, groups, (H * P,), device=DEV, generator=gen) if STATE_GROUPS > 1 else None
    x_q, B_q, C_q = codes(b, H, P), codes(b, G, N), codes(b, G, N)
    xs = torch.rand(H, P, device=DEV, generator=gen) * 0.01 + 1e-3
    Bs, Cs = torch.full((G, N), 0.01, device=DEV), torch.full((G, N), 0.01, device=DEV)
    x16, B16, C16 = (x_q * xs).half(), (B_q * Bs).half(), (C_q * Cs).half()
    dt = torch.randn(b, H, device=DEV, dtype=torch.float16, generator=gen)[:, :, None].expand(b, H, P)
    A = (-torch.rand(H, device=DEV, generator=gen))[:, None, None].expand(H, P, N)  # a view: the per-head path
    D = torch.randn(H, device=DEV, generator=gen)[:, None].expand(H, P)
    dtb = torch.randn(H, device=DEV, generator=gen)[:, None].expand(H, P)
    common = dict(D=D, dt_bias=dtb, dt_softplus=True)

    ms8 = graph_ms([lambda sl=sl: quant_state_update(state8, table, index, x_q, xs, dt, A, B_q, Bs, C_q, Cs,
                                                     **common, state_batch_indices=sl) for sl in slots])
    if only_int8:
        return {"batch": b, "int8_ms": ms8, "int8_TBps": (b * H * P * N * 2) / (ms8 * 1e-3) / 1e12}
    ms16 = graph_ms([lambda sl=sl: selective_state_update(state16, x16, dt, A, B16, C16, **common,
                                                          state_batch_indices=sl) for sl in slots])
    mspk = math.nan
    if pk is not None:
        try:
            mspk = graph_ms([lambda sl=sl: pk(state16, x16, dt, A, B16, C16, **common, state_batch_indices=sl)
                             for sl in slots])
        except Exception as e:  # noqa: BLE001 - a failing peer must not end the table
            print(f"  mamba_ssm failed: {type(e).__name__}: {str(e)[:200]}")
    io16 = b * (H * P * 2 * 2 + 2 * G * N * 2 + H * 2)  # x, y fp16; B, C fp16; Δ
    io8 = b * (H * P * (1 + 4) + 2 * G * N + H * 2)  # x int8, y float32; B, C int8; Δ
    if STATE_GROUPS < 0:
        io8 += b * H * P * 4 * 2  # the row scales, read and written
    bytes16 = b * H * P * N * 2 * 2 + io16
    bytes8 = b * H * P * N * 1 * 2 + io8
    row = {"batch": b, "fp16_ms": ms16, "int8_ms": ms8, "mamba_ssm_ms": mspk,
           "fp16_bytes": bytes16, "int8_bytes": bytes8,
           "fp16_limit_ms": bytes16 / HBM_BPS * 1e3, "int8_limit_ms": bytes8 / HBM_BPS * 1e3,
           "fp16_TBps": bytes16 / (ms16 * 1e-3) / 1e12, "int8_TBps": bytes8 / (ms8 * 1e-3) / 1e12,
           "int8_speedup_vs_fp16": ms16 / ms8, "slot_blocks": blocks}
    del state16, state8
    torch.cuda.empty_cache()
    return row


# int8 state update launch settings: tile rows BP and warps (values a thread: BP * 128 / (32 * warps), the
# per-program setup amortized over them, against registers), and the codes' arithmetic (ssmq.kernels._common):
# ptx_codes, codes by bit assembly (else I2F in, float rounding out); rcp_table, re-quantized with a table of the
# scales' reciprocals and one saturating conversion a value (else rcp.approx, fast_rcp, and clamps)
SWEEP = [dict(BP=64, num_warps=4, ptx_codes=True, rcp_table=False),
         dict(BP=64, num_warps=4, ptx_codes=False, rcp_table=False),
         dict(BP=64, num_warps=4, ptx_codes=True, rcp_table=True),
         dict(BP=32, num_warps=4, ptx_codes=True, rcp_table=False),
         dict(BP=32, num_warps=4, ptx_codes=True, rcp_table=True),
         dict(BP=64, num_warps=4, ptx_codes=True, rcp_table=False, maxnreg=96),
         # more or fewer bytes in flight a program / an SM: 16 KB tiles on 8 warps, 2 KB on 1-2 warps, a 64-register
         # cap (more programs an SM)
         dict(BP=128, num_warps=8, ptx_codes=True, rcp_table=False),
         dict(BP=32, num_warps=2, ptx_codes=True, rcp_table=False),
         dict(BP=16, num_warps=1, ptx_codes=True, rcp_table=False),
         dict(BP=64, num_warps=4, ptx_codes=True, rcp_table=False, maxnreg=64)]


def run_sweep(batches, out: dict) -> None:
    """int8 state update launch settings (``SWEEP``) at the given batches: state bytes / time."""
    print(f"{'batch':>5} {'BP':>3} {'warps':>5} {'ptx_codes':>9} {'rcp_table':>9} {'maxnreg':>7} {'int8 ms':>9} "
          f"{'state TB/s':>10}")
    default = {k: state_update.CFG[k] for k in (*SWEEP[0], "maxnreg")}
    for b in batches:
        for setting in SWEEP:
            state_update.CFG.update(setting)
            try:
                r = micro_row(b, None, only_int8=True)
            except Exception as e:  # noqa: BLE001 - a failing setting must not end the sweep
                r = {"batch": b, "int8_ms": math.nan, "int8_TBps": math.nan, "error": f"{type(e).__name__}: {e}"[:300]}
            finally:
                state_update.CFG.update(default)
            out["sweep"].append({"maxnreg": None, **r, **setting, "fast_rcp": state_update.CFG["fast_rcp"]})
            print(f"{b:>5} {setting['BP']:>3} {setting['num_warps']:>5} {setting['ptx_codes']!s:>9} "
                  f"{setting['rcp_table']!s:>9} {setting.get('maxnreg')!s:>7} {r['int8_ms']:>9.4f} "
                  f"{r['int8_TBps']:>10.2f}", flush=True)


def run_micro(batches, out: dict) -> None:
    pk = peer()
    print(f"{'batch':>5} {'fp16 ms':>9} {'int8 ms':>9} {'mamba_ssm':>9} {'fp16 lim':>9} {'int8 lim':>9} "
          f"{'fp16 TB/s':>9} {'int8 TB/s':>9} {'fp16/int8':>9}")
    for b in batches:
        r = micro_row(b, pk)
        out["micro"].append(r)
        print(f"{b:>5} {r['fp16_ms']:>9.4f} {r['int8_ms']:>9.4f} {r['mamba_ssm_ms']:>9.4f} {r['fp16_limit_ms']:>9.4f} "
              f"{r['int8_limit_ms']:>9.4f} {r['fp16_TBps']:>9.2f} {r['int8_TBps']:>9.2f} "
              f"{r['int8_speedup_vs_fp16']:>9.2f}", flush=True)


# ------------------------------------------------------------------------------------------ end to end

def tpot(model, b: int, steps: int, ssm_dtype, state_checkpoint: int | None = None,
         executor: str | None = None) -> dict:
    """ms per decode step at batch b from replays of one captured CUDA graph, peak memory, SSM bytes per sequence
    (a ReplaySSM ring included when ``state_checkpoint`` = K, else the state is written every step); ``executor``:
    the mixers' decode executor asked for explicitly (``ssmq.models.layer_plan``), else each layer's plan."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    dec = CudaGraphDecoder(model, max_batch=b, max_seqlen=steps + 64, buckets=(b,), ssm_dtype=ssm_dtype,
                           state_checkpoint=state_checkpoint)
    if executor is not None:
        for layer, st in zip(model.layers, dec.cache.states):
            st.plan = layer.mixer.plan(st, executor)
    tokens = torch.randint(0, 50000, (b,), device=DEV)
    dec(tokens, torch.arange(b, device=DEV))
    graph = dec.graphs[b][0]

    def run():
        for _ in range(steps):
            graph.replay()

    ms = time_ms(run, warmup=1, reps=5) / steps
    r = {"tpot_ms": ms, "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
         "ssm_bytes_per_seq": sum(s.ssm_nbytes() for s in dec.cache.states) // dec.cache.max_batch}
    del dec
    return r


def run_e2e(batches, steps: int, out: dict, save, skip_fake_quant: bool = False,
            state_scales: str = "x_groups") -> None:
    cfg = PUBLISHED["mamba2-2.7b"]
    model = random_model(cfg, dtype=torch.float16)
    weight_bytes = lambda m: sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])  # noqa: E731
    e2e = out["e2e"]
    e2e["fp16"] = {"weight_bytes": weight_bytes(model)}
    for b in batches:
        e2e["fp16"][f"b{b}"] = tpot(model, b, steps, None)
        print("fp16", b, e2e["fp16"][f"b{b}"], flush=True)
        save()  # after every number: a timeout must not lose the ones measured
    recipe = get_recipe("quamba2-w8a8").with_changes(name="quamba2-w8a8-int8state",
                                                     cache=Cache(state_bits=8, state_scales=state_scales))
    e2e["state_scales"] = state_scales
    t0 = time.time()
    quantize(model, recipe, CalibrationData(torch.randint(0, 50000, (4, 256)), source="random tokens", seed=0),
             progress=False)
    e2e["quantize_s"] = round(time.time() - t0, 1)
    print(f"quantized ({recipe.name}) in {e2e['quantize_s']} s", flush=True)
    stray = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type != "cuda"]
    if stray:
        print(f"{len(stray)} tensors off the GPU after quantize, e.g. {stray[:5]}", flush=True)
    save()
    # the fp16-state row isolates the state's share: same weights and linear kernels, only the cache dtype differs
    rows = [("quamba2-w8a8 int8 state, int8 kernels", True, torch.int8),
            ("quamba2-w8a8 fp16 state, int8 kernels", True, None),
            ("quamba2-w8a8 int8 state, fake-quant path", False, torch.int8)]
    for label, new_path, ssm_dtype in rows[:2] if skip_fake_quant else rows:
        e2e[label] = {"weight_bytes": weight_bytes(model)}
        for b in batches:
            try:
                e2e[label][f"b{b}"] = tpot(model, b, steps, ssm_dtype, executor=None if new_path else "float")
            except Exception as e:  # noqa: BLE001 - report, go on
                e2e[label][f"b{b}"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            print(label, b, e2e[label][f"b{b}"], flush=True)
            save()


def plot(out: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    rows = out["micro"]
    bs = [r["batch"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label, style in (("fp16_ms", "ssmq fp16 state", "o-"), ("int8_ms", "ssmq int8 state", "s-"),
                              ("mamba_ssm_ms", "mamba_ssm fp16 state", "^-"),
                              ("fp16_limit_ms", "fp16 bytes @ 3.35 TB/s", "k--"),
                              ("int8_limit_ms", "int8 bytes @ 3.35 TB/s", "k:")):
        ys = [r[key] * 1e3 for r in rows]
        if any(math.isfinite(y) for y in ys):
            ax.plot(bs, ys, style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch")
    ax.set_ylabel("µs per layer")
    ax.set_title(f"selective state update, Mamba2-2.7B layer (h {H}, p {P}, n {N}) — {out['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,32,128,256")
    ap.add_argument("--e2e", action="store_true", help="Mamba2-2.7B TPOT: FP16 vs Quamba2 W8A8 + int8 state")
    ap.add_argument("--skip-fake-quant", action="store_true", help="--e2e without the earlier fake-quant path's row")
    ap.add_argument("--e2e-batches", default="1,32,128")
    ap.add_argument("--steps", type=int, default=16, help="decode steps per TPOT timing")
    ap.add_argument("--no-micro", action="store_true")
    ap.add_argument("--sweep", default="", help="batches (comma list) of an int8 launch-setting sweep, e.g. 128,256")
    ap.add_argument("--state-groups", type=int, default=STATE_GROUPS,
                    help="scale groups of the micro's state table (1: every row reads one table row, which isolates "
                         "the cost of the per-value scale gather; 0: per-channel, a (d, n) table without index; "
                         "-1: dynamic row scales, RowScales (s, h, p))")
    ap.add_argument("--state-scales", choices=STATE_SCALES, default="x_groups",
                    help="--e2e: the int8 state's calibrated scale table (recipe cache.state_scales)")
    ap.add_argument("--index-dtype", default="int32", choices=["int32", "int64"],
                    help="the micro's slot indices (the models pass int64; Triton builds a kernel per pointer dtype)")
    ap.add_argument("--out", default=os.environ.get("OUT", "out/int8_ssm"))
    args = ap.parse_args()
    globals()["STATE_GROUPS"] = args.state_groups
    globals()["INDEX_DTYPE"] = getattr(torch, args.index_dtype)
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    out = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
           "shape": dict(h=H, p=P, n=N, g=G, state_groups=STATE_GROUPS),
           "index_dtype": args.index_dtype, "hbm_Bps": HBM_BPS, "micro": [], "sweep": [], "e2e": {}}

    def save():
        (outdir / "int8_ssm.json").write_text(json.dumps(out, indent=2))

    if not args.no_micro:
        run_micro([int(b) for b in args.batches.split(",")], out)
        save()
        plot(out, outdir / "int8_ssm.png")
    if args.sweep:
        run_sweep([int(b) for b in args.sweep.split(",")], out)
        save()
    if args.e2e:
        run_e2e([int(b) for b in args.e2e_batches.split(",")], args.steps, out, save, args.skip_fake_quant,
                args.state_scales)


if __name__ == "__main__":
    main()
