"""Triton SSDi8 (``ssmq.ops.ssd_int8``): the int8 SSD scan in five launches; intermediates: (b, h, c, T) floats, int8
chunk states, and CB's integers.

Glossary as ``ssmq.ops.ssd_int8``. The launches of ``ssd_int8`` (names as the benchmark's shares):
    _chunk_cumsum     Δ and dA_cumsum, the float SSD's own kernel (``ssmq.kernels.ssd``): dt, cs (b, h, c, T) float32
    _chunk_state_q    prologue: X_scaled = X · exp(cs_end - cs_s)·Δ_s quantized to int8 in registers (QUANT_X);
                      int8 X_scaled (T, p) x int8 B (T, n), exact integers on float16 tensor cores (``_int_dot``);
                      epilogue: the requantization (one float32 multiply, round half to even, clamp) -> int8 state
    _state_passing_q  decay_q = round(exp(cs_end)·2^7) from cs (DECAY_CS);
                      s <- clamp(((decay_q·s + 2^6) >> 7) + chunk_q) in int32 registers, int8 in and out
    _chunk_bmm_q      C_q · B_qᵀ per (chunk, group), int32 products, stored (b, c, g, t, s) as float32 for the scan
                      (the same integers); blocks above the diagonal skipped (CAUSAL)
    _chunk_scan_q     ChunkScan1: C_q (T, n) x int8 state (n, p) -> int32, times exp(cs_t)·C_scale·state_scale,
                      the float32 accumulator ChunkScan2 (DIAG) then adds to: float32(CB)·C_scale·B_scale·
                      exp(cs_t - cs_s)·Δ_s times float X on tensor cores (X's dtype, as the float SSD), the decay
                      factored below the diagonal (FACTORED); D skip and z gate fused; y straight to (b, l, h, p)
Integer arithmetic is exact; the float steps that feed an int8 code follow the reference's order of operations, so
the codes differ from the reference only where exp / cumsum round differently, which flips a code only on a near-tie
(the scan's float sums take their own order; tests/test_ssdi8_kernels.py has the bound). The stage wrappers (``chunk_state_q`` ...) run the same kernels on given
codes and equal the reference stages bit for bit; ``TRITON_STAGES`` plugs them into ``run_ssd_int8`` for the
ablation options.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ssmq.kernels import configs
from ssmq.kernels._common import cdiv, dot_precision, pow2, quantize_rne, rne_int8
from ssmq.kernels.ssd import _chunk_cumsum, _scan_epilogue, _scan_tile, _state_tile
from ssmq.ops.layout import has_dt_limit, heads_per_group
from ssmq.ops.ssd_int8 import DECAY_BITS, IntStages, SSDi8Options, run_ssd_int8


@triton.jit
def _round_half_even(v):
    # no libdevice (the interpreter has none): floor and the exact remainder v - floor(v); for values outside
    # [-128, 127] (the decay code 2^7), where rne_int8 would clamp
    r = tl.floor(v)
    d = v - r
    odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
    return tl.where((d > 0.5) | ((d == 0.5) & odd), r + 1.0, r)


@triton.jit
def _int_dot(a, b, acc, F16MMA: tl.constexpr):
    """acc + a·b for int8 codes a, b: on int8 tensor cores into int32, or (F16MMA) on float16 ones into float32.
    Both give the same integers: a code is exact in float16, a product has magnitude <= 2^14, and a sum of up to
    1024 of them stays within 2^24, where float32 holds every integer (the launchers keep F16MMA to contractions of
    <= 1024 terms). Why float16: sm_90's int8 products need both operands K-major, and every int8 operand of the SSD
    (X and B over tokens, C over states) is strided along K, so Triton transposes them through shared memory; the
    float16 products take either order, which moves these kernels from the L1 bound to the DRAM one."""
    if F16MMA:
        return tl.dot(a.to(tl.float16), b.to(tl.float16), acc)
    else:
        return tl.dot(a, b, acc, out_dtype=tl.int32)


@triton.jit
def _chunk_state_q(x_ptr, B_ptr, dt_ptr, cs_ptr, xsc_ptr, Bs_ptr, ss_ptr, mult_ptr, out_ptr,
                   l, h, p, n, T, nc, rep,
                   s_xb, s_xl, s_xh, s_xp, s_Bb, s_Bl, s_Bg, s_Bn,
                   QUANT_X: tl.constexpr, F16MMA: tl.constexpr, BT: tl.constexpr, BP: tl.constexpr,
                   BN: tl.constexpr):
    # x (b, l, h, p): float X (QUANT_X) or int8 X_scaled codes; B (b, l, g, n) int8; dt, cs (b, h, c, T) float32;
    # xsc = xs_scale, ss = state_scale (h, p), Bs = B_scale (g,): with QUANT_X the requantization multiplier is
    # xsc·Bs / ss (the reference's order, IEEE division), else it is given as mult (h, p)
    # -> out (b, c, h, p, n) int8. One program: a (BP, BN) tile of one chunk state.
    pid_bch, hh, pid_c, pid_b, offs_p, offs_n, chunk_len = _state_tile(l, h, T, nc, BP, BN)
    mp, mn = offs_p < p, offs_n < n
    row = ((pid_b * h + hh) * nc + pid_c) * T  # this chunk's Δ and cs
    xp = x_ptr + pid_b * s_xb + hh * s_xh + offs_p[:, None] * s_xp
    Bp = B_ptr + pid_b * s_Bb + (hh // rep) * s_Bg + offs_n[None, :] * s_Bn
    if QUANT_X:
        cs_last = tl.load(cs_ptr + row + T - 1)
        xsc = tl.load(xsc_ptr + hh * p + offs_p, mask=mp, other=1.0)
    acc = tl.zeros((BP, BN), dtype=tl.float32 if F16MMA else tl.int32)
    for t0 in range(0, chunk_len, BT):
        tt = t0 + tl.arange(0, BT)
        mt = tt < chunk_len
        pos = pid_c * T + tt
        xv = tl.load(xp + pos[None, :] * s_xl, mask=mp[:, None] & mt[None, :], other=0)
        if QUANT_X:
            # as the reference: LUT_state = exp(Acs_end - Acs_s)·Δ_s, then Q(X·LUT_state / xs_scale)
            lut = tl.exp(cs_last - tl.load(cs_ptr + row + tt, mask=mt, other=0.0)) * tl.load(dt_ptr + row + tt,
                                                                                             mask=mt, other=0.0)
            xq = quantize_rne(xv.to(tl.float32) * lut[None, :], xsc[:, None])
        else:
            xq = xv
        bq = tl.load(Bp + pos[:, None] * s_Bl, mask=mt[:, None] & mn[None, :], other=0)
        acc = _int_dot(xq, bq, acc, F16MMA)
    if QUANT_X:
        mult = tl.math.div_rn(xsc * tl.load(Bs_ptr + hh // rep), tl.load(ss_ptr + hh * p + offs_p, mask=mp, other=1.0))
    else:
        mult = tl.load(mult_ptr + hh * p + offs_p, mask=mp, other=0.0)
    q = rne_int8(acc.to(tl.float32) * mult[:, None])
    tl.store(out_ptr + pid_bch.to(tl.int64) * p * n + offs_p[:, None] * n + offs_n[None, :], q,
             mask=mp[:, None] & mn[None, :])


@triton.jit
def _state_passing_q(chunk_ptr, decay_ptr, init_ptr, enter_ptr, final_ptr, nc, h, m, T,
                     HAS_INIT: tl.constexpr, DECAY_CS: tl.constexpr, BLOCK: tl.constexpr, SHIFT: tl.constexpr):
    # chunk / enter (b, c, h, m = p·n) int8; init / final (b, h, m) int8; decay: (b, c, h) int32 codes, or with
    # DECAY_CS the (b, h, c, T) dA_cumsum, coded here as the reference's decay_fixed_point
    pid_b, pid_h, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs = pid_m * BLOCK + tl.arange(0, BLOCK)
    mask = offs < m
    if HAS_INIT:
        s = tl.load(init_ptr + (pid_b * h + pid_h) * m + offs, mask=mask, other=0).to(tl.int32)
    else:
        s = tl.zeros((BLOCK,), dtype=tl.int32)
    for c in range(nc):
        row = ((pid_b * nc + c) * h + pid_h).to(tl.int64) * m
        tl.store(enter_ptr + row + offs, s.to(tl.int8), mask=mask)
        if DECAY_CS:
            cs_end = tl.load(decay_ptr + ((pid_b * h + pid_h) * nc + c) * T + T - 1)
            dq = _round_half_even(tl.exp(cs_end) * (1 << SHIFT)).to(tl.int32)
        else:
            dq = tl.load(decay_ptr + (pid_b * nc + c) * h + pid_h)
        ch = tl.load(chunk_ptr + row + offs, mask=mask, other=0).to(tl.int32)
        s = ((dq * s + (1 << (SHIFT - 1))) >> SHIFT) + ch
        s = tl.minimum(tl.maximum(s, -128), 127)
    tl.store(final_ptr + (pid_b * h + pid_h) * m + offs, s.to(tl.int8), mask=mask)


@triton.jit
def _chunk_bmm_q(C_ptr, B_ptr, out_ptr, l, T, nc, g, n,
                 s_Cb, s_Cl, s_Cg, s_Cn, s_Bb, s_Bl, s_Bg, s_Bn,
                 CAUSAL: tl.constexpr, F16MMA: tl.constexpr, BM: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr):
    # C, B (b, l, g, n) int8 -> out (b, c, g, t, s) int32 or float32 (the same integers: the scan reads float32;
    # rows / columns past l are 0, as the zero-padded reference). s innermost: the scan's loads of a row of CB are
    # contiguous (with the reference's (t, s, g) order they were strided by the runtime g, unvectorized)
    pid_bc, pid_g, pid_ts = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    pid_b, pid_c = pid_bc // nc, pid_bc % nc
    s_blocks = tl.cdiv(T, BS)
    pid_t, pid_s = pid_ts // s_blocks, pid_ts % s_blocks
    if CAUSAL:
        last_s = pid_t * BM + BM - 1  # blocks strictly above the diagonal are never read
    else:
        last_s = T
    if pid_s * BS <= last_s:
        offs_t = pid_t * BM + tl.arange(0, BM)
        offs_s = pid_s * BS + tl.arange(0, BS)
        chunk_len = tl.minimum(T, l - pid_c * T)
        mt, ms = offs_t < chunk_len, offs_s < chunk_len
        Cp = C_ptr + pid_b * s_Cb + pid_g * s_Cg + (pid_c * T + offs_t[:, None]) * s_Cl
        Bp = B_ptr + pid_b * s_Bb + pid_g * s_Bg + (pid_c * T + offs_s[None, :]) * s_Bl
        acc = tl.zeros((BM, BS), dtype=tl.float32 if F16MMA else tl.int32)
        for k0 in range(0, n, BK):
            offs_k = k0 + tl.arange(0, BK)
            mk = offs_k < n
            cq = tl.load(Cp + offs_k[None, :] * s_Cn, mask=mt[:, None] & mk[None, :], other=0)
            bq = tl.load(Bp + offs_k[:, None] * s_Bn, mask=ms[None, :] & mk[:, None], other=0)
            acc = _int_dot(cq, bq, acc, F16MMA)
        out = out_ptr + (pid_bc * g + pid_g).to(tl.int64) * T * T + offs_t[:, None] * T + offs_s[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(offs_t[:, None] < T) & (offs_s[None, :] < T))


@triton.jit
def _chunk_scan_q(C_ptr, S_ptr, lut_ptr, cs_ptr, dt_ptr, Cs_ptr, Bs_ptr, ss_ptr, cb_ptr, x_ptr, D_ptr, z_ptr, y_ptr,
                  l, h, p, n, T, nc, g, rep,
                  s_Cb, s_Cl, s_Cg, s_Cn, s_xb, s_xl, s_xh, s_xp, s_Dh, s_Dp,
                  s_zb, s_zl, s_zh, s_zp, s_yb, s_yl, s_yh, s_yp,
                  LUT_IN: tl.constexpr, DIAG: tl.constexpr, FACTORED: tl.constexpr, HAS_D: tl.constexpr,
                  HAS_Z: tl.constexpr, DOT_PREC: tl.constexpr, F16MMA: tl.constexpr,
                  BM: tl.constexpr, BP: tl.constexpr, BK: tl.constexpr, BS: tl.constexpr):
    # C (b, l, g, n) int8; S = entering state (b, c, h, p, n) int8; LUT_off (b, c, T, h) given (LUT_IN) or
    # exp(cs_t)·C_scale from cs (b, h, c, T); Cs, Bs (g,); ss = state_scale (h, p); cb (b, c, t, s, g) integers
    # (int32, or float32 from the whole scan) in (b, c, g, t, s); x, z (b, l, h, p); D (h, p) strides -> y (b, l, h, p) float32
    pid_bch, pid_m, hh, pid_c, pid_b, grp, chunk_len, offs_m, offs_p, pos_m, row = _scan_tile(l, h, T, nc, rep, BM, BP)
    if pid_m * BM >= chunk_len:  # past the end of a short last chunk: no rows to write
        return
    mm, mp = offs_m < chunk_len, offs_p < p

    # ChunkScan1: int32 C_q · state_q, then float32(acc)·LUT_off[t]·state_scale[p] (the reference's order)
    acc = tl.zeros((BM, BP), dtype=tl.float32 if F16MMA else tl.int32)
    Cp = C_ptr + pid_b * s_Cb + grp * s_Cg + pos_m[:, None] * s_Cl
    Sp = S_ptr + pid_bch.to(tl.int64) * p * n + offs_p[None, :] * n
    for k0 in range(0, n, BK):
        offs_k = k0 + tl.arange(0, BK)
        mk = offs_k < n
        cq = tl.load(Cp + offs_k[None, :] * s_Cn, mask=mm[:, None] & mk[None, :], other=0)
        sq = tl.load(Sp + offs_k[:, None], mask=mp[None, :] & mk[:, None], other=0)
        acc = _int_dot(cq, sq, acc, F16MMA)
    if LUT_IN:
        lut = tl.load(lut_ptr + ((pid_b * nc + pid_c) * T + offs_m) * h + hh, mask=mm, other=0.0)
    else:
        lut = tl.exp(tl.load(cs_ptr + row + offs_m, mask=mm, other=0.0)) * tl.load(Cs_ptr + grp)
    ss = tl.load(ss_ptr + hh * p + offs_p, mask=mp, other=0.0)
    y = acc.to(tl.float32) * lut[:, None] * ss[None, :]

    if DIAG:
        # ChunkScan2: Σ_{s<=t} float32(CB)·(exp(cs_t - cs_s)·Δ_s·C_scale·B_scale) X_s, blocks left of the diagonal.
        # FACTORED: the blocks wholly below the diagonal (s < m0 <= t) take exp(cs_t - cs_s) = exp(cs_t - cs_m0)·
        # exp(cs_m0 - cs_s), BM + BS exps per block instead of BM·BS (the exps, not the tensor cores, bound this loop).
        # Both factors are <= 1 where dA_cumsum does not rise (Δ·A <= 0: every Mamba-2, A = -exp(A_log)); otherwise a
        # factor overflows only if dA_cumsum rises by > 88 inside a chunk. The diagonal block keeps the masked form.
        m0 = pid_m * BM
        cs_m = tl.load(cs_ptr + row + offs_m, mask=mm, other=0.0)
        csbs = tl.load(Cs_ptr + grp) * tl.load(Bs_ptr + grp)
        cbp = cb_ptr + ((pid_b * nc + pid_c) * g + grp).to(tl.int64) * T * T + offs_m[:, None] * T
        xp = x_ptr + pid_b * s_xb + hh * s_xh + offs_p[None, :] * s_xp
        ty = x_ptr.dtype.element_ty
        yd = y  # the diagonal accumulates onto ChunkScan1's y: one (BM, BP) accumulator live, not two
        hi = tl.minimum(m0 + BM, chunk_len)
        lo = 0
        if FACTORED:  # BS divides BM (the launcher sets BS = BM), so these blocks end at or before m0
            lo = tl.minimum(m0, hi)
            cs0 = tl.load(cs_ptr + row + m0)
            e_m = tl.where(mm, tl.exp(cs_m - cs0), 0.0)
            for k0 in range(0, lo, BS):
                kk = k0 + tl.arange(0, BS)
                mk = kk < chunk_len
                cb = tl.load(cbp + kk[None, :], mask=mm[:, None] & mk[None, :], other=0)
                w_k = tl.exp(cs0 - tl.load(cs_ptr + row + kk, mask=mk, other=0.0)) \
                    * tl.load(dt_ptr + row + kk, mask=mk, other=0.0) * csbs
                sc = cb.to(tl.float32) * (e_m[:, None] * w_k[None, :])
                xk = tl.load(xp + (pid_c * T + kk)[:, None] * s_xl, mask=mk[:, None] & mp[None, :], other=0.0)
                yd = tl.dot(sc.to(ty), xk, yd, input_precision=DOT_PREC)
        for k0 in range(lo, hi, BS):
            kk = k0 + tl.arange(0, BS)
            mk = kk < chunk_len
            cb = tl.load(cbp + kk[None, :], mask=mm[:, None] & mk[None, :], other=0)
            cs_k = tl.load(cs_ptr + row + kk, mask=mk, other=0.0)
            dt_k = tl.load(dt_ptr + row + kk, mask=mk, other=0.0)
            # mask before exp: above the diagonal exp(cs_t - cs_s) can overflow, and inf * 0 is NaN (the int32 CB there
            # is never written by the causal ChunkBMM: finite garbage, times the 0 decay)
            decay = tl.exp(tl.where(offs_m[:, None] >= kk[None, :], cs_m[:, None] - cs_k[None, :], float("-inf")))
            sc = cb.to(tl.float32) * (decay * (dt_k * csbs)[None, :])  # one (BM, BS) product fewer
            xk = tl.load(xp + (pid_c * T + kk)[:, None] * s_xl, mask=mk[:, None] & mp[None, :], other=0.0)
            yd = tl.dot(sc.to(ty), xk, yd, input_precision=DOT_PREC)
        y = yd

    _scan_epilogue(y, x_ptr, tl.full((BP,), 1.0, tl.float32), D_ptr, z_ptr, y_ptr, pid_b, hh, pos_m, offs_p, mm, mp,
                   s_xb, s_xl, s_xh, s_xp, s_Dh, s_Dp, s_zb, s_zl, s_zh, s_zp, s_yb, s_yl, s_yh, s_yp, HAS_D, HAS_Z)


def _blk(x: int, cap: int, lo: int = 16) -> int:
    """Tile side: a power of two in [lo, cap]. int8 tl.dot on sm_90 needs K >= 32 and M, N >= 16 (masks pad)."""
    return min(cap, pow2(x, lo))


CFG = configs.load("ssdi8")  # launch settings (configs/ssdi8.json, keys in docs/kernels.md)
F16MMA_MAX_K = 1024  # float16 products of int8 codes stay exact up to this many terms (``_int_dot``)


def _opts(c: dict) -> dict:
    """A CFG entry's launch options: warps, stages and, if set, a register cap (maxnreg, for the sweep)."""
    return dict(num_warps=c["num_warps"], num_stages=c["num_stages"], **({"maxnreg": c["maxnreg"]} if c.get("maxnreg")
                                                                           else {}))


