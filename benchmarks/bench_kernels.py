"""Time each Triton kernel against its ``ssmq.ops`` reference and mamba_ssm's Triton kernel, on one GPU.

Shapes: Mamba2-2.7B (d_model 2560, d_inner 5120, 80 heads of 64, d_state 128, ngroups 1,
chunk 256, conv width 4), decode at batch 1 and 32, prefill of 1024 and 2048 tokens at batch 1;
the Mamba-1 selective scan at Mamba-1 2.8b's d_inner 5120, d_state 16. The decode GEMV
(``gemv`` rows) against ``F.linear`` (cuBLAS) at Mamba2-2.7B's in_proj, out_proj and lm_head, 1 and 8 rows.
The fused Mamba-2 decode step (``fused_decode`` rows: conv + Δ + state update + gate + gated norm in one
kernel; ``+q8`` with the int8 per-token output) against the three kernels it replaces (``unfused_decode``
rows), at the 2.7B and 8B (80 | 128 heads, ngroups 1 | 8) shapes, batch 1, 8, 32, 128.

Each row also gives the fewest bytes the op must move (inputs read once, outputs written once)
over the measured device-to-device copy bandwidth: the time no kernel can beat.

    PYTHONPATH=/path/to/mamba_ssm_src python benchmarks/bench_kernels.py [--json out.json] [--dtype float16] \
        [--only gemv] [--index-dtype int64]

``--index-dtype int64`` times the state update with the models' int64 slot indices (default int32, the build the
kernel tests compile; Triton builds one kernel per pointer dtype). Measured on the H200 (2026-11-29, session 38,
``benchmarks/results/index_dtype_h200/``): the fp16 state update the same either way; the int8 one (``bench_int8_ssm.py
--index-dtype``) 7-8% slower in its int64 build in the micro-benchmark, but not inside the model's decode graph.

mamba_ssm is optional (its rows are blank without it); it is a peer to compare with, never imported by ssmq.
"""

from __future__ import annotations

import argparse
import json
import math
from functools import partial as bind

import torch
import torch.nn.functional as F
import triton.testing as tt

from ssmq import ops
from ssmq.kernels import conv1d, gemv, norm, scan, ssd, state_update
from ssmq.prototype import mamba2_decode
from ssmq.ops.layout import mamba2_in_proj_segments

DEV = "cuda"
# the state update's slot indices: int32 as the kernel tests build it; the models pass int64 (--index-dtype)
INDEX_DTYPE = torch.int32
D_MODEL, D_INNER, H, P, N, G, T, W = 2560, 5120, 80, 64, 128, 1, 256, 4
CONV_DIM = D_INNER + 2 * G * N
VOCAB = 50288  # Mamba2-2.7B's padded vocabulary
# (name, out features, in features) of the decode GEMVs; in_proj makes z, x, B, C and dt
IN_PROJ = mamba2_in_proj_segments(D_INNER, G, N, H)  # [z | x | B | C | dt]
GEMV_SHAPES = (("in_proj", IN_PROJ.total, D_MODEL), ("out_proj", D_MODEL, D_INNER),
               ("lm_head", VOCAB, D_MODEL))


def peer():
    """mamba_ssm's Triton kernels, or None when the package is not on the path."""
    try:
        from mamba_ssm.ops.triton.layer_norm import rms_norm_fn
        from mamba_ssm.ops.triton.layernorm_gated import rmsnorm_fn
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except Exception as e:  # noqa: BLE001 - any import failure just drops the peer column
        print(f"mamba_ssm not available ({type(e).__name__}: {e}); peer column left blank")
        return None
    return dict(ssd=mamba_chunk_scan_combined, ssu=selective_state_update, gated=rmsnorm_fn, rms=rms_norm_fn)


def copy_bandwidth() -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    src = torch.randn(256 * 2**20, device=DEV)  # 1 GiB
    dst = torch.empty_like(src)
    ms = tt.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * src.numel() * 4 / (ms * 1e-3)


def nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def timeit(fn, graph: bool, rep_ms: int = 200):
    """Median ms; decode-size ops replay a CUDA graph so launch overhead does not dominate."""
    try:
        for _ in range(3):  # compile, and let mamba_ssm's autotuner settle, outside the timing
            fn()
        torch.cuda.synchronize()
        if graph:
            return tt.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median")
        return tt.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")
    except Exception as e:  # noqa: BLE001 - a failing peer/ref must not end the table
        print(f"  timing failed: {type(e).__name__}: {e}")
        return math.nan


def ssd_prefill_inputs(r, l: int):
    """Mamba-2 prefill of ``l`` tokens (batch 1): (in_proj output, (x, dt, A, B, C, T), kwargs), x/z/B/C/dt
    being strided views of the in_proj output as in the model."""
    proj = r(1, l, IN_PROJ.total)
    z, xs, Bs, Cs, dt = IN_PROJ.split(proj)
    z, xs = z.unflatten(-1, (H, P)), xs.unflatten(-1, (H, P))
    Bs, Cs = Bs.unflatten(-1, (G, N)), Cs.unflatten(-1, (G, N))
    A = -torch.rand(H, device=DEV) - 0.5
    kw = dict(D=torch.randn(H, device=DEV), z=z, dt_bias=torch.randn(H, device=DEV) - 3, dt_softplus=True,
              return_final_states=True)
    return proj, (xs, dt, A, Bs, Cs, T), kw


def scan_prefill_inputs(r, l: int):
    """Mamba-1 prefill of ``l`` tokens (batch 1, d_inner 5120, d_state 16): ((u, delta, A, B, C), kwargs)."""
    u, delta, z = r(1, D_INNER, l), r(1, D_INNER, l), r(1, D_INNER, l)
    A, B, C = -torch.rand(D_INNER, 16, device=DEV), r(1, 16, l), r(1, 16, l)
    kw = dict(D=torch.randn(D_INNER, device=DEV), z=z, delta_bias=torch.randn(D_INNER, device=DEV) - 3,
              delta_softplus=True, return_last_state=True)
    return (u, delta, A, B, C), kw


def cases(dtype, pk):
    """(name, bytes moved, graph?, ours, reference, peer-or-None) for every benchmarked op.

    Callables are bound with ``bind`` (functools.partial), never closures: a lambda made in
    a loop would see the loop's last tensors when it runs.
    """
    r = lambda *s, dt=dtype: torch.randn(*s, device=DEV, dtype=dt)  # noqa: E731
    out = []
    for b in (1, 32):  # decode
        x, wt, bias = r(b, CONV_DIM), r(CONV_DIM, W), r(CONV_DIM)
        cs = r(b, CONV_DIM, W - 1)
        out.append((f"conv1d_update b={b}", nbytes(x, wt, bias, cs, cs, x), True,
                    bind(conv1d.causal_conv1d_update, x, cs, wt, bias, "silu"),
                    bind(ops.causal_conv1d_update_ref, x, cs, wt, bias, "silu"), None))
        st = r(b, H, P, N)
        xs, zs = r(b, H, P), r(b, H, P)
        dt = r(b, H)[..., None].expand(b, H, P)
        A = (-torch.rand(H, device=DEV))[:, None, None].expand(H, P, N)  # a view: the per-head path
        Bs, Cs = r(b, G, N), r(b, G, N)
        Dv, dtb = torch.randn(H, device=DEV)[:, None].expand(H, P), torch.randn(H, device=DEV)[:, None].expand(H, P)
        idx = torch.arange(b, device=DEV, dtype=INDEX_DTYPE)
        args = (xs, dt, A, Bs, Cs, Dv, zs, dtb, True)
        out.append((f"state_update m2 b={b}", 2 * nbytes(st) + nbytes(xs, zs, xs), True,
                    bind(state_update.selective_state_update, st, *args, state_batch_indices=idx),
                    bind(ops.selective_state_update_ref, st, *args, state_batch_indices=idx),
                    bind(pk["ssu"], st, *args, state_batch_indices=idx) if pk else None))
        st1 = torch.randn(b, D_INNER, 16, device=DEV)
        x1, dt1, z1 = r(b, D_INNER), r(b, D_INNER), r(b, D_INNER)
        A1, B1, C1 = -torch.rand(D_INNER, 16, device=DEV), r(b, 16), r(b, 16)
        a1 = (x1, dt1, A1, B1, C1, torch.randn(D_INNER, device=DEV), z1, torch.randn(D_INNER, device=DEV), True)
        out.append((f"state_update m1 b={b}", 2 * nbytes(st1) + nbytes(A1, x1, dt1, z1, x1), True,
                    bind(state_update.selective_state_update, st1, *a1),
                    bind(ops.selective_state_update_ref, st1, *a1),
                    bind(pk["ssu"], st1, *a1) if pk else None))
        out += norm_cases(r, dtype, b, True, pk)
    out += decode_step_cases(dtype)
    for l in (1024, 2048):  # prefill, batch 1
        x, wt, bias = r(1, l, CONV_DIM).transpose(1, 2), r(CONV_DIM, W), r(CONV_DIM)
        out.append((f"conv1d l={l}", 2 * nbytes(x) + nbytes(x[..., :3]), False,
                    bind(conv1d.causal_conv1d, x, wt, bias, None, True, "silu"),
                    bind(ops.causal_conv1d_ref, x, wt, bias, None, True, "silu"), None))
        proj, a2, kw = ssd_prefill_inputs(r, l)
        out.append((f"ssd_chunk_scan l={l}", nbytes(proj) + nbytes(a2[0]) + 1 * H * P * N * 4, False,
                    bind(ssd.ssd_chunk_scan, *a2, **kw), bind(ops.ssd_chunk_scan_ref, *a2, **kw),
                    bind(pk["ssd"], *a2, **kw) if pk else None))
        a1, kw1 = scan_prefill_inputs(r, l)
        u, delta, _, B1, C1 = a1
        out.append((f"selective_scan m1 l={l}", nbytes(u, delta, kw1["z"], B1, C1, u) + D_INNER * 16 * 4, False,
                    bind(scan.selective_scan, *a1, **kw1),
                    bind(ops.selective_scan_ref, *a1, **kw1) if l == 1024 else None, None))
        out += norm_cases(r, dtype, l, False, pk)
    out += gemv_cases(r, dtype)
    return out


