"""Low-bit decode GEMV for 1-8 rows: ``ops.quant_linear_ref`` where the weight streams from HBM once.

Serves weight-only float x (float16 / bfloat16) with int4 per-group, int8 per-channel / per-tensor and fp8
per-channel / per-tensor codes, and fp8 x (FP8 W8A8) with fp8 codes; symmetric weights (no zero points), codes in
the stored layout of ``ssmq.quant.linear`` (int4: (n, k // 2) uint8, low nibble = even column).

Design: at decode a linear is a few MB of codes, a few microseconds of HBM time, so latency (dependent K steps,
each a round trip to memory), ramp and tail weigh as much as bytes. The grid is sized once per shape to about
WAVES programs per SM (one wave: no program waits for a free SM), each program owns a (BLOCK_N, ITERS x KT) block
of the weight and keeps two (BLOCK_N, KT) tiles in flight (the next tile's codes and scales are requested before
the current one's arithmetic), each thread loading 16 bytes of codes along k at a time. Where it beats
``quant_gemm``'s decode kernels, and where not, is ROUTE_ROWS of configs/qgemv.json. The K split that
fills the grid is summed inside the kernel by the last program of each output tile in a fixed order (the
counters of ``gemm_parts._split_gather``: deterministic, no second kernel, CUDA-graph safe).

Two ways to apply a tile to the rows (``_plan`` picks by rows, CFG's FMA_MAX_ROWS):
  FMA (1-4 rows): codes read as 32-bit words, each code turned into an exact float32 by bit assembly (one LOP3
      and one FADD a code, ``gemm_parts._code_f32``; fp8: the hardware e4m3 conversion), one FFMA a code and row;
      per-group scales multiply each group's sum (BLOCK_N, NG) once per tile.
  DOT (3-8 rows, padded to 16): the tile dequantized in registers to x's dtype ((q * s) in float32, rounded once:
      the reference's weight), one tensor-core product a tile: the cost a code no longer grows with the rows.

Glossary: m rows of x, n out_features, k in_features, g group size; a tile is (BLOCK_N, KT) codes, NG groups of
GW 32-bit words (FMA) or GB bytes (DOT) each; per-channel weights count a whole tile as one group.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ssmq.kernels import configs
from ssmq.kernels._common import cdiv, gdc_enter, int8_to_float, pdl_args, pow2, sm_count
from ssmq.kernels.dispatch import quant_linear_rows, select
from ssmq.kernels.gemm_parts import (_code_f32, _code_halves, _finish_words, _fp8_f32, _rows_tile, _split_gather,
                                     _x_f32, split_buffers)
from ssmq.ops.quant_linear import code_type, weight_format

CFG = configs.load("qgemv")  # launch settings (configs/qgemv.json, keys in docs/kernels.md)
ALL_ROWS = dict(int4=8, int8=8, fp8=8)  # ROUTE_ROWS that sends every call it can serve here (tests, benchmark)


@triton.jit
def _pair_fma(q, xp, mx, ca, cb, PA: tl.constexpr, PB: tl.constexpr, XBF16: tl.constexpr):
    """q + x_a * ca + x_b * cb for one row: x_a, x_b its columns of a code pair, read as one int32 of two 16-bit
    floats at xp (NG, GW), scaled by 2^-PA, 2^-PB (exact: _code_f32's 2^P)."""
    xv = tl.load(xp, mask=mx, other=0)
    xa = _x_f32(xv, False, True, XBF16) * (1.0 / (1 << PA))
    xb = _x_f32(xv, True, True, XBF16) * (1.0 / (1 << PB))
    return q + xa[None, :, :] * ca + xb[None, :, :] * cb


@triton.jit
def _fp8_fma(q, xv, c, J: tl.constexpr):
    return q + _fp8_f32(xv, J)[None, :, :] * c


@triton.jit
def _fma_tile(w, s, x_ptrs, s_xm, mx0, mx1, mx2, mx3, p0, p1, p2, p3,
              A_MODE: tl.constexpr, W4: tl.constexpr, W_FP8: tl.constexpr, WS_MODE: tl.constexpr,
              XBF16: tl.constexpr, BLOCK_M: tl.constexpr, mn):
    """One (BLOCK_N, NG, GW) tile of code words w applied to up to 4 rows: each group's sum (per-group scales:
    times its scales) added into p_r (BLOCK_N, NG).
    Codes outer, rows inner: each converted code meets every row while it is live (rows outer kept a whole tile
    of converted codes in registers, 230 of them at 2 rows)."""
    q0 = tl.zeros(w.shape, dtype=tl.float32)
    q1, q2, q3 = q0, q0, q0
    if A_MODE == 2:  # e4m3 x codes, one int32 word (4 codes) a weight word
        xv0 = tl.load(x_ptrs, mask=mx0, other=0)
        xv1, xv2, xv3 = xv0, xv0, xv0
        if BLOCK_M > 1:
            xv1 = tl.load(x_ptrs + s_xm, mask=mx1, other=0)
        if BLOCK_M > 2:
            xv2 = tl.load(x_ptrs + 2 * s_xm, mask=mx2, other=0)
            xv3 = tl.load(x_ptrs + 3 * s_xm, mask=mx3, other=0)
        for j in tl.static_range(4):
            c = _fp8_f32(w, j)
            q0 = _fp8_fma(q0, xv0, c, j)
            if BLOCK_M > 1:
                q1 = _fp8_fma(q1, xv1, c, j)
            if BLOCK_M > 2:
                q2 = _fp8_fma(q2, xv2, c, j)
                q3 = _fp8_fma(q3, xv3, c, j)
    else:
        BITS: tl.constexpr = 4 if W4 else 8
        H: tl.constexpr = 16 // BITS
        lo, hi = _code_halves(w, W4)  # dead code for fp8 weights
        for i in tl.static_range(4 if W4 else 2):  # code pairs 2i, 2i + 1: one x load (two 16-bit x) a row
            if W_FP8:
                ca = _fp8_f32(w, 2 * i)
                cb = _fp8_f32(w, 2 * i + 1)
            else:
                ca = _code_f32(lo, hi, 2 * i, W4)
                cb = _code_f32(lo, hi, 2 * i + 1, W4)
            # _code_f32's 2^P moved onto x (exact); fp8 codes come unscaled
            PA = 0 if W_FP8 else BITS * ((2 * i) % H)
            PB = 0 if W_FP8 else BITS * ((2 * i + 1) % H)
            q0 = _pair_fma(q0, x_ptrs + i, mx0, ca, cb, PA, PB, XBF16)
            if BLOCK_M > 1:
                q1 = _pair_fma(q1, x_ptrs + s_xm + i, mx1, ca, cb, PA, PB, XBF16)
            if BLOCK_M > 2:
                q2 = _pair_fma(q2, x_ptrs + 2 * s_xm + i, mx2, ca, cb, PA, PB, XBF16)
                q3 = _pair_fma(q3, x_ptrs + 3 * s_xm + i, mx3, ca, cb, PA, PB, XBF16)
    # the tile's products summed over its words at once (per channel too: elementwise sums over the K loop held a
    # tile of float32 a row, 255 registers at 2 rows), per group times the group's scales
    if WS_MODE != 2:
        s = tl.full(p0.shape, 1.0, dtype=tl.float32)
    p0 += tl.sum(q0, axis=2) * s
    if BLOCK_M > 1:
        p1 += tl.sum(q1, axis=2) * s
    if BLOCK_M > 2:
        p2 += tl.sum(q2, axis=2) * s
        p3 += tl.sum(q3, axis=2) * s
    return p0, p1, p2, p3


@triton.jit
def _group_scales(s_ptrs, mn, valid, WS_MODE: tl.constexpr):
    """A tile's (BLOCK_N, NG) per-group scales (WS_MODE 2), else a placeholder (no load)."""
    if WS_MODE == 2:
        s = tl.load(s_ptrs, mask=mn[:, None] & valid, other=0.0)
    else:
        s = tl.zeros(s_ptrs.shape, dtype=tl.float32)
    return s


@triton.jit
def _program_tiles(w_ptr, ws_ptr, M, N, k_tiles, iters, n_groups, s_wn, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, NG: tl.constexpr, GU: tl.constexpr):
    """Program (pid_n, pid_k)'s part of the weight: columns [pid_n * BLOCK_N, +BLOCK_N), tiles [pid_k * iters,
    +iters) of NG groups of GU units (words or bytes) a row. -> pid_n, offs_m, offs_n, their masks mn, mm, rows
    (int64 offs_m), the (NG, GU) units of a tile row, the first tile t0, the tiles n_it, the first tile's pointers
    into the codes (BLOCK_N, NG, GU) and the group scales (BLOCK_N, NG)."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = offs_n.to(tl.int64)
    offs_g = tl.arange(0, NG)
    units = offs_g[:, None] * GU + tl.arange(0, GU)[None, :]
    t0 = pid_k * iters
    w_ptrs = w_ptr + cols[:, None, None] * s_wn + (t0 * NG * GU + units)[None, :, :]
    s_ptrs = ws_ptr + cols[:, None] * n_groups + t0 * NG + offs_g[None, :]
    return (pid_n, offs_m, offs_n, offs_n < N, offs_m < M, offs_m.to(tl.int64), units, t0,
            tl.minimum(iters, k_tiles - t0), w_ptrs, s_ptrs)


@triton.jit
def _program_out(acc, xs_ptr, ws_ptr, b_ptr, out_ptr, part_ptr, cnt_ptr, pid_n, M, N, offs_m, offs_n, mn, mm, rows,
                 s_om, A_MODE: tl.constexpr, XS_ROWS: tl.constexpr, WS_MODE: tl.constexpr, HAS_BIAS: tl.constexpr,
                 SPLIT: tl.constexpr, NSP: tl.constexpr):
    """A program's (BLOCK_M, BLOCK_N) sums out: with a K split stored as partials, the tile's last program adding
    them (``_split_gather``) and alone writing the output; scaled (x's scales for fp8 x), biased and stored."""
    if A_MODE != 0:
        xs = tl.load(xs_ptr + (offs_m if XS_ROWS else offs_m * 0), mask=mm, other=0.0)
    else:
        xs = tl.zeros(offs_m.shape, dtype=tl.float32)
    if SPLIT:
        p_off = rows[:, None] * N + offs_n[None, :]
        mo = mm[:, None] & mn[None, :]
        tl.store(part_ptr + tl.program_id(1) * M * N + p_off, acc, mask=mo)
        acc, last = _split_gather(part_ptr, cnt_ptr, pid_n, tl.num_programs(1), M * N, p_off, mo, offs_m, NSP)
        mm = mm & last
    _finish_words(acc, xs, ws_ptr, ws_ptr, b_ptr, out_ptr, offs_n, mn, rows, mm, s_om, A_MODE, WS_MODE, HAS_BIAS)


@triton.jit
def _qgemv_fma(
    x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, part_ptr, cnt_ptr,
    M, N, k_tiles, iters, n_groups, s_xm, s_wn, s_om,
    A_MODE: tl.constexpr, XS_ROWS: tl.constexpr, W4: tl.constexpr, W_FP8: tl.constexpr, WS_MODE: tl.constexpr,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, NSP: tl.constexpr, XBF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NG: tl.constexpr, GW: tl.constexpr,
    USE_GDC: tl.constexpr = False, EARLY: tl.constexpr = False,
):
    # program (pid_n, pid_k): columns [pid_n * BLOCK_N, +BLOCK_N), tiles [pid_k * iters, +iters) of KW words
    # (w_ptr: the codes as int32 words, s_wn in words; x_ptr: 16-bit x as int32 pairs, fp8 x as int32 words of
    # 4 codes, s_xm in those units); A_MODE 0 float x, 2 fp8 x; WS_MODE 0 per tensor, 1 per channel, 2 per group
    WPW: tl.constexpr = 8 if W4 else 4
    KW: tl.constexpr = NG * GW
    XE: tl.constexpr = 4 if A_MODE != 0 else 2  # x columns a pointer unit
    pid_n, offs_m, offs_n, mn, mm, rows, wk, t0, n_it, w_ptrs, s_ptrs = _program_tiles(
        w_ptr, ws_ptr, M, N, k_tiles, iters, n_groups, s_wn, BLOCK_M, BLOCK_N, NG, GW)
    x_ptrs = x_ptr + (t0 * KW + wk) * (WPW // XE)
    on = wk >= 0
    mx0, mx1, mx2, mx3 = on & (0 < M), on & (1 < M), on & (2 < M), on & (3 < M)
    p0 = tl.zeros((BLOCK_N, NG), dtype=tl.float32)  # per row: sums of each group (per channel: of the tile)
    p1, p2, p3 = p0, p0, p0
    mw = mn[:, None, None]
    # EARLY: the weight is never written by a decode step, so its first tile can be requested before waiting on the
    # kernel before (PDL) and stream during that kernel's tail; x, its scales, counters and partials only after
    if not EARLY:
        gdc_enter(USE_GDC)
    w_next = tl.load(w_ptrs, mask=mw, other=0)
    s_next = _group_scales(s_ptrs, mn, True, WS_MODE)
    if EARLY:
        gdc_enter(USE_GDC)
    for i in range(n_it):
        w = w_next
        s = s_next
        # the next tile's words and scales are requested before this tile's arithmetic: two tiles in flight (a
        # scale load issued after the arithmetic left a round trip to HBM a tile exposed)
        w_next = tl.load(w_ptrs + KW, mask=mw & (i + 1 < n_it), other=0)
        s_next = _group_scales(s_ptrs + NG, mn, i + 1 < n_it, WS_MODE)
        p0, p1, p2, p3 = _fma_tile(w, s, x_ptrs, s_xm, mx0, mx1, mx2, mx3, p0, p1, p2, p3, A_MODE, W4,
                                   W_FP8, WS_MODE, XBF16, BLOCK_M, mn)
        w_ptrs += KW
        x_ptrs += KW * (WPW // XE)
        s_ptrs += NG
    tot = _rows_tile(tl.sum(p0, axis=1), tl.sum(p1, axis=1), tl.sum(p2, axis=1), tl.sum(p3, axis=1), offs_m)
    _program_out(tot, xs_ptr, ws_ptr, b_ptr, out_ptr, part_ptr, cnt_ptr, pid_n, M, N, offs_m, offs_n, mn, mm, rows,
                 s_om, A_MODE, XS_ROWS, WS_MODE, HAS_BIAS, SPLIT, NSP)


@triton.jit
def _qgemv_dot(
    x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, part_ptr, cnt_ptr,
    M, N, k_tiles, iters, n_groups, s_xm, s_wn, s_om,
    A_MODE: tl.constexpr, XS_ROWS: tl.constexpr, W4: tl.constexpr, W_FP8: tl.constexpr, WS_MODE: tl.constexpr,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, NSP: tl.constexpr, PTX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NG: tl.constexpr, GB: tl.constexpr, USE_GDC: tl.constexpr = False,
):
    # as _qgemv_fma, tiles (BLOCK_N, NG, GB) of code bytes (w_ptr: uint8 / int8 rows, s_wn in bytes; x_ptr in
    # elements, fp8 x as int8), dequantized to the operand type and applied by one tl.dot to BLOCK_M (16) rows
    gdc_enter(USE_GDC)
    GK: tl.constexpr = 2 * GB if W4 else GB  # codes of a group
    KT: tl.constexpr = NG * GK
    KB: tl.constexpr = NG * GB  # bytes of a tile row
    if A_MODE == 0:
        OP = x_ptr.dtype.element_ty
    else:
        OP = tl.float16
    pid_n, offs_m, offs_n, mn, mm, rows, _, t0, n_it, w_ptrs, s_ptrs = _program_tiles(
        w_ptr, ws_ptr, M, N, k_tiles, iters, n_groups, s_wn, BLOCK_M, BLOCK_N, NG, GB)
    x_ptrs = x_ptr + rows[:, None] * s_xm + t0 * KT + tl.arange(0, KT)[None, :]
    mw = mn[:, None, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_next = tl.load(w_ptrs, mask=mw, other=0)
    x_next = tl.load(x_ptrs, mask=mm[:, None], other=0)
    s_next = _group_scales(s_ptrs, mn, True, WS_MODE)
    for i in range(n_it):
        w = w_next
        xv = x_next
        s = s_next
        more = i + 1 < n_it
        w_next = tl.load(w_ptrs + KB, mask=mw & more, other=0)
        x_next = tl.load(x_ptrs + KT, mask=mm[:, None] & more, other=0)
        s_next = _group_scales(s_ptrs + NG, mn, more, WS_MODE)
        if A_MODE == 2:
            xv = xv.to(tl.float8e4nv, bitcast=True)
        if W_FP8:
            wf = w.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        elif W4:
            b = w.to(tl.int8, bitcast=True)
            q = tl.reshape(tl.join((b << 4) >> 4, b >> 4), (BLOCK_N, NG, GK))  # low nibble = even column
            wf = int8_to_float(q, PTX)
        else:
            wf = int8_to_float(w.to(tl.int8, bitcast=True), PTX)
        if WS_MODE == 2:  # the reference's weight: (q * s) in float32, rounded once to the operand type
            wf = wf * s[:, :, None]
        wt = tl.reshape(wf.to(OP), (BLOCK_N, KT))
        acc = tl.dot(xv.to(OP), tl.trans(wt), acc)
        w_ptrs += KB
        x_ptrs += KT
        s_ptrs += NG
    _program_out(acc, xs_ptr, ws_ptr, b_ptr, out_ptr, part_ptr, cnt_ptr, pid_n, M, N, offs_m, offs_n, mn, mm, rows,
                 s_om, A_MODE, XS_ROWS, WS_MODE, HAS_BIAS, SPLIT, NSP)


def _plan(M: int, N: int, K: int, f: dict, sms: int, cfg: dict) -> dict | None:
    """Path, tile, ITERS and K split of an (M, N, K) call (pure Python), or None when no tile fits k."""
    dot = M > cfg["FMA_MAX_ROWS"]
    wpw = 8 if f["bits"] == 4 else 4
    g = f["group_size"]
    kt = cfg["KT_DOT" if dot else "KT_FMA"]
    # a tile: whole groups, whole 16-byte vectors a row (4 words), and dividing k (no k mask)
    unit = max(g or 1, 4 * wpw)
    kt = max(unit, kt // unit * unit)
    while kt > unit and K % kt:
        kt //= 2
    if K % kt or kt % unit or (kt & (kt - 1)):
        return None
    BM = 16 if dot else pow2(M)
    BN = min(cfg["BN_DOT" if dot else "BN_FMA"], pow2(N, 16))
    n_tiles, k_tiles = cdiv(N, BN), K // kt
    iters = max(1, min(cfg["MAX_ITERS"], cdiv(n_tiles * k_tiles, cfg["WAVES"] * sms)))
    split = min(cdiv(k_tiles, iters), cfg["MAX_SPLIT_DOT" if dot else "MAX_SPLIT_FMA"])
    iters = cdiv(k_tiles, split)
    split = cdiv(k_tiles, iters)
    gk = g if g is not None else kt  # codes a group (per channel: the tile)
    return dict(DOT=dot, BLOCK_M=BM, BLOCK_N=BN, KT=kt, NG=kt // gk, GK=gk, k_tiles=k_tiles, iters=iters,
                split=split, grid=(n_tiles, split), num_warps=cfg["warps_dot" if dot else "warps_fma"])


def launch(x: torch.Tensor, w_q: torch.Tensor, f: dict, w_zero=None, x_scaled: bool = False, codes=None,
           cfg=None) -> dict:
    """The fields ``dispatch.quant_linear_rows`` selects on for x (..., k) times the weight w_q of format f: code type,
    x's dtype (``codes``: the dtype x is quantized to first, contiguous), rows, group size, zero points, whether x's
    scale is given, and whether the layout fits the kernel (``fits``: k as the weight's, rows of codes and of x
    16-byte aligned, a tile that divides k)."""
    cfg = CFG if cfg is None else cfg
    M, K = math.prod(x.shape[:-1]), f["k"]
    fits = x.shape[-1] == K and 0 < M <= cfg["MAX_ROWS"] and w_q.stride(-1) == 1 and w_q.stride(0) % 16 == 0 \
        and w_q.data_ptr() % 16 == 0 and _plan(M, f["n"], K, f, 132, cfg) is not None
    if codes is None:
        fits = fits and x.data_ptr() % 16 == 0 and x.stride(-1) == 1 and \
            not (M > 1 and x.dim() > 1 and x.reshape(M, K).stride(0) % 8)
    return dict(code=code_type(f), x=str(codes or x.dtype).removeprefix("torch."),
                rows=M, group=f["group_size"], zero=w_zero is not None, x_scaled=x_scaled, fits=fits)


def serves(x: torch.Tensor, w_q, w_scale, w_zero=None, x_scale=None) -> dict | None:
    """``weight_format(w_q, w_scale, w_zero)`` when the selection table (``dispatch.quant_linear_rows`` of CFG) sends
    this call here, else None (quant_gemm's kernels take it, and raise its errors)."""
    f = weight_format(w_q, w_scale, w_zero)
    return f if select(quant_linear_rows(CFG), launch(x, w_q, f, w_zero, x_scale is not None)) == "qgemv" else None


def serves_codes(x: torch.Tensor, w_q, w_scale, act_dtype) -> bool:
    """Whether x (..., k) float, quantized to ``act_dtype`` codes, would be served here (``quant_linear_act``)."""
    launch_ = launch(x, w_q, weight_format(w_q, w_scale), x_scaled=True, codes=act_dtype)
    return select(quant_linear_rows(CFG), launch_) == "qgemv"


def eligible(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, w_zero, f: dict, cfg=None) -> bool:
    """Whether ``quant_gemv`` can serve this call, routed or not (``serves`` with every row count up to MAX_ROWS
    routed, x's scale taken as given)."""
    cfg = CFG if cfg is None else cfg
    table = quant_linear_rows({**cfg, "ROUTE_ROWS": ALL_ROWS})
    return select(table, launch(x, w_q, f, w_zero, True, cfg=cfg)) == "qgemv"


def quant_gemv(x, w_q, w_scale, f: dict, x_scale=None, bias=None, out_dtype=None, cfg=None):
    """``ops.quant_linear_ref(x, w_q, w_scale, None, x_scale, bias, out_dtype)`` for a call ``eligible`` accepts;
    f: ``weight_format(w_q, w_scale)``. Returns (..., n) in out_dtype (default x's dtype, float32 for fp8 x)."""
    cfg = CFG if cfg is None else {**CFG, **cfg}
    K, N = f["k"], f["n"]
    lead = x.shape[:-1]
    M = math.prod(lead)
    x2 = x.reshape(M, K)
    a_mode = 2 if x.dtype == torch.float8_e4m3fn else 0
    out = torch.empty((*lead, N), device=x.device, dtype=out_dtype or (torch.float32 if a_mode else x.dtype))
    c = _plan(M, N, K, f, sm_count(x.device), cfg)
    split = c["split"]
    part, cnt = split_buffers(split, M, N, c["grid"][0], x.device, torch.float32, out)
    xs = x_scale.reshape(-1) if x_scale is not None and x_scale.dim() else x_scale
    common = dict(A_MODE=a_mode, XS_ROWS=xs is not None and xs.dim() == 1, W4=f["bits"] == 4, W_FP8=f["fp8"],
                  WS_MODE=2 if w_scale.dim() == 2 else int(w_scale.dim() == 1), HAS_BIAS=bias is not None,
                  SPLIT=split > 1, NSP=pow2(split), BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"],
                  NG=c["NG"], num_warps=c["num_warps"], **pdl_args(x2))
    n_groups = w_scale.shape[1] if w_scale.dim() == 2 else 1
    dummy = w_scale
    xs_arg = xs if xs is not None else dummy
    b_arg = bias if bias is not None else dummy
    o2 = out.view(M, N)
    if c["DOT"]:
        xd = x2.view(torch.int8) if a_mode else x2
        wd = w_q.view(torch.int8) if f["fp8"] else w_q
        _qgemv_dot[c["grid"]](xd, xs_arg, wd, w_scale, b_arg, o2, part, cnt, M, N, c["k_tiles"], c["iters"],
                              n_groups, xd.stride(0), wd.stride(0), N,
                              GB=c["GK"] // 2 if f["bits"] == 4 else c["GK"], PTX=x.is_cuda, **common)
    else:
        wpw = 8 if f["bits"] == 4 else 4
        xw = (x2.view(torch.int8) if a_mode else x2).view(torch.int32)
        ww = (w_q.view(torch.int8) if f["fp8"] else w_q).view(torch.int32)
        _qgemv_fma[c["grid"]](xw, xs_arg, ww, w_scale, b_arg, o2, part, cnt, M, N, c["k_tiles"], c["iters"],
                              n_groups, xw.stride(0), ww.stride(0), N, XBF16=x.dtype == torch.bfloat16,
                              GW=c["GK"] // wpw, EARLY=cfg["EARLY_TILE"][code_type(f)], **common)
    return out