def _launch_chunk_state(x, B_q, l, T, nc, mult=None, dt=None, cs=None, xs_scale=None, B_scale=None, state_scale=None):
    """x (b, l, h, p), B_q (b, l, g, n) (any strides) -> int8 chunk states (b, c, h, p, n); x is quantized in the
    kernel (from dt, cs and the scales) unless mult is given (x are then the X_scaled codes)."""
    b, _, h, p = x.shape
    g, n = B_q.shape[2], B_q.shape[3]
    out = torch.empty(b, nc, h, p, n, dtype=torch.int8, device=x.device)
    c = CFG["state"]
    BT, BP, BN = _blk(T, c["BT"], 32), _blk(p, c["BP"]), _blk(n, c["BN"])
    _chunk_state_q[(b * nc * h, cdiv(p, BP), cdiv(n, BN))](
        x, B_q, *((out,) * 5 if mult is not None else (dt, cs, xs_scale, B_scale, state_scale)),
        mult if mult is not None else out, out, l, h, p, n, T, nc, h // g,
        *x.stride(), *B_q.stride(), QUANT_X=mult is None, F16MMA=c["F16MMA"] and T <= F16MMA_MAX_K, BT=BT, BP=BP,
        BN=BN, **_opts(c))
    return out


def _launch_state_passing(chunk_q, decay, initial_q, T, decay_cs):
    b, nc, h, p, n = chunk_q.shape
    enter = torch.empty_like(chunk_q)
    final = torch.empty(b, h, p, n, dtype=torch.int8, device=chunk_q.device)
    BLOCK = min(1024, pow2(p * n))
    init = initial_q.contiguous() if initial_q is not None else final
    _state_passing_q[(b, h, cdiv(p * n, BLOCK))](
        chunk_q, decay, init, enter, final, nc, h, p * n, T,
        HAS_INIT=initial_q is not None, DECAY_CS=decay_cs, BLOCK=BLOCK, SHIFT=DECAY_BITS, num_warps=4)
    return enter, final