def l2_bytes() -> int:
    props = torch.cuda.get_device_properties(DEV) if torch.cuda.is_available() else None
    return getattr(props, "L2_cache_size", 0) or 50 * 2**20


def each_weight(fn, x, ws):
    """fn(x, w) for each copy of a weight, in turn."""
    for w in ws:
        fn(x, w)


def gemv_cases(r, dtype, shapes=GEMV_SHAPES, rows=(1, 8)):
    """Decode GEMV rows: ours (``gemv.linear_decode``) and cuBLAS (``F.linear``) on the same inputs.

    In decode every layer's weight comes from HBM; a replay of one weight would find it in L2
    (50 MB on an H100: out_proj's 26 MB fits). So each row runs over enough copies of the weight
    to pass 4x the L2 size, named 'xC' in the row, its bytes and times summed over the C copies.
    """
    out = []
    esize = torch.empty((), dtype=dtype).element_size()
    for name, n, k in shapes:
        copies = max(1, math.ceil(4 * l2_bytes() / (n * k * esize)))
        ws = [r(n, k) * k ** -0.5 for _ in range(copies)]
        for b in rows:
            x = r(b, k)
            nb = copies * (nbytes(ws[0], x) + b * n * esize)
            out.append((f"gemv {name} b={b} x{copies}", nb, True, bind(each_weight, gemv.linear_decode, x, ws),
                        bind(each_weight, F.linear, x, ws), None))
    return out


# (tag, heads, ngroups) of the fused decode rows: Mamba2-2.7B and Mamba2-8B (headdim 64, d_state 128)
DECODE_MODELS = (("2.7b", 80, 1), ("8b", 128, 8))


def _with_knobs(knobs: dict, fn):
    """fn() with module constants of the fused decode kernel set to other values (captured into the graph)."""
    old = {k: getattr(mamba2_decode, k) for k in knobs}
    for k, v in knobs.items():
        setattr(mamba2_decode, k, v)
    try:
        return fn()
    finally:
        for k, v in old.items():
            setattr(mamba2_decode, k, v)


