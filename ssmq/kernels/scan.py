"""Triton selective scan (Mamba-1 prefill), parallel over (b, d) blocks, 4 time steps per iteration.

Same signature as ``ssmq.ops.selective_scan.selective_scan_ref``. Mamba-1's decay exp(Δ A) differs per
(channel, state), so there is no matmul form as in SSD: each (t, d, n) costs one exp2 and a few FMAs, and
the floor at b=1, d=5120, n=16 is the exp unit's rate, not memory. The earlier kernel ran one step per
iteration with n spread over 16 lanes and 2-warp programs: ~2 warps per SM, every step waiting on its
loads and a 4-level shuffle reduction. This one:
  * keeps the state as an (n, BD) tile, so each thread owns several n of one channel: the y reduction is
    mostly in-thread (n over 4 lanes, 2 shuffle levels) and b*d*n/4 threads give ~5 warps per SM;
  * advances 4 steps per iteration: the 4 steps' exps, Δ·u·B products and C loads are independent, only
    the h FMA chain is serial, so they overlap; u, Δ, z are read and y written as 4-step vectors;
  * loads the next iteration's inputs before this one's math (a one-iteration software pipeline).
Steps past the end get Δ = 0 (decay 1, no input), so the carried state is the true last state.

``quant_selective_scan`` runs the same kernel on int8 codes (Quamba), as
``ssmq.ops.quant_ssm.quant_selective_scan_ref``: with ``QUANT`` u, Δ, z load as codes (or floats) times a
per-channel scale and B, C as codes times a per-state scale, dequantized in registers; the rest is unchanged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ssmq.kernels import configs
from ssmq.kernels._common import cdiv, pow2, silu, softplus


@triton.jit
def _split4(v):
    """(BD, 4) -> four (BD,) columns."""
    a, b = tl.split(tl.reshape(v, (v.shape[0], 2, 2)))  # a: steps 0, 2; b: steps 1, 3
    v0, v2 = tl.split(a)
    v1, v3 = tl.split(b)
    return v0, v1, v2, v3


@triton.jit
def _join4(v0, v1, v2, v3):
    """Four (BD,) columns -> (BD, 4)."""
    v = tl.join(tl.join(v0, v1), tl.join(v2, v3))  # [d, j, k]: k picks (v0,v1)|(v2,v3), j within
    return tl.reshape(tl.permute(v, (0, 2, 1)), (v0.shape[0], 4))


@triton.jit
def _load4(u_p, dl_p, z_p, B_p, C_p, t0, l, md, mn, s_ul, s_dl, s_zl, s_Bl, s_Cl,
           HAS_Z: tl.constexpr, GROUPED: tl.constexpr, NEED_C: tl.constexpr):
    """Steps t0..t0+3: u, Δ, z as (BD, 4) tiles; B, C as four (BN, BD) | (BN,) columns."""
    offs_t = t0 + tl.arange(0, 4)
    m = md[:, None] & (offs_t < l)[None, :]
    u = tl.load(u_p[:, None] + offs_t[None, :] * s_ul, mask=m, other=0.0)
    dl = tl.load(dl_p[:, None] + offs_t[None, :] * s_dl, mask=m, other=0.0)
    if HAS_Z:
        z = tl.load(z_p[:, None] + offs_t[None, :] * s_zl, mask=m, other=0.0)
    else:
        z = u
    if GROUPED:
        mb = md[None, :] & mn[:, None]
    else:
        mb = mn
    B0 = tl.load(B_p + t0 * s_Bl, mask=mb & (t0 < l), other=0.0)
    B1 = tl.load(B_p + (t0 + 1) * s_Bl, mask=mb & (t0 + 1 < l), other=0.0)
    B2 = tl.load(B_p + (t0 + 2) * s_Bl, mask=mb & (t0 + 2 < l), other=0.0)
    B3 = tl.load(B_p + (t0 + 3) * s_Bl, mask=mb & (t0 + 3 < l), other=0.0)
    if NEED_C:
        C0 = tl.load(C_p + t0 * s_Cl, mask=mb & (t0 < l), other=0.0)
        C1 = tl.load(C_p + (t0 + 1) * s_Cl, mask=mb & (t0 + 1 < l), other=0.0)
        C2 = tl.load(C_p + (t0 + 2) * s_Cl, mask=mb & (t0 + 2 < l), other=0.0)
        C3 = tl.load(C_p + (t0 + 3) * s_Cl, mask=mb & (t0 + 3 < l), other=0.0)
    else:
        C0, C1, C2, C3 = B0, B1, B2, B3
    return u, dl, z, B0, B1, B2, B3, C0, C1, C2, C3


@triton.jit
def _bcast(v, scale, GROUPED: tl.constexpr):
    """B/C column as (BN, BD) | (BN, 1) float32, times its per-state scale (BN, 1) (ones for float B, C)."""
    if GROUPED:
        return v.to(tl.float32) * scale
    else:
        return v.to(tl.float32)[:, None] * scale


@triton.jit
def _scale(ptr, offs, mask, QUANT: tl.constexpr):
    """QUANT: the scales at offs (a per-channel or per-state table, float32); else ones, which change no value."""
    if QUANT:
        return tl.load(ptr + offs, mask=mask, other=0.0)
    else:
        return tl.full(offs.shape, 1.0, tl.float32)


@triton.jit
def _selective_scan(
    u_ptr, dl_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dbias_ptr, init_ptr, y_ptr, last_ptr, hseg_ptr, dsum_ptr,
    us_ptr, ds_ptr, zs_ptr, Bs_ptr, Cs_ptr,
    d, n, l, ch_per_group, seg_len, nseg,
    s_ub, s_ud, s_ul, s_db, s_dd, s_dl, s_Ad, s_An, s_Bb, s_Bg, s_Bn, s_Bl, s_Cb, s_Cg, s_Cn, s_Cl,
    s_zb, s_zd, s_zl, s_ib, s_id, s_in, s_yb, s_yd, s_yl,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DB: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_INIT: tl.constexpr, GROUPED: tl.constexpr, SEG_STATE: tl.constexpr, QUANT: tl.constexpr, BD: tl.constexpr,
    BN: tl.constexpr,
):
    """One time segment [s*seg_len, (s+1)*seg_len) of BD channels. SEG_STATE: the segment's own end state
    from a zero state, and its Σ Δ (so its decay is exp(A ΣΔ)); otherwise y, starting from the state
    entering the segment, folded from the earlier segments' end states (and the initial state).
    QUANT: us, ds, zs (d,) scales of u, Δ, z; Bs, Cs (n,) of B, C (float32; ones where an input is float)."""
    pid_b, pid_d, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_d = pid_d * BD + tl.arange(0, BD)
    offs_n = tl.arange(0, BN)
    md, mn = offs_d < d, offs_n < n
    m2 = mn[:, None] & md[None, :]  # state tiles are (n, d): n along registers and a few lanes
    # A pre-scaled by log2(e): the per-step decay is then one exp2
    A2 = tl.load(A_ptr + offs_n[:, None] * s_An + offs_d[None, :] * s_Ad, mask=m2, other=0.0).to(tl.float32)
    A2 = A2 * 1.4426950408889634
    if HAS_DB:
        db = tl.load(dbias_ptr + offs_d, mask=md, other=0.0).to(tl.float32)
    if HAS_D:
        Dv = tl.load(D_ptr + offs_d, mask=md, other=0.0).to(tl.float32)
    us, ds, zs = _scale(us_ptr, offs_d, md, QUANT), _scale(ds_ptr, offs_d, md, QUANT), _scale(zs_ptr, offs_d, md, QUANT)
    bs, cs = _scale(Bs_ptr, offs_n, mn, QUANT)[:, None], _scale(Cs_ptr, offs_n, mn, QUANT)[:, None]
    seg_off = (pid_b * nseg).to(tl.int64) * d
    if SEG_STATE:
        h = tl.zeros((BN, BD), dtype=tl.float32)
        dsum = tl.zeros((BD,), dtype=tl.float32)
    else:
        if HAS_INIT:
            h = tl.load(init_ptr + pid_b * s_ib + offs_n[:, None] * s_in + offs_d[None, :] * s_id, mask=m2, other=0.0)
            h = h.to(tl.float32)
        else:
            h = tl.zeros((BN, BD), dtype=tl.float32)
        for j in range(pid_s):  # the state entering this segment
            hj = tl.load(hseg_ptr + (seg_off + j * d + offs_d[None, :]) * n + offs_n[:, None], mask=m2, other=0.0)
            dj = tl.load(dsum_ptr + seg_off + j * d + offs_d, mask=md, other=0.0)
            h = tl.exp2(A2 * dj[None, :]) * h + hj
    t_lo = pid_s * seg_len
    t_hi = tl.minimum(l, t_lo + seg_len)

    u_p = u_ptr + pid_b * s_ub + offs_d * s_ud
    dl_p = dl_ptr + pid_b * s_db + offs_d * s_dd
    z_p = z_ptr + pid_b * s_zb + offs_d * s_zd
    y_p = y_ptr + pid_b * s_yb + offs_d * s_yd
    if GROUPED:
        grp = offs_d // ch_per_group
        B_p = B_ptr + pid_b * s_Bb + grp[None, :] * s_Bg + offs_n[:, None] * s_Bn
        C_p = C_ptr + pid_b * s_Cb + grp[None, :] * s_Cg + offs_n[:, None] * s_Cn
    else:
        B_p = B_ptr + pid_b * s_Bb + offs_n * s_Bn
        C_p = C_ptr + pid_b * s_Cb + offs_n * s_Cn
    LOAD_Z: tl.constexpr = HAS_Z and not SEG_STATE

    nxt = _load4(u_p, dl_p, z_p, B_p, C_p, t_lo, t_hi, md, mn, s_ul, s_dl, s_zl, s_Bl, s_Cl, LOAD_Z, GROUPED,
                 not SEG_STATE)
    for t0 in range(t_lo, t_hi, 4):
        u4, dl4, z4, B0, B1, B2, B3, C0, C1, C2, C3 = nxt
        nxt = _load4(u_p, dl_p, z_p, B_p, C_p, t0 + 4, t_hi, md, mn, s_ul, s_dl, s_zl, s_Bl, s_Cl, LOAD_Z,
                     GROUPED, not SEG_STATE)
        u4 = u4.to(tl.float32) * us[:, None]
        dl4 = dl4.to(tl.float32) * ds[:, None]
        if HAS_DB:
            dl4 += db[:, None]
        if SOFTPLUS:
            dl4 = softplus(dl4)
        dl4 = tl.where(((t0 + tl.arange(0, 4)) < t_hi)[None, :], dl4, 0.0)  # padded steps: decay 1, no input
        du4 = dl4 * u4
        dl0, dl1, dl2, dl3 = _split4(dl4)
        du0, du1, du2, du3 = _split4(du4)
        # the four steps' decays and inputs are independent: only the h chain below is serial
        a0 = tl.exp2(dl0[None, :] * A2)
        a1 = tl.exp2(dl1[None, :] * A2)
        a2 = tl.exp2(dl2[None, :] * A2)
        a3 = tl.exp2(dl3[None, :] * A2)
        if SEG_STATE:
            dsum += tl.sum(dl4, axis=1)
            h = a0 * h + du0[None, :] * _bcast(B0, bs, GROUPED)
            h = a1 * h + du1[None, :] * _bcast(B1, bs, GROUPED)
            h = a2 * h + du2[None, :] * _bcast(B2, bs, GROUPED)
            h = a3 * h + du3[None, :] * _bcast(B3, bs, GROUPED)
        else:
            h = a0 * h + du0[None, :] * _bcast(B0, bs, GROUPED)
            y0 = tl.sum(h * _bcast(C0, cs, GROUPED), axis=0)
            h = a1 * h + du1[None, :] * _bcast(B1, bs, GROUPED)
            y1 = tl.sum(h * _bcast(C1, cs, GROUPED), axis=0)
            h = a2 * h + du2[None, :] * _bcast(B2, bs, GROUPED)
            y2 = tl.sum(h * _bcast(C2, cs, GROUPED), axis=0)
            h = a3 * h + du3[None, :] * _bcast(B3, bs, GROUPED)
            y3 = tl.sum(h * _bcast(C3, cs, GROUPED), axis=0)
            y4 = _join4(y0, y1, y2, y3)
            if HAS_D:
                y4 += u4 * Dv[:, None]
            if HAS_Z:
                y4 *= silu(z4.to(tl.float32) * zs[:, None])
            offs_t = t0 + tl.arange(0, 4)
            tl.store(y_p[:, None] + offs_t[None, :] * s_yl, y4.to(y_ptr.dtype.element_ty),
                     mask=md[:, None] & (offs_t < t_hi)[None, :])
    if SEG_STATE:
        tl.store(hseg_ptr + (seg_off + pid_s * d + offs_d[None, :]) * n + offs_n[:, None], h, mask=m2)
        tl.store(dsum_ptr + seg_off + pid_s * d + offs_d, dsum, mask=md)
    elif pid_s == nseg - 1:
        tl.store(last_ptr + pid_b * d * n + offs_n[:, None] + offs_d[None, :] * n, h, mask=m2)


CFG = configs.load("scan")  # launch settings (configs/scan.json, keys in docs/kernels.md); NSEG: tests force a split


def selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                   initial_state=None, return_last_state=False):
    """Selective scan, as ``selective_scan_ref``.

    u, delta, z: (b, d, l); A: (d, n); B, C: (b, n, l) or grouped (b, g, n, l);
    D, delta_bias: (d,); initial_state: (b, d, n).
    Returns y (b, d, l) in u's dtype and, if asked, the last state (b, d, n) float32.
    """
    return _scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, return_last_state, None, u.dtype)


def quant_selective_scan(u_q, u_scale, dt_q, dt_scale, A, B_q, B_scale, C_q, C_scale, D=None, z_q=None, z_scale=None,
                         delta_bias=None, delta_softplus=True, initial_state=None, return_last_state=False,
                         out_dtype=None):
    """Selective scan on int8 codes, as ``quant_selective_scan_ref``.

    u_q, dt_q, z_q: (b, d, l) int8 with scales (d, 1) or () (dt, z: float with scale None); B_q, C_q: (b, n, l)
    int8 with scales (n, 1) or (); other arguments as ``selective_scan``. Returns y (b, d, l) in ``out_dtype``
    (float32 when None, as the reference) and, if asked, the last state (b, d, n) float32.
    """
    d, n = A.shape

    def table(s, size):  # a scale () | (size, 1) | None -> float32 (size,)
        one = torch.ones((), device=A.device) if s is None else s.float().to(A.device)
        return one.reshape(-1).expand(size).contiguous()

    scales = (table(u_scale, d), table(dt_scale, d), table(z_scale, d), table(B_scale, n), table(C_scale, n))
    return _scan(u_q, dt_q, A, B_q, C_q, D, z_q, delta_bias, delta_softplus, initial_state, return_last_state, scales,
                 out_dtype or torch.float32)


def _scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, return_last_state, scales, out_dtype):
    """The launches for float inputs (scales None) or codes with their (u, Δ, z, B, C) float32 scale tables."""
    b, d, l = u.shape
    n = A.shape[1]
    if B.dim() == 3:  # one group: a stride-0 group axis keeps a single kernel
        B, C = B.unsqueeze(1), C.unsqueeze(1)
    g = B.shape[1]
    y = torch.empty((b, d, l), device=u.device, dtype=out_dtype)
    last = torch.empty((b, d, n), device=u.device, dtype=torch.float32)
    BN = pow2(n, 4)
    BD, nw = CFG["BD"], CFG["num_warps"]
    BD = max(8, min(BD, 4096 // BN))  # cap the tile: each thread keeps a few (BN, BD) float32 tiles
    nw = max(1, min(nw, BD * BN // 128))
    if l == 0:
        last.copy_(initial_state if initial_state is not None else torch.zeros_like(last))
        return (y, last) if return_last_state else y
    # b*d/BD programs alone leave most of the GPU idle at small batch (each is a chain of l/4 dependent
    # iterations): split time into segments, run (1) each segment's end state from zero, in parallel,
    # then (2) every segment again from its entering state (folded from (1)) writing y.
    progs = b * cdiv(d, BD)
    target = CFG["SEGS"] * torch.cuda.get_device_properties(u.device).multi_processor_count if u.is_cuda else 0
    nseg = max(1, min(cdiv(target, progs), l // CFG["MIN_SEG"])) if CFG["SEGS"] else 1
    nseg = CFG.get("NSEG") or nseg  # tests force a split
    seg_len = cdiv(cdiv(l, nseg), 4) * 4
    nseg = cdiv(l, seg_len)
    hseg = torch.empty((b, nseg, d, n), device=u.device, dtype=torch.float32)
    dsum = torch.empty((b, nseg, d), device=u.device, dtype=torch.float32)
    args = (u, delta, A, B, C, D if D is not None else u, z if z is not None else u,
            delta_bias if delta_bias is not None else u, initial_state if initial_state is not None else u, y, last,
            hseg, dsum, *(scales or (A,) * 5), d, n, l, d // g, seg_len, nseg,
            *u.stride(), *delta.stride(), *A.stride(), *B.stride(), *C.stride(),
            *(z.stride() if z is not None else (0, 0, 0)),
            *(initial_state.stride() if initial_state is not None else (0, 0, 0)), *y.stride())
    flags = dict(HAS_D=D is not None, HAS_Z=z is not None, HAS_DB=delta_bias is not None, SOFTPLUS=delta_softplus,
                 HAS_INIT=initial_state is not None, GROUPED=g > 1, QUANT=scales is not None, BD=BD, BN=BN,
                 num_warps=nw)
    if nseg > 1:  # the last segment's own end state is never needed
        _selective_scan[(b, cdiv(d, BD), nseg - 1)](*args, SEG_STATE=True, **flags)
    _selective_scan[(b, cdiv(d, BD), nseg)](*args, SEG_STATE=False, **flags)
    return (y, last) if return_last_state else y