def _launch_chunk_bmm(C_q, B_q, l, T, nc, causal, dtype=torch.int32):
    """C_q, B_q (b, l, g, n) int8 -> (b, c, g, t, s) integers in dtype (int32, or float32: exact below 2^24)."""
    b, _, g, n = C_q.shape
    out = torch.empty(b, nc, g, T, T, dtype=dtype, device=C_q.device)
    c = CFG["bmm"]
    BM, BK = _blk(T, c["BM"]), _blk(n, c["BK"], 32)
    _chunk_bmm_q[(b * nc, g, cdiv(T, BM) ** 2)](
        C_q, B_q, out, l, T, nc, g, n, *C_q.stride(), *B_q.stride(), CAUSAL=causal,
        F16MMA=c["F16MMA"] and n <= F16MMA_MAX_K, BM=BM, BS=BM, BK=BK,
        **_opts(c))
    return out


def _launch_chunk_scan(C_q, enter, ss, y, l, T, nc, lut=None, cs=None, dt=None, C_scale=None, B_scale=None,
                       cb=None, x=None, D=None, z=None):
    """ChunkScan1 (+ ChunkScan2 when cb is given) into y (b, l, h, p) (float32, or x's dtype); see ``_chunk_scan_q``."""
    b, _, g, n = C_q.shape
    h, p = enter.shape[2], enter.shape[3]
    diag = cb is not None
    Dhp = None if D is None else (D[:, None].expand(h, p) if D.dim() == 1 else D)
    c = CFG["scan"]
    BM, BP, BK = _blk(T, c["BM"]), _blk(p, c["BP"]), _blk(n, c["BK"], 32)
    xx = x if x is not None else y
    _chunk_scan_q[(b * nc * h, cdiv(T, BM), cdiv(p, BP))](
        C_q, enter, lut if lut is not None else y, cs if cs is not None else y, dt if dt is not None else y,
        C_scale if C_scale is not None else y, B_scale if B_scale is not None else y, ss,
        cb if diag else y, xx, Dhp if Dhp is not None else y, z if z is not None else y, y,
        l, h, p, n, T, nc, g, h // g, *C_q.stride(), *xx.stride(), *(Dhp.stride() if Dhp is not None else (0, 0)),
        *(z.stride() if z is not None else (0, 0, 0, 0)), *y.stride(),
        LUT_IN=lut is not None, DIAG=diag, FACTORED=c["FACTORED"], HAS_D=D is not None, HAS_Z=z is not None,
        DOT_PREC=dot_precision(xx.dtype), F16MMA=c["F16MMA"] and n <= F16MMA_MAX_K, BM=BM, BP=BP, BK=BK, BS=BM,
        **_opts(c))
    return y