def decode_step_cases(dtype):
    """Rows of one Mamba-2 layer's decode step between in_proj and out_proj: fused vs the unfused kernels."""
    from ssmq.ops.mamba2_decode import compose

    rows = []
    unfused = bind(compose, conv1d.causal_conv1d_update, state_update.selective_state_update, norm.rmsnorm_gated)
    for tag, h, g in DECODE_MODELS:
        d, cdim = h * P, h * P + 2 * g * N
        for b in (1, 8, 32, 128):
            kw = dict(xbc=torch.randn(b, cdim, device=DEV, dtype=dtype), z=torch.randn(b, d, device=DEV, dtype=dtype),
                      dt=torch.randn(b, h, device=DEV, dtype=dtype),
                      conv_state=torch.randn(b, cdim, W - 1, device=DEV, dtype=dtype),
                      conv_weight=torch.randn(cdim, W, device=DEV, dtype=dtype) * 0.3,
                      conv_bias=torch.randn(cdim, device=DEV, dtype=dtype),
                      ssm_state=torch.randn(b, h, P, N, device=DEV, dtype=dtype),
                      A=-torch.rand(h, device=DEV), D=torch.randn(h, device=DEV), dt_bias=torch.randn(h, device=DEV) - 3,
                      norm_weight=torch.ones(d, device=DEV, dtype=dtype), ngroups=g, norm_group_size=d // g, eps=1e-5,
                      dt_limit=(0.0, math.inf), slots=torch.arange(b, device=DEV))
            nb = 2 * nbytes(kw["ssm_state"], kw["conv_state"]) + nbytes(kw["xbc"], kw["z"], kw["dt"], kw["z"])
            pos = [kw[k] for k in ("xbc", "z", "dt", "conv_state", "conv_weight", "conv_bias", "ssm_state", "A", "D",
                                   "dt_bias", "norm_weight", "ngroups", "norm_group_size", "eps", "dt_limit", "slots")]
            fused = bind(_with_knobs, {"FUSED_MAX_BATCH": 1 << 30}, bind(mamba2_decode.mamba2_decode_step, **kw))
            rows.append((f"fused_decode {tag} b={b}", nb, True, fused, bind(ops.mamba2_decode_step_ref, **kw), None))
            rows.append((f"unfused_decode {tag} b={b}", nb, True, bind(unfused, *pos, False, None), None, None))
            if b in (1, 32):
                rows.append((f"fused_decode+q8 {tag} b={b}", nb + b * d, True,
                             bind(_with_knobs, {"FUSED_MAX_BATCH": 1 << 30},
                                  bind(mamba2_decode.mamba2_decode_step, **kw, quantize=True)), None, None))
            if b == 128:  # up to 16 tiles a program (the B/C convolution shared by them; off by default)
                rows.append((f"fused_decode {tag} b={b} max_tiles=16", nb, True,
                             bind(_with_knobs, {"FUSED_MAX_BATCH": 1 << 30, "MAX_TILES": 16},
                                  bind(mamba2_decode.mamba2_decode_step, **kw)), None, None))
    return rows


