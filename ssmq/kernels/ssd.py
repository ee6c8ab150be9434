"""Triton SSD chunked scan (Mamba-2 prefill), written from the state-space-duality algorithm.

Per head, with scalar decay a_t = exp(Δ_t A) and chunks of T tokens:
    y_t = Σ_{s<=t in chunk} (C_t·B_s) exp(cs_t - cs_s) Δ_s x_s   (intra-chunk, a masked matmul)
        + exp(cs_t) C_t H_in                                    (state entering the chunk)
where cs is the in-chunk cumulative sum of Δ A. Five launches:
    1. _chunk_cumsum   Δ (bias, softplus, clamp) and cs, per (b, h, chunk)
    2. _chunk_cb       C Bᵀ per (b, chunk, group): shared by the h/g heads of a group
    3. _chunk_state    state each chunk adds, decayed to its end: Xᵀ diag(w) B
    4. _state_passing  the c-step recurrence over chunks, giving each chunk's entering state
    5. _chunk_scan     y from 2-4 on tensor cores, D skip and z gate fused
Same signature and result as ``ssmq.ops.ssd.ssd_chunk_scan_ref``.

``quant_ssd_chunk_scan`` runs the same launches on int8 x, B, C codes (Quamba2), as
``ssmq.ops.quant_ssm.quant_ssd_ref``: the ``QUANT`` constexpr of kernels 2, 3, 5 loads codes and their
scales and dequantizes in registers (x per (h, p) channel, B and C per state index, expanded from their
state groups), so no float copy of x, B, C is written. C Bᵀ is then a float32 (ieee) product of C·s_C·s_B
and B's codes, close to the reference's exact integer dot; the rest runs in the output dtype ``TY``
(the tensor-core operand type, x's dtype for the float scan), fp32 accumulate.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ssmq.kernels import configs
from ssmq.kernels._common import cdiv, dot_precision, pow2, silu, softplus
from ssmq.kernels.launch import fast_launch
from ssmq.ops.layout import has_dt_limit, heads_per_group
from ssmq.ops.ssd import check_state_rows


@fast_launch
@triton.jit
def _chunk_cumsum(
    dt_ptr, A_ptr, dtb_ptr, dt_out_ptr, cs_ptr,
    l, h, T, nc, dt_min, dt_max,
    s_b, s_l, s_h,
    HAS_DTB: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr,
    BT: tl.constexpr, BH: tl.constexpr,
):
    pid_b, pid_c, pid_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_t = tl.arange(0, BT)
    offs_h = pid_h * BH + tl.arange(0, BH)
    pos = pid_c * T + offs_t
    mh = offs_h < h
    valid = (offs_t < T)[:, None] & (pos < l)[:, None] & mh[None, :]
    dt = tl.load(dt_ptr + pid_b * s_b + pos[:, None] * s_l + offs_h[None, :] * s_h, mask=valid, other=0.0)
    dt = dt.to(tl.float32)
    if HAS_DTB:
        dt += tl.load(dtb_ptr + offs_h, mask=mh, other=0.0).to(tl.float32)[None, :]
    if SOFTPLUS:
        dt = softplus(dt)
    if HAS_LIMIT:
        dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    # padded steps get Δ = 0: decay 1 and no input, so they leave the state alone
    dt = tl.where(valid, dt, 0.0)
    cs = tl.cumsum(dt * tl.load(A_ptr + offs_h, mask=mh, other=0.0).to(tl.float32)[None, :], axis=0)
    # (b, h, c, T) layout: the scan kernels read a chunk's T values contiguously
    out_off = ((pid_b * h + offs_h[None, :]) * nc + pid_c) * T + offs_t[:, None]
    keep = (offs_t < T)[:, None] & mh[None, :]
    tl.store(dt_out_ptr + out_off, dt, mask=keep)
    tl.store(cs_ptr + out_off, cs, mask=keep)


@fast_launch
@triton.jit
def _chunk_cb(
    C_ptr, B_ptr, Cs_ptr, Bs_ptr, cb_ptr,
    l, n, T, nc, g,
    s_Cb, s_Cl, s_Cg, s_Cn, s_Bb, s_Bl, s_Bg, s_Bn,
    QUANT: tl.constexpr, DOT_PREC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    # QUANT: C, B (b, l, g, n) int8 codes, Cs, Bs (g, n) float32 scales per state index
    pid_bcg, pid_m, pid_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    # blocks strictly above the diagonal are never read: skip them
    if pid_n * BN <= pid_m * BM + BM - 1:
        grp = pid_bcg % g
        pid_c = (pid_bcg // g) % nc
        pid_b = pid_bcg // (g * nc)
        offs_m = pid_m * BM + tl.arange(0, BM)
        offs_s = pid_n * BN + tl.arange(0, BN)
        offs_k = tl.arange(0, BK)
        pos_m, pos_s = pid_c * T + offs_m, pid_c * T + offs_s
        mm = (offs_m < T) & (pos_m < l)
        ms = (offs_s < T) & (pos_s < l)
        Cp = C_ptr + pid_b * s_Cb + grp * s_Cg + pos_m[:, None] * s_Cl
        Bp = B_ptr + pid_b * s_Bb + grp * s_Bg + pos_s[None, :] * s_Bl
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, n, BK):
            kk = k + offs_k
            c = tl.load(Cp + kk[None, :] * s_Cn, mask=mm[:, None] & (kk < n)[None, :], other=0.0)
            bt = tl.load(Bp + kk[:, None] * s_Bn, mask=(kk < n)[:, None] & ms[None, :], other=0.0)
            if QUANT:
                # both scales on C's side (one rounding per element), B's codes exact in float32; the wrapper
                # asks for ieee products (tf32 would round C·s to 10 bits, ~1e-3), so C Bᵀ stays within float32
                # rounding of the reference's exact integer dot
                scb = tl.load(Cs_ptr + grp * n + kk, mask=kk < n, other=0.0) * \
                    tl.load(Bs_ptr + grp * n + kk, mask=kk < n, other=0.0)
                c = c.to(tl.float32) * scb[None, :]
                bt = bt.to(tl.float32)
            acc = tl.dot(c, bt, acc, input_precision=DOT_PREC)
        out = cb_ptr + pid_bcg.to(tl.int64) * T * T + offs_m[:, None] * T + offs_s[None, :]
        tl.store(out, acc, mask=(offs_m < T)[:, None] & (offs_s < T)[None, :])


@triton.jit
def _code_scales(xs_ptr, Bs_ptr, hh, grp, offs_p, offs_n, p, n, QUANT: tl.constexpr):
    """QUANT: the scales of head hh's x channels offs_p (xs (h, p)) and of group grp's B (or C) states offs_n
    (Bs (g, n)), float32; else ones (the float scan: multiplying by 1.0 leaves every value as it was, and the
    compiler drops the multiplies: the float kernels' sm_90 PTX is unchanged by them)."""
    if QUANT:
        xs = tl.load(xs_ptr + hh * p + offs_p, mask=offs_p < p, other=0.0)
        bs = tl.load(Bs_ptr + grp * n + offs_n, mask=offs_n < n, other=0.0)
    else:
        xs = tl.full(offs_p.shape, 1.0, tl.float32)
        bs = tl.full(offs_n.shape, 1.0, tl.float32)
    return xs, bs


@triton.jit
def _state_tile(l, h, T, nc, BP: tl.constexpr, BN: tl.constexpr):
    """The (p block, n block) of one chunk's state a chunk-state program owns: grid (b·c·h, p blocks, n blocks)."""
    pid_bch, pid_p, pid_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    hh = pid_bch % h
    pid_c = (pid_bch // h) % nc
    pid_b = pid_bch // (h * nc)
    offs_p = pid_p * BP + tl.arange(0, BP)
    offs_n = pid_n * BN + tl.arange(0, BN)
    return pid_bch, hh, pid_c, pid_b, offs_p, offs_n, tl.minimum(T, l - pid_c * T)


@fast_launch
@triton.jit
def _chunk_state(
    x_ptr, B_ptr, xs_ptr, Bs_ptr, dt_ptr, cs_ptr, st_ptr,
    l, h, p, n, T, nc, heads_per_group,
    s_xb, s_xl, s_xh, s_xp, s_Bb, s_Bl, s_Bg, s_Bn,
    QUANT: tl.constexpr, TY: tl.constexpr, DOT_PREC: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr,
):
    pid_bch, hh, pid_c, pid_b, offs_p, offs_n, chunk_len = _state_tile(l, h, T, nc, BP, BN)
    offs_k = tl.arange(0, BK)
    dcs = dt_ptr + ((pid_b * h + hh) * nc + pid_c) * T  # this chunk's Δ and cs rows
    ccs = cs_ptr + ((pid_b * h + hh) * nc + pid_c) * T
    cs_last = tl.load(ccs + T - 1)
    xp = x_ptr + pid_b * s_xb + hh * s_xh + offs_p[:, None] * s_xp
    Bp = B_ptr + pid_b * s_Bb + (hh // heads_per_group) * s_Bg + offs_n[None, :] * s_Bn
    xs, bs = _code_scales(xs_ptr, Bs_ptr, hh, hh // heads_per_group, offs_p, offs_n, p, n, QUANT)
    acc = tl.zeros((BP, BN), dtype=tl.float32)
    for k in range(0, chunk_len, BK):
        kk = k + offs_k
        mk = kk < chunk_len
        pos = pid_c * T + kk
        xt = tl.load(xp + pos[None, :] * s_xl, mask=(offs_p < p)[:, None] & mk[None, :], other=0.0)
        wk = tl.load(dcs + kk, mask=mk, other=0.0) * tl.exp(cs_last - tl.load(ccs + kk, mask=mk, other=0.0))
        xw = (xt.to(tl.float32) * xs[:, None] * wk[None, :]).to(TY)
        bk = tl.load(Bp + pos[:, None] * s_Bl, mask=mk[:, None] & (offs_n < n)[None, :], other=0.0)
        acc = tl.dot(xw, (bk.to(tl.float32) * bs[None, :]).to(TY), acc, input_precision=DOT_PREC)
    out = st_ptr + pid_bch.to(tl.int64) * p * n + offs_p[:, None] * n + offs_n[None, :]
    tl.store(out, acc, mask=(offs_p < p)[:, None] & (offs_n < n)[None, :])


@triton.jit
def _state_row(rows_ptr, pid_b, hh, h, HAS_ROWS: tl.constexpr):
    """The (row, head) index of sequence pid_b's initial and final state: its cache slot ``rows[pid_b]`` when the
    states are read and written in a cache buffer in place, else pid_b."""
    if HAS_ROWS:
        row = tl.load(rows_ptr + pid_b).to(tl.int64)
    else:
        row = pid_b.to(tl.int64)
    return row * h + hh


@fast_launch
@triton.jit
def _chunk_state_fused(
    x_ptr, B_ptr, xs_ptr, Bs_ptr, dt_ptr, cs_ptr, init_ptr, st_ptr, final_ptr, rows_ptr,
    l, h, p, n, T, nc, heads_per_group,
    s_xb, s_xl, s_xh, s_xp, s_Bb, s_Bl, s_Bg, s_Bn,
    HAS_INIT: tl.constexpr, HAS_ROWS: tl.constexpr, QUANT: tl.constexpr, TY: tl.constexpr, DOT_PREC: tl.constexpr,
    BP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    """Chunk states and the recurrence over chunks in one pass: a program owns a (BP, BN) tile of one
    head's state and walks the chunks in order, writing the state *entering* each chunk in TY
    (what _chunk_scan feeds its tensor cores anyway) and the final state in float32. The per-chunk
    matmul does not depend on the carried state, so the chunks' loads pipeline; no float32 per-chunk
    states ever reach memory."""
    pid_bh, pid_p, pid_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    hh = pid_bh % h
    pid_b = pid_bh // h
    offs_p = pid_p * BP + tl.arange(0, BP)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    mp, mn = offs_p < p, offs_n < n
    m2 = mp[:, None] & mn[None, :]
    state_at = _state_row(rows_ptr, pid_b, hh, h, HAS_ROWS) * p * n + offs_p[:, None] * n + offs_n[None, :]
    if HAS_INIT:
        s = tl.load(init_ptr + state_at, mask=m2, other=0.0).to(tl.float32)
    else:
        s = tl.zeros((BP, BN), dtype=tl.float32)
    xp = x_ptr + pid_b * s_xb + hh * s_xh + offs_p[:, None] * s_xp
    Bp = B_ptr + pid_b * s_Bb + (hh // heads_per_group) * s_Bg + offs_n[None, :] * s_Bn
    xs, bs = _code_scales(xs_ptr, Bs_ptr, hh, hh // heads_per_group, offs_p, offs_n, p, n, QUANT)
    for c in range(nc):
        row = (pid_bh * nc + c) * T  # this chunk's Δ and cs rows in (b, h, c, T)
        chunk_len = tl.minimum(T, l - c * T)
        cs_last = tl.load(cs_ptr + row + T - 1)
        acc = tl.zeros((BP, BN), dtype=tl.float32)
        for k in range(0, chunk_len, BK):
            kk = k + offs_k
            mk = kk < chunk_len
            pos = c * T + kk
            xt = tl.load(xp + pos[None, :] * s_xl, mask=mp[:, None] & mk[None, :], other=0.0)
            wk = tl.load(dt_ptr + row + kk, mask=mk, other=0.0) * tl.exp(cs_last - tl.load(cs_ptr + row + kk, mask=mk, other=0.0))
            xw = (xt.to(tl.float32) * xs[:, None] * wk[None, :]).to(TY)
            bk = tl.load(Bp + pos[:, None] * s_Bl, mask=mk[:, None] & mn[None, :], other=0.0)
            acc = tl.dot(xw, (bk.to(tl.float32) * bs[None, :]).to(TY), acc, input_precision=DOT_PREC)
        out = st_ptr + ((pid_b * nc + c) * h + hh).to(tl.int64) * p * n + offs_p[:, None] * n + offs_n[None, :]
        tl.store(out, s.to(st_ptr.dtype.element_ty), mask=m2)
        s = tl.exp(cs_last) * s + acc
    tl.store(final_ptr + state_at, s.to(final_ptr.dtype.element_ty), mask=m2)


@fast_launch
@triton.jit
def _state_passing(
    st_ptr, cs_ptr, init_ptr, final_ptr, out_ptr, rows_ptr,
    h, pn, T, nc,
    HAS_INIT: tl.constexpr, HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr,
):
    pid_bh, pid_e = tl.program_id(0), tl.program_id(1)
    hh = pid_bh % h
    pid_b = pid_bh // h
    offs = pid_e * BLOCK + tl.arange(0, BLOCK)
    m = offs < pn
    state_at = _state_row(rows_ptr, pid_b, hh, h, HAS_ROWS) * pn + offs
    if HAS_INIT:
        s = tl.load(init_ptr + state_at, mask=m, other=0.0).to(tl.float32)
    else:
        s = tl.zeros((BLOCK,), dtype=tl.float32)
    for c in range(nc):
        # chunk c's own contribution in, the state entering it out (in out_ptr's dtype)
        idx = ((pid_b * nc + c) * h + hh).to(tl.int64) * pn + offs
        added = tl.load(st_ptr + idx, mask=m, other=0.0)
        tl.store(out_ptr + idx, s.to(out_ptr.dtype.element_ty), mask=m)
        s = tl.exp(tl.load(cs_ptr + (pid_bh * nc + c) * T + T - 1)) * s + added
    tl.store(final_ptr + state_at, s.to(final_ptr.dtype.element_ty), mask=m)


@triton.jit
def _scan_tile(l, h, T, nc, heads_per_group, BM: tl.constexpr, BP: tl.constexpr):
    """The (row block, head-dim block) of one chunk-scan program: grid (b·c·h, row blocks, p blocks). The last row
    blocks have the most intra-chunk work, so they launch first and the short ones fill the tail."""
    pid_bch, pid_p = tl.program_id(0), tl.program_id(2)
    pid_m = tl.num_programs(1) - 1 - tl.program_id(1)
    hh = pid_bch % h
    pid_c = (pid_bch // h) % nc
    pid_b = pid_bch // (h * nc)
    chunk_len = tl.minimum(T, l - pid_c * T)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_p = pid_p * BP + tl.arange(0, BP)
    row = ((pid_b * h + hh) * nc + pid_c) * T
    return pid_bch, pid_m, hh, pid_c, pid_b, hh // heads_per_group, chunk_len, offs_m, offs_p, pid_c * T + offs_m, row


@triton.jit
def _scan_epilogue(acc, x_ptr, xs, D_ptr, z_ptr, y_ptr, pid_b, hh, pos_m, offs_p, mm, mp,
                   s_xb, s_xl, s_xh, s_xp, s_Dh, s_Dp, s_zb, s_zl, s_zh, s_zp, s_yb, s_yl, s_yh, s_yp,
                   HAS_D: tl.constexpr, HAS_Z: tl.constexpr):
    """y = (acc + D·x·xs) · silu(z) for the tile's rows pos_m and channels offs_p, stored in y's dtype; xs (BP,)
    dequantizes int8 x codes per channel (1.0 for float x)."""
    m2 = mm[:, None] & mp[None, :]
    if HAS_D:
        xm = tl.load(x_ptr + pid_b * s_xb + hh * s_xh + pos_m[:, None] * s_xl + offs_p[None, :] * s_xp, mask=m2,
                     other=0.0).to(tl.float32) * xs[None, :]
        acc += xm * tl.load(D_ptr + hh * s_Dh + offs_p * s_Dp, mask=mp, other=0.0).to(tl.float32)[None, :]
    if HAS_Z:
        zz = tl.load(z_ptr + pid_b * s_zb + pos_m[:, None] * s_zl + hh * s_zh + offs_p[None, :] * s_zp,
                     mask=m2, other=0.0).to(tl.float32)
        acc *= silu(zz)
    tl.store(y_ptr + pid_b * s_yb + pos_m[:, None] * s_yl + hh * s_yh + offs_p[None, :] * s_yp,
             acc.to(y_ptr.dtype.element_ty), mask=m2)


@fast_launch
@triton.jit
def _chunk_scan(
    x_ptr, C_ptr, xs_ptr, Cs_ptr, cb_ptr, dt_ptr, cs_ptr, st_ptr, D_ptr, z_ptr, y_ptr,
    l, h, p, n, T, nc, g, heads_per_group,
    s_xb, s_xl, s_xh, s_xp, s_Cb, s_Cl, s_Cg, s_Cn, s_Dh, s_Dp,
    s_zb, s_zl, s_zh, s_zp, s_yb, s_yl, s_yh, s_yp,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, QUANT: tl.constexpr, TY: tl.constexpr, DOT_PREC: tl.constexpr,
    BM: tl.constexpr, BP: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
):
    pid_bch, pid_m, hh, pid_c, pid_b, grp, chunk_len, offs_m, offs_p, pos_m, row = \
        _scan_tile(l, h, T, nc, heads_per_group, BM, BP)
    if pid_m * BM >= chunk_len:
        # past the end of a short last chunk (a 128-token prompt fills half of a 256-token chunk): no rows to write
        return
    offs_k = tl.arange(0, BK)
    offs_n = tl.arange(0, BN)
    mm, mp = offs_m < chunk_len, offs_p < p
    cs_m = tl.load(cs_ptr + row + offs_m, mask=mm, other=0.0)
    xs, _ = _code_scales(xs_ptr, Cs_ptr, hh, grp, offs_p, offs_n, p, n, QUANT)

    # state entering the chunk: exp(cs_t) C_t H_in, with H_in (p, n) read as Hᵀ (n, p)
    acc = tl.zeros((BM, BP), dtype=tl.float32)
    Cp = C_ptr + pid_b * s_Cb + grp * s_Cg + pos_m[:, None] * s_Cl
    Sp = st_ptr + pid_bch.to(tl.int64) * p * n + offs_p[None, :] * n
    for k in range(0, n, BN):
        kn = k + offs_n
        c = tl.load(Cp + kn[None, :] * s_Cn, mask=mm[:, None] & (kn < n)[None, :], other=0.0)
        if QUANT:  # C's scale runs along the contraction: on the operand, not the result
            c = c.to(tl.float32) * tl.load(Cs_ptr + grp * n + kn, mask=kn < n, other=0.0)[None, :]
        s = tl.load(Sp + kn[:, None], mask=(kn < n)[:, None] & mp[None, :], other=0.0)
        acc = tl.dot(c.to(TY), s.to(TY), acc, input_precision=DOT_PREC)
    acc *= tl.exp(cs_m)[:, None]

    # intra-chunk: causal (C Bᵀ ∘ decay ∘ Δ) X, only the blocks at or left of the diagonal
    cbp = cb_ptr + ((pid_b * nc + pid_c) * g + grp).to(tl.int64) * T * T + offs_m[:, None] * T
    xp = x_ptr + pid_b * s_xb + hh * s_xh + offs_p[None, :] * s_xp
    hi = tl.minimum((pid_m + 1) * BM, chunk_len)
    for k in range(0, hi, BK):
        kk = k + offs_k
        mk = kk < chunk_len
        cb = tl.load(cbp + kk[None, :], mask=mm[:, None] & mk[None, :], other=0.0)
        cs_k = tl.load(cs_ptr + row + kk, mask=mk, other=0.0)
        dt_k = tl.load(dt_ptr + row + kk, mask=mk, other=0.0)
        # mask before exp: above the diagonal exp(cs_t - cs_s) can overflow, and inf * 0 is NaN
        causal = offs_m[:, None] >= kk[None, :]
        decay = tl.exp(tl.where(causal, cs_m[:, None] - cs_k[None, :], float("-inf")))
        sc = cb * decay * dt_k[None, :]
        xk = tl.load(xp + (pid_c * T + kk)[:, None] * s_xl, mask=mk[:, None] & mp[None, :], other=0.0)
        if QUANT:
            xk = xk.to(tl.float32) * xs[None, :]
        acc = tl.dot(sc.to(TY), xk.to(TY), acc, input_precision=DOT_PREC)

    _scan_epilogue(acc, x_ptr, xs, D_ptr, z_ptr, y_ptr, pid_b, hh, pos_m, offs_p, mm, mp,
                   s_xb, s_xl, s_xh, s_xp, s_Dh, s_Dp, s_zb, s_zl, s_zh, s_zp, s_yb, s_yl, s_yh, s_yp, HAS_D, HAS_Z)


CFG = configs.load("ssd")  # launch settings (configs/ssd.json, keys in docs/kernels.md)


_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def states_path(nc: int, cfg: dict | None = None) -> str:
    """The chunk-state path for sequences of ``nc`` chunks (configs/ssd.json's STATES): "split" (parallel float32
    chunk states, then the recurrence over chunks: two kernels) or "fused" (one kernel walks the chunks); STATES
    "by_chunks" takes fused up to FUSED_MAX_CHUNKS chunks a sequence (with one chunk the recurrence has nothing to
    pass and the second launch is all it costs), split above."""
    cfg = CFG if cfg is None else cfg
    if cfg["STATES"] != "by_chunks":
        return cfg["STATES"]
    return "fused" if nc <= cfg["FUSED_MAX_CHUNKS"] else "split"


def ssd_chunk_scan(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, dt_softplus=False,
                   dt_limit=(0.0, math.inf), initial_states=None, return_final_states=False, state_rows=None):
    """Chunked SSD scan, as ``ssd_chunk_scan_ref``.

    x, z: (b, l, h, p); dt: (b, l, h); A: (h,); B, C: (b, l, g, n);
    D: (h,) or (h, p); dt_bias: (h,); initial_states: (b, h, p, n).
    Returns y (b, l, h, p) in x's dtype and, if asked, final states (b, h, p, n) float32.
    state_rows (states (s, h, p, n) float, rows (b,) int64): the kernels read the initial states at ``rows`` of
    the cache buffer and write the final states there in its dtype (no gather, float32 copy or scatter); y alone.
    """
    check_state_rows(state_rows, initial_states, return_final_states, x.shape[0])
    return _ssd(x, None, dt, A, B, None, C, None, chunk_size, D, z, dt_bias, dt_softplus, dt_limit, initial_states,
                return_final_states, x.dtype, state_rows)


def quant_ssd_chunk_scan(x_q, x_scale, dt, A, B_q, B_scale, C_q, C_scale, chunk_size, D=None, dt_bias=None,
                         dt_softplus=True, dt_limit=(0.0, math.inf), initial_states=None, return_final_states=False,
                         out_dtype=None):
    """Chunked SSD on int8 codes, as ``ssmq.ops.quant_ssm.quant_ssd_ref``.

    x_q: (b, l, h, p) int8, x_scale (h, p) or (); B_q, C_q: (b, l, g, n) int8, scales (g, k) (k | n state groups);
    other arguments as ``ssd_chunk_scan``. Returns y (b, l, h, p) in ``out_dtype`` (float32 when None, as the
    reference) and, if asked, final states (b, h, p, n) float32.
    """
    h, p = x_q.shape[2], x_q.shape[3]
    g, n = B_q.shape[2], B_q.shape[3]
    dev = x_q.device
    # scales as tables the kernels index per (head, channel) and per (group, state): tiny, built per call
    xs = x_scale.float().to(dev).expand(h, p).contiguous() if x_scale.dim() == 0 else \
        x_scale.float().reshape(h, p).contiguous()

    def per_state(s):  # (g, k) -> (g, n): each state index with its state group's scale
        s = s.float().to(dev).reshape(-1, s.shape[-1]) if s.dim() else s.float().to(dev).reshape(1, 1)
        return s.expand(g, s.shape[-1]).repeat_interleave(n // s.shape[-1], -1).contiguous()

    return _ssd(x_q, xs, dt, A, B_q, per_state(B_scale), C_q, per_state(C_scale), chunk_size, D, None, dt_bias,
                dt_softplus, dt_limit, initial_states, return_final_states, out_dtype or torch.float32)


def _ssd(x, xs, dt, A, B, Bs, C, Cs, chunk_size, D, z, dt_bias, dt_softplus, dt_limit, initial_states,
         return_final_states, out_dtype, state_rows=None):
    """The five launches for float x, B, C (scales None) or int8 codes with per-(h, p) xs and per-(g, n) Bs, Cs
    float32 tables. out_dtype: y's dtype, also the tensor-core operand type of the chunk states and the scan.
    state_rows: (states, rows) read and written in place, as ``ssd_chunk_scan``."""
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    rep = heads_per_group(h, g)
    T = chunk_size
    nc = cdiv(l, T)
    dev, f32 = x.device, torch.float32
    quant = xs is not None
    TY = _TL[out_dtype]
    prec = dot_precision(out_dtype)
    y = torch.empty((b, l, h, p), device=dev, dtype=out_dtype)
    rows = None
    if state_rows is not None:  # the initial and the final state are the cache rows themselves
        final, rows = state_rows
        initial_states = final
    else:
        final = torch.empty((b, h, p, n), device=dev, dtype=f32)
    if l == 0:  # nothing to scan: the state passes through (cache rows: already in place)
        if rows is not None:
            return y
        final.copy_(initial_states if initial_states is not None else torch.zeros_like(final))
        return (y, final) if return_final_states else y
    # the float scan passes these unread pointers for the scales
    xs, Bs, Cs = (xs, Bs, Cs) if quant else (A, A, A)

    dt_out = torch.empty((b, h, nc, T), device=dev, dtype=f32)
    cs = torch.empty_like(dt_out)
    BT, BH = pow2(T, 16), 8 if T <= 256 else 2
    has_limit = has_dt_limit(dt_limit)
    _chunk_cumsum[(b, nc, cdiv(h, BH))](
        dt, A, dt_bias if dt_bias is not None else A, dt_out, cs,
        l, h, T, nc, float(dt_limit[0]), float(dt_limit[1]), *dt.stride(),
        HAS_DTB=dt_bias is not None, SOFTPLUS=dt_softplus, HAS_LIMIT=has_limit, BT=BT, BH=BH, num_warps=4,
    )

    cb = torch.empty((b, nc, g, T, T), device=dev, dtype=f32)
    BMc = min(64, pow2(T, 16))
    _chunk_cb[(b * nc * g, cdiv(T, BMc), cdiv(T, BMc))](
        C, B, Cs, Bs, cb, l, n, T, nc, g, *C.stride(), *B.stride(),
        QUANT=quant, DOT_PREC="ieee" if quant else prec, BM=BMc, BN=BMc, BK=min(64, pow2(n, 16)), num_warps=4, num_stages=2,
    )

    init = initial_states.contiguous() if initial_states is not None else final
    # states entering each chunk, in out_dtype: _chunk_scan's tensor-core operand
    st_in = torch.empty((b, nc, h, p, n), device=dev, dtype=out_dtype)
    if states_path(nc) == "fused":
        c = CFG["fused"]
        BP, BN = min(c["BP"], pow2(p, 16)), min(c["BN"], pow2(n, 16))
        _chunk_state_fused[(b * h, cdiv(p, BP), cdiv(n, BN))](
            x, B, xs, Bs, dt_out, cs, init, st_in, final, rows if rows is not None else cs, l, h, p, n, T, nc, rep,
            *x.stride(), *B.stride(), HAS_INIT=initial_states is not None, HAS_ROWS=rows is not None, QUANT=quant,
            TY=TY, DOT_PREC=prec, BP=BP, BN=BN, BK=min(c["BK"], pow2(T, 16)),
            num_warps=c["num_warps"], num_stages=c["num_stages"],
        )
    else:
        c = CFG["state"]
        states = torch.empty((b, nc, h, p, n), device=dev, dtype=f32)
        BP, BN = min(c["BP"], pow2(p, 16)), min(c["BN"], pow2(n, 16))
        _chunk_state[(b * nc * h, cdiv(p, BP), cdiv(n, BN))](
            x, B, xs, Bs, dt_out, cs, states, l, h, p, n, T, nc, rep, *x.stride(), *B.stride(),
            QUANT=quant, TY=TY, DOT_PREC=prec, BP=BP, BN=BN, BK=min(c["BK"], pow2(T, 16)), num_warps=c["num_warps"],
            num_stages=c["num_stages"],
        )
        PBLOCK = min(1024, pow2(p * n, 16))
        _state_passing[(b * h, cdiv(p * n, PBLOCK))](
            states, cs, init, final, st_in, rows if rows is not None else cs, h, p * n, T, nc,
            HAS_INIT=initial_states is not None, HAS_ROWS=rows is not None, BLOCK=PBLOCK, num_warps=4,
        )

    Dhp = None if D is None else (D[:, None].expand(h, p) if D.dim() == 1 else D)
    c = CFG["scan"]
    BM = min(c["BM"], pow2(T, 16))
    BPs = min(64, pow2(p, 16))
    _chunk_scan[(b * nc * h, cdiv(T, BM), cdiv(p, BPs))](
        x, C, xs, Cs, cb, dt_out, cs, st_in, Dhp if Dhp is not None else A, z if z is not None else A, y,
        l, h, p, n, T, nc, g, rep,
        *x.stride(), *C.stride(), *(Dhp.stride() if Dhp is not None else (0, 0)),
        *(z.stride() if z is not None else (0, 0, 0, 0)), *y.stride(),
        HAS_D=D is not None, HAS_Z=z is not None, QUANT=quant, TY=TY, DOT_PREC=prec,
        BM=BM, BP=BPs, BK=min(c["BK"], pow2(T, 16)), BN=min(128, pow2(n, 16)), num_warps=c["num_warps"],
        num_stages=c["num_stages"], **({"maxnreg": c["maxnreg"]} if c.get("maxnreg") else {}),
    )
    return (y, final) if return_final_states and rows is None else y