# ---------------------------------------------------------------------------------------------- the stages
def _flat(t):
    """(b, c, T, ...) -> (b, c·T, ...): the kernels index tokens by position."""
    return t.contiguous().flatten(1, 2)


def chunk_state_q(xs_q, B_q, mult):
    """xs_q (b, c, T, h, p) int8, B_q (b, c, T, g, n) int8, mult (h, p) -> int8 chunk states (b, c, h, p, n)."""
    b, c, T = xs_q.shape[:3]
    return _launch_chunk_state(_flat(xs_q), _flat(B_q), c * T, T, c, mult=mult.float().contiguous())


def state_passing_q(chunk_q, decay_q, initial_q=None):
    """As ``ops.ssd_int8.state_passing_int8``: (entering (b, c, h, p, n) int8, final (b, h, p, n) int8)."""
    return _launch_state_passing(chunk_q.contiguous(), decay_q.to(torch.int32).contiguous(), initial_q, 1, False)


def chunk_bmm_q(C_q, B_q):
    """C_q, B_q (b, c, T, g, n) int8 -> int32 (b, c, t, s, g), the full square (the reference's; a view of the
    kernel's (b, c, g, t, s))."""
    b, c, T = C_q.shape[:3]
    return _launch_chunk_bmm(_flat(C_q), _flat(B_q), c * T, T, c, causal=False).permute(0, 1, 3, 4, 2)