def norm_cases(r, dtype, rows, graph, pk):
    x, res, w = r(rows, D_MODEL), torch.randn(rows, D_MODEL, device=DEV), r(D_MODEL)
    y, zg, wg = r(rows, D_INNER), r(rows, D_INNER), r(D_INNER)
    tag = f"b={rows}" if graph else f"l={rows}"
    return [
        (f"rms_norm+res {tag}", nbytes(x, res, x, res), graph,
         lambda: norm.rms_norm(x, w, 1e-5, res, True), lambda: ops.rms_norm_ref(x, w, 1e-5, res, True),
         (lambda: pk["rms"](x, w, None, residual=res, prenorm=True, residual_in_fp32=True, eps=1e-5)) if pk else None),
        (f"rmsnorm_gated {tag}", nbytes(y, zg, y), graph,
         lambda: norm.rmsnorm_gated(y, wg, zg, 1e-5, D_INNER // G, False),
         lambda: ops.rmsnorm_gated_ref(y, wg, zg, 1e-5, D_INNER // G, False),
         (lambda: pk["gated"](y, wg, None, zg, 1e-5, D_INNER // G, False)) if pk else None),
    ]


def _load_file_module(path, name):
    """A kernel module kept outside the package (e.g. an earlier version, for before/after timings)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def sweep(dtype, pk, old_dir=None, quick=False):
    """Time ssd_chunk_scan and selective_scan over their launch configurations (ssd.CFG, scan.CFG),
    and the earlier versions in ``old_dir`` (ssd_orig.py, scan_orig.py) when given. Returns rows."""
    import copy
    import os

    rows = []
    old_ssd = old_scan = None
    if old_dir:
        old_ssd = _load_file_module(os.path.join(old_dir, "ssd_orig.py"), "ssd_orig")
        old_scan = _load_file_module(os.path.join(old_dir, "scan_orig.py"), "scan_orig")
    base_ssd, base_scan = copy.deepcopy(ssd.CFG), copy.deepcopy(scan.CFG)
    ssd_variants = [("default", {})]
    for BM, BK, w, s in [(64, 64, 4, 1), (64, 32, 4, 2), (64, 64, 8, 2), (64, 32, 8, 2), (64, 64, 8, 3), (128, 64, 8, 2),
                         (128, 32, 8, 2), (64, 32, 4, 3)]:
        ssd_variants.append((f"scan BM{BM} BK{BK} w{w} s{s}", {"scan": dict(BM=BM, BK=BK, num_warps=w, num_stages=s)}))
    for BP, BN, BK, w, s in [(32, 64, 64, 4, 2), (64, 128, 64, 8, 3), (32, 128, 64, 4, 2), (64, 64, 64, 4, 3),
                             (64, 64, 32, 4, 2)]:
        ssd_variants.append((f"fused BP{BP} BN{BN} BK{BK} w{w} s{s}",
                             {"fused": dict(BP=BP, BN=BN, BK=BK, num_warps=w, num_stages=s)}))
    ssd_variants.append(("split states", {"STATES": "split"}))
    scan_variants = [(f"BD{bd} w{w} segs{s}", dict(base_scan, BD=bd, num_warps=w, SEGS=s))
                     for bd, w, s in [(16, 1, 24), (16, 1, 0), (16, 1, 12), (16, 1, 48), (8, 1, 16), (8, 1, 32),
                                      (32, 2, 24)]]
    if quick:
        ssd_variants = ssd_variants[:1]
        scan_variants = scan_variants[:1] if quick == "final" else scan_variants
    r = lambda *s: torch.randn(*s, device=DEV, dtype=dtype)  # noqa: E731
    for l in (1024, 2048):
        _, args, kw = ssd_prefill_inputs(r, l)
        ref = ssd.ssd_chunk_scan(*args, **kw)
        if pk:
            rows.append(dict(op=f"ssd l={l}", variant="mamba_ssm", us=timeit(bind(pk["ssd"], *args, **kw), True) * 1e3))
        if old_ssd:
            rows.append(dict(op=f"ssd l={l}", variant="old", us=timeit(bind(old_ssd.ssd_chunk_scan, *args, **kw), True) * 1e3))
        for name, upd in ssd_variants:
            ssd.CFG.clear()
            ssd.CFG.update(copy.deepcopy(base_ssd))
            ssd.CFG.update(upd)
            try:
                out = ssd.ssd_chunk_scan(*args, **kw)
                err = max(((o.float() - q.float()).norm() / q.float().norm()).item() for o, q in zip(out, ref))
                t = timeit(bind(ssd.ssd_chunk_scan, *args, **kw), True) * 1e3
            except Exception as e:  # noqa: BLE001 - a config that fails to compile just drops out
                print(f"  {name}: {type(e).__name__}: {e}")
                err, t = math.nan, math.nan
            rows.append(dict(op=f"ssd l={l}", variant=name, us=t, err_vs_default=err))
            print(f"  ssd l={l} {name:34s} {t:8.1f} us  err {err:.2g}", flush=True)
        ssd.CFG.clear()
        ssd.CFG.update(base_ssd)

        a1, kw1 = scan_prefill_inputs(r, l)
        if old_scan:
            rows.append(dict(op=f"selective_scan l={l}", variant="old",
                             us=timeit(bind(old_scan.selective_scan, *a1, **kw1), True) * 1e3))
        for name, cfg in scan_variants:
            scan.CFG.clear()
            scan.CFG.update(cfg)
            try:
                t = timeit(bind(scan.selective_scan, *a1, **kw1), True) * 1e3
            except Exception as e:  # noqa: BLE001
                print(f"  scan {name}: {type(e).__name__}: {e}")
                t = math.nan
            rows.append(dict(op=f"selective_scan l={l}", variant=name, us=t))
            print(f"  selective_scan l={l} {name:20s} {t:8.1f} us", flush=True)
        scan.CFG.clear()
        scan.CFG.update(base_scan)
    print("sweep summary (us):")
    for row in rows:
        print(f"  {row['op']:22s} {row['variant']:34s} {row['us']:9.1f}")
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    ap.add_argument("--json", default=None)
    ap.add_argument("--sweep", action="store_true", help="time ssd/selective_scan launch configurations instead")
    ap.add_argument("--quick", default=None, choices=["scan", "final"],
                    help="--sweep with the ssd default only; 'final': the scan default only too")
    ap.add_argument("--old", default=None, help="folder with ssd_orig.py / scan_orig.py to time as 'old' in --sweep")
    ap.add_argument("--only", default="", help="time only the rows whose name contains this (e.g. gemv)")
    ap.add_argument("--index-dtype", default="int32", choices=["int32", "int64"],
                    help="the state update's slot indices (the models pass int64; Triton builds a kernel per dtype)")
    args = ap.parse_args()
    global INDEX_DTYPE
    INDEX_DTYPE = getattr(torch, args.index_dtype)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    if args.sweep:
        rows = sweep(dtype, peer(), args.old, args.quick)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(device=torch.cuda.get_device_name(), dtype=args.dtype, rows=rows), f, indent=1)
        return
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}  copy bandwidth {bw / 1e12:.2f} TB/s  dtype {args.dtype}")
    rows = []
    for name, nb, graph, ours, ref, pe in (c for c in cases(dtype, peer()) if args.only in c[0]):
        # ours and the peer always as CUDA-graph replays: the host launches of a few-kernel op can
        # otherwise outlast the GPU work and be timed instead of it; the references (long Python loops) plainly
        t_ours = timeit(ours, True)
        t_ref = timeit(ref, graph) if ref is not None else math.nan
        t_peer = timeit(pe, True) if pe is not None else math.nan
        floor = nb / bw * 1e3
        rows.append(dict(op=name, ours_ms=t_ours, ref_ms=t_ref, mamba_ssm_ms=t_peer, bytes=nb, floor_ms=floor,
                         ours_of_floor=t_ours / floor, graph=graph))
        print(f"  {name:26s} ours {t_ours * 1e3:9.1f} us", flush=True)
    hdr = (f"{'op':26s} {'ours us':>9s} {'ref us':>10s} {'mamba_ssm':>10s} {'vs peer':>8s} {'vs ref':>7s} {'MB':>8s} "
           f"{'floor us':>9s} {'x floor':>8s}")
    print(hdr)
    for r in rows:
        vs = r["mamba_ssm_ms"] / r["ours_ms"]
        print(f"{r['op']:26s} {r['ours_ms'] * 1e3:9.1f} {r['ref_ms'] * 1e3:10.1f} {r['mamba_ssm_ms'] * 1e3:10.1f} "
              f"{vs:8.2f} {r['ref_ms'] / r['ours_ms']:7.2f} {r['bytes'] / 1e6:8.2f} {r['floor_ms'] * 1e3:9.1f} "
              f"{r['ours_of_floor']:8.2f}")
    print("(ours and mamba_ssm: CUDA-graph replays; ref: graph for decode rows only; 'vs peer' / 'vs ref' > 1 means "
          "ours is faster; 'x floor' = ours / bytes-bound; gemv rows: ref is F.linear, times summed over the xC "
          "weight copies)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), copy_bw=bw, dtype=args.dtype, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
