"""Decode GEMV (1-8 rows) on codes repacked for it: ``ops.quant_linear.words_linear_ref`` on the GPU.

Serves float16 / bfloat16 x times symmetric int4 (per group of a multiple of 128, per channel, per tensor) and int8
(per group of a multiple of 64, per channel, per tensor) weights in ``ops.quant_linear.pack_words``' layout: a copy
of the stored codes made once when a model's decode is set up (``QuantLinear.bind_decode``), the checkpoint as is.

Why the layout: a thread loads 16 bytes of codes (4 words, one ``LDG.128``) and each slot j of those words holds 4
consecutive codes of the row, so their x is one 8-byte load (the stored layout interleaves even and odd columns
within a byte: 32 four-byte x loads a thread and tile, the cost that held the plain-layout GEMVs to a third of HBM
speed). A code becomes an exact float32 by masking its slot under the exponent of 2^23 (the word's two halves get
the exponent once, one LOP3 each) and one FFMA (scale by 2^-P, remove the offset; no I2F); one FFMA a code and row;
per-group scales multiply a block's 16-word sums once (one FFMA a word and row).

Grid: (row blocks, column tiles, K split); the row blocks of a column tile are neighbours in launch order, so 5-8
rows read each weight tile from HBM once and from L2 after. The K split fills about WAVES programs an SM; each
program owns ``iters`` tiles of (BLOCK_N, NB blocks) and keeps the next tile's codes and scales in flight while it
computes one. Under PDL the first tile's codes and scales are requested before waiting on the previous kernel (the
weight is never written by a decode step), so the weight stream starts during the previous kernel's tail. The
split's partial sums are added in the kernel by the last program of each output tile (counters of
``gemm_parts._split_gather``, fixed order) or, with SPLIT_IN_KERNEL off, by ``gemv._sum_splits`` after it.

Launch settings: configs/packed_gemv.json (``CFG``), with the measurements behind them in its ``why``.
Glossary: m rows of x, n out_features, k in_features, WPW codes a word, CB codes a block (16 words), NB blocks a
tile row, GB blocks a scale group.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ssmq.kernels import configs
from ssmq.kernels._common import cdiv, pdl_args, pow2, sm_count
from ssmq.kernels.gemv import _sum_splits
from ssmq.kernels.gemm_parts import _finish_words, _rows_tile, _split_gather, split_buffers
from ssmq.ops.quant_linear import BLOCK_WORDS, pack_words, weight_codes, weight_format

CFG = configs.load("packed_gemv")  # launch settings (configs/packed_gemv.json)


@triton.jit
def _slot_f32(lo, hi, J: tl.constexpr, BITS: tl.constexpr):
    """Slot J of each word (lo, hi: its halves under the exponent of 2^23) as its exact float32 code q: the slot
    masked with the exponent (one LOP3) reads 2^23 + (q + 2^(BITS-1)) 2^P (P: the slot's bit offset in its half);
    one FFMA scales it by 2^-P and removes 2^(23-P) + 2^(BITS-1), exactly (every step is a power-of-two scaling or
    an exact difference of integers below 2^24)."""
    H: tl.constexpr = 16 // BITS  # slots a half word
    P: tl.constexpr = BITS * (J % H)
    MASK: tl.constexpr = 0x7F800000 | (((1 << BITS) - 1) << P)
    OFF: tl.constexpr = (1 << (23 - P)) + (1 << (BITS - 1))
    if J >= H:
        src = hi
    else:
        src = lo
    return (src & MASK).to(tl.float32, bitcast=True) * (1.0 / (1 << P)) - OFF


@triton.jit
def _x_slot(x_ptrs, mx, J: tl.constexpr):
    """A row's x for slot J of a tile's words ((1, NB, 16) float32)."""
    return tl.load(x_ptrs + J * 16, mask=mx, other=0.0).to(tl.float32)


@triton.jit
def _tile_rows(w, s, x_ptrs, s_xm, mx0, mx1, mx2, mx3, a0, a1, a2, a3,
               BITS: tl.constexpr, WS_MODE: tl.constexpr, BLOCK_M: tl.constexpr):
    """One (BLOCK_N, NB, 16) tile of words applied to up to 4 rows (x_ptrs: row 0's x of slot 0, (1, NB, 16)): each
    row's products added elementwise into a_r (BLOCK_N, NB, 16), or per group each block's sum times its scale s
    into a_r (BLOCK_N, NB). Slots outer, rows inner: a converted code meets every row while it is live."""
    WPW: tl.constexpr = 32 // BITS
    lo = (w & 0xFFFF) | 0x4B000000
    hi = ((w >> 16) & 0xFFFF) | 0x4B000000
    if WS_MODE == 2:
        q0 = tl.zeros(w.shape, dtype=tl.float32)
        q1, q2, q3 = q0, q0, q0
    else:
        q0, q1, q2, q3 = a0, a1, a2, a3
    for j in tl.static_range(WPW):
        c = _slot_f32(lo, hi, j, BITS)
        q0 += _x_slot(x_ptrs, mx0, j) * c
        if BLOCK_M > 1:
            q1 += _x_slot(x_ptrs + s_xm, mx1, j) * c
        if BLOCK_M > 2:
            q2 += _x_slot(x_ptrs + 2 * s_xm, mx2, j) * c
            q3 += _x_slot(x_ptrs + 3 * s_xm, mx3, j) * c
    if WS_MODE == 2:  # a block's sums (across the threads of its words) times its scales, into a_r (BLOCK_N, NB)
        a0 += tl.sum(q0, axis=2) * s
        if BLOCK_M > 1:
            a1 += tl.sum(q1, axis=2) * s
        if BLOCK_M > 2:
            a2 += tl.sum(q2, axis=2) * s
            a3 += tl.sum(q3, axis=2) * s
    else:
        a0, a1, a2, a3 = q0, q1, q2, q3
    return a0, a1, a2, a3


@triton.jit
def _block_scales(ws_ptr, cols, n_groups, blk, mn, valid, GB: tl.constexpr, WS_MODE: tl.constexpr):
    """The (BLOCK_N, NB) scales of the blocks blk (NB,) of rows cols (WS_MODE 2: per group of GB blocks), else a
    placeholder. (Loaded in the words' (BLOCK_N, NB, 16) shape, they came in a layout of their own and every tile's
    products went through shared memory to meet them: eight barriers a tile.)"""
    if WS_MODE == 2:
        s = tl.load(ws_ptr + cols[:, None] * n_groups + (blk // GB)[None, :], mask=mn[:, None] & valid, other=0.0)
    else:
        s = tl.zeros((cols.shape[0], blk.shape[0]), dtype=tl.float32)
    return s


@triton.jit
def _packed_gemv(
    x_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, part_ptr, cnt_ptr,
    M, N, k_tiles, iters, n_groups, s_xm, s_wn, s_om,
    BITS: tl.constexpr, WS_MODE: tl.constexpr, GB: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
    SPLIT_IN: tl.constexpr, NSP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NB: tl.constexpr,
    USE_GDC: tl.constexpr = False,
):
    # program (pid_m, pid_n, pid_k): rows [pid_m * BLOCK_M, +BLOCK_M), columns [pid_n * BLOCK_N, +BLOCK_N), tiles
    # [pid_k * iters, +iters) of NB blocks. w_ptr: int32 words (s_wn words a row); x_ptr: 16-bit x (s_xm a row).
    # WS_MODE 0 per tensor, 1 per channel, 2 per group. SPLIT: partials to part_ptr[pid_k] (split, M, N),
    # summed here (SPLIT_IN) or by _sum_splits (the per-channel scale applied to each partial then).
    WPW: tl.constexpr = 32 // BITS
    CB: tl.constexpr = 16 * WPW  # codes a block
    KW: tl.constexpr = NB * 16  # words a tile row
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mn = offs_n < N
    cols = offs_n.to(tl.int64)
    offs_b = tl.arange(0, NB)
    offs_w = tl.arange(0, 16)
    t0 = pid_k * iters
    n_it = tl.minimum(iters, k_tiles - t0)
    w_ptrs = w_ptr + cols[:, None, None] * s_wn + (t0 * KW + offs_b[:, None] * 16 + offs_w[None, :])[None, :, :]
    mw = mn[:, None, None]
    blk = t0 * NB + offs_b
    # the weight is never written by a decode step: its first tile is requested before waiting on the kernel before
    w_next = tl.load(w_ptrs, mask=mw, other=0)
    s_next = _block_scales(ws_ptr, cols, n_groups, blk, mn, True, GB, WS_MODE)
    if USE_GDC:  # PDL: x (and the counters, partials, output) only after the previous kernel's writes
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs_ml = tl.arange(0, BLOCK_M)
    offs_m = pid_m * BLOCK_M + offs_ml
    mm = offs_m < M
    rows = offs_m.to(tl.int64)
    r0 = pid_m * BLOCK_M
    # x as a (1, NB, 16) tile: the words' layout with one column, broadcast over the columns in registers (a (NB, 16)
    # tile expanded into it went through shared memory each slot; a (BLOCK_N, NB, 16) one converted every copy)
    x_ptrs = x_ptr + r0.to(tl.int64) * s_xm + t0 * NB * CB + offs_b[None, :, None] * CB + offs_w[None, None, :]
    on = offs_w[None, None, :] >= 0
    mx0, mx1, mx2, mx3 = on & (r0 < M), on & (r0 + 1 < M), on & (r0 + 2 < M), on & (r0 + 3 < M)
    if WS_MODE == 2:  # per row: sums of each block (per group), else of each word (reduced once at the end)
        a0 = tl.zeros((BLOCK_N, NB), dtype=tl.float32)
    else:
        a0 = tl.zeros((BLOCK_N, NB, 16), dtype=tl.float32)
    a1, a2, a3 = a0, a0, a0
    for i in range(n_it):
        w = w_next
        s = s_next
        more = i + 1 < n_it
        w_next = tl.load(w_ptrs + KW, mask=mw & more, other=0)
        s_next = _block_scales(ws_ptr, cols, n_groups, blk + NB, mn, more, GB, WS_MODE)
        a0, a1, a2, a3 = _tile_rows(w, s, x_ptrs, s_xm, mx0, mx1, mx2, mx3, a0, a1, a2, a3, BITS, WS_MODE, BLOCK_M)
        w_ptrs += KW
        x_ptrs += NB * CB
        blk += NB
    if WS_MODE != 2:
        a0, a1, a2, a3 = tl.sum(a0, axis=2), tl.sum(a1, axis=2), tl.sum(a2, axis=2), tl.sum(a3, axis=2)
    tot = _rows_tile(tl.sum(a0, axis=1), tl.sum(a1, axis=1), tl.sum(a2, axis=1), tl.sum(a3, axis=1), offs_ml)
    if SPLIT:
        p_off = rows[:, None] * N + offs_n[None, :]
        mo = mm[:, None] & mn[None, :]
        if SPLIT_IN:
            tl.store(part_ptr + pid_k * M * N + p_off, tot, mask=mo)
            tot, last = _split_gather(part_ptr, cnt_ptr, pid_n * tl.num_programs(0) + pid_m, tl.num_programs(2),
                                      M * N, p_off, mo, offs_ml, NSP)
            mm = mm & last
        else:  # _sum_splits adds the partials and the bias: each partial scaled here
            if WS_MODE == 1:
                tot = tot * tl.load(ws_ptr + offs_n, mask=mn, other=0.0)[None, :]
            elif WS_MODE == 0:
                tot = tot * tl.load(ws_ptr + offs_n * 0)[None, :]
            tl.store(part_ptr + pid_k * M * N + p_off, tot, mask=mo)
            mm = mm & (offs_ml < 0)  # only _sum_splits writes the output
    _finish_words(tot, tl.zeros((BLOCK_M,), dtype=tl.float32), ws_ptr, ws_ptr, b_ptr, out_ptr, offs_n, mn, rows, mm,
                  s_om, 0, WS_MODE, HAS_BIAS)


def block_codes(bits: int) -> int:
    """Codes of one ``pack_words`` block (16 words)."""
    return BLOCK_WORDS * 32 // bits


def _plan(M: int, N: int, K: int, bits: int, group: int | None, sms: int, cfg: dict) -> dict | None:
    """Rows a program, tile, iters and K split of an (M, N, K) call (pure Python), or None when the layout does not fit
    (k or the group not whole blocks)."""
    cb = block_codes(bits)
    if K % cb or (group is not None and group % cb) or M < 1:
        return None
    blocks = K // cb
    nb = cfg["NB"]
    while blocks % nb:
        nb //= 2
    BM = min(pow2(M), cfg["ROWS_PROGRAM"])
    # the same tile at every row count: a thread's x (one load and conversion a slot and word) serves its BN / 32
    # columns (BN shrinking with the rows left 1 column a thread at 4 rows: as many x conversions as FFMAs)
    BN = min(max(16, cfg["TILE_WORDS"] // (nb * BLOCK_WORDS)), pow2(N, 16))
    m_blocks, n_tiles, k_tiles = cdiv(M, BM), cdiv(N, BN), blocks // nb
    iters = max(1, min(cfg["MAX_ITERS"], cdiv(m_blocks * n_tiles * k_tiles, cfg["WAVES"] * sms)))
    split = min(cdiv(k_tiles, iters), cfg["MAX_SPLIT"])
    iters = cdiv(k_tiles, split)
    split = cdiv(k_tiles, iters)
    return dict(BLOCK_M=BM, BLOCK_N=BN, NB=nb, GB=(group // cb) if group else 1, k_tiles=k_tiles, iters=iters,
                split=split, grid=(m_blocks, n_tiles, split), num_warps=cfg["warps"])


def packs(w_q: torch.Tensor, w_scale: torch.Tensor, w_zero=None) -> bool:
    """Whether ``pack`` makes words for this stored weight: symmetric int4 / int8 codes whose k and group are whole
    blocks (fp8 codes and zero points stay on the stored layout's kernels)."""
    f = weight_format(w_q, w_scale, w_zero)
    return (w_zero is None and not f["fp8"] and _plan(1, f["n"], f["k"], f["bits"], f["group_size"], 132, CFG)
            is not None)


def pack(w_q: torch.Tensor) -> torch.Tensor:
    """The stored codes (int4 (n, k // 2) uint8 or int8 (n, k)) in ``pack_words``' layout, on their device."""
    return pack_words(weight_codes(w_q), 4 if w_q.dtype == torch.uint8 else 8).contiguous()


def launch(x: torch.Tensor, words: torch.Tensor, w_scale: torch.Tensor, bits: int, cfg=None) -> dict:
    """The fields ``dispatch.PACKED_LINEAR`` selects on: code type, x's dtype, rows, and whether the call fits
    (x (..., k) with k the words', its rows 16-byte aligned)."""
    cfg = CFG if cfg is None else cfg
    M, K = math.prod(x.shape[:-1]), words.shape[1] * 32 // bits
    fits = x.shape[-1] == K and 0 < M <= cfg["MAX_ROWS"] and x.stride(-1) == 1 and x.data_ptr() % 16 == 0 and \
        not (M > 1 and x.reshape(M, K).stride(0) % 8)
    return dict(code=f"int{bits}", x=str(x.dtype).removeprefix("torch."), rows=M, fits=fits)


def packed_gemv(x, words, w_scale, bits: int, bias=None, out_dtype=None, cfg=None):
    """``words_linear_ref(x, words, bits, w_scale, bias, out_dtype)``: x (..., k) float16 / bfloat16, words (n, k *
    bits // 32) int32 -> (..., n) in out_dtype (default x's). For a call ``launch`` says fits."""
    cfg = CFG if cfg is None else {**CFG, **cfg}
    N = words.shape[0]
    K = words.shape[1] * 32 // bits
    lead = x.shape[:-1]
    M = math.prod(lead)
    x2 = x.reshape(M, K)
    ws_mode = 2 if w_scale.dim() == 2 else int(w_scale.dim() == 1)
    group = K // w_scale.shape[1] if ws_mode == 2 else None
    c = _plan(M, N, K, bits, group, sm_count(x.device), cfg)
    out = torch.empty((*lead, N), device=x.device, dtype=out_dtype or x.dtype)
    o2 = out.view(M, N)
    split = c["split"]
    in_kernel = cfg["SPLIT_IN_KERNEL"]
    part, cnt = split_buffers(split, M, N, c["grid"][0] * c["grid"][1], x.device, torch.float32, o2)
    b_arg = bias if bias is not None else w_scale
    pdl = pdl_args(x2)
    _packed_gemv[c["grid"]](
        x2, words, w_scale, b_arg, o2, part, cnt, M, N, c["k_tiles"], c["iters"],
        w_scale.shape[1] if ws_mode == 2 else 1, x2.stride(0), words.stride(0), N,
        BITS=bits, WS_MODE=ws_mode, GB=c["GB"], HAS_BIAS=bias is not None and (split == 1 or in_kernel),
        SPLIT=split > 1, SPLIT_IN=in_kernel, NSP=pow2(split), BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"], NB=c["NB"],
        num_warps=c["num_warps"], **pdl)
    if split > 1 and not in_kernel:
        BLOCK = 1024
        _sum_splits[(cdiv(M * N, BLOCK),)](part, b_arg, o2, M * N, N, split, HAS_BIAS=bias is not None,
                                                 BLOCK=BLOCK, num_warps=4, **pdl)
    return out