def chunk_scan_off_q(C_q, entering_q, lut, state_scale):
    """C_q (b, c, T, g, n), entering_q (b, c, h, p, n) int8, lut (b, c, T, h) = exp(Acs)·C_scale -> (b, c, T, h, p)."""
    b, c, T = C_q.shape[:3]
    h, p = entering_q.shape[2], entering_q.shape[3]
    y = torch.empty(b, c * T, h, p, dtype=torch.float32, device=C_q.device)
    _launch_chunk_scan(_flat(C_q), entering_q.contiguous(), state_scale.float().contiguous(), y, c * T, T, c,
                       lut=lut.float().contiguous())
    return y.reshape(b, c, T, h, p)


TRITON_STAGES = IntStages(chunk_state_q, state_passing_q, chunk_bmm_q, chunk_scan_off_q)


# ---------------------------------------------------------------------------------------------- the scan
def ssd_int8(x, dt, A, B_q, B_scale, C_q, C_scale, xs_scale, state_scale, chunk_size, D=None, z=None, dt_bias=None,
             dt_softplus=False, dt_limit=(0.0, math.inf), initial_states=None, return_final_states=False,
             x_scale=None, options: SSDi8Options = SSDi8Options()):
    """``ssmq.ops.ssd_int8.ssd_int8_ref`` in five launches (same signature; shapes as ``run_ssd_int8``).

    x, z (b, l, h, p); dt (b, l, h); A (h,); B_q, C_q (b, l, g, n) int8, B_scale, C_scale (g,); xs_scale,
    state_scale (h, p); D (h,) or (h, p); initial_states (b, h, p, n) int8. Returns y (b, l, h, p) in x's dtype
    (the reference returns float32: the float32 y is rounded once on the store, as the SSDi8 module's
    ``y.to(x.dtype)`` would, without writing and re-reading a float32 copy) and, if asked, the final int8 state
    (b, h, p, n). The ablation options run the reference glue on the Triton stages.
    """
    b, l, h, p = x.shape
    heads_per_group(h, B_q.shape[2])
    if options != SSDi8Options() or l == 0:
        out = run_ssd_int8(TRITON_STAGES, x, dt, A, B_q, B_scale, C_q, C_scale, xs_scale, state_scale, chunk_size,
                           D, z, dt_bias, dt_softplus, dt_limit, initial_states, return_final_states, x_scale, options)
        return (out[0].to(x.dtype), out[1]) if return_final_states else out.to(x.dtype)
    T, dev = chunk_size, x.device
    nc = cdiv(l, T)
    f32 = lambda t: t.float().contiguous()  # noqa: E731  (the (h,), (h, p), (g,) parameters: no-op on float32)
    dt_out = torch.empty((b, h, nc, T), device=dev, dtype=torch.float32)
    cs = torch.empty_like(dt_out)
    BH = 8 if T <= 256 else 2
    _chunk_cumsum[(b, nc, cdiv(h, BH))](
        dt, f32(A), f32(dt_bias) if dt_bias is not None else A, dt_out, cs, l, h, T, nc, float(dt_limit[0]),
        float(dt_limit[1]), *dt.stride(), HAS_DTB=dt_bias is not None, SOFTPLUS=dt_softplus,
        HAS_LIMIT=has_dt_limit(dt_limit), BT=pow2(T, 16), BH=BH, num_warps=4)

    s_state, B_scale = f32(state_scale), f32(B_scale)
    chunk_q = _launch_chunk_state(x, B_q, l, T, nc, dt=dt_out, cs=cs, xs_scale=f32(xs_scale), B_scale=B_scale,
                                  state_scale=s_state)
    enter, final = _launch_state_passing(chunk_q, cs, initial_states, T, True)
    cb = _launch_chunk_bmm(C_q, B_q, l, T, nc, causal=True, dtype=torch.float32)  # the scan's operand type
    y = torch.empty((b, l, h, p), device=dev, dtype=x.dtype)
    _launch_chunk_scan(C_q, enter, s_state, y, l, T, nc, cs=cs, dt=dt_out, C_scale=f32(C_scale), B_scale=B_scale,
                       cb=cb, x=x, D=D, z=z)
    return (y, final) if return_final_states else y
