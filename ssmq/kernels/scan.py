"""Triton selective scan (Mamba-1 prefill): the recurrence run in time order, parallel over (b, d) blocks.

Same signature as ``ssmq.ops.selective_scan.selective_scan_ref``. A program owns
BD channels of one row and keeps their (BD, n) state in registers for the whole
sequence. Mamba-1's decay exp(Δ A) differs per (channel, state), so there is no
matmul form as in SSD; each step costs BD*n exps and FMAs. Each step's inputs
are loaded one step ahead so their latency overlaps the previous step's math;
reading one column of (b, d, l) at a time still coalesces in L1, since the 64
steps of a 128-byte line are consumed by consecutive iterations.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ssmq.kernels._common import pow2, silu, softplus


@triton.jit
def _load_step(u_ptr, dl_ptr, B_ptr, C_ptr, t, l, md, mn, s_ul, s_dl, s_Bl, s_Cl, GROUPED: tl.constexpr):
    """Column t of u, Δ (BD,) and of B, C ((BD, BN) grouped, else (BN,)); zeros past the end."""
    ok = t < l
    u = tl.load(u_ptr + t * s_ul, mask=md & ok, other=0.0).to(tl.float32)
    dl = tl.load(dl_ptr + t * s_dl, mask=md & ok, other=0.0).to(tl.float32)
    if GROUPED:
        mbc = md[:, None] & mn[None, :] & ok
    else:
        mbc = mn & ok
    Bt = tl.load(B_ptr + t * s_Bl, mask=mbc, other=0.0).to(tl.float32)
    Ct = tl.load(C_ptr + t * s_Cl, mask=mbc, other=0.0).to(tl.float32)
    return u, dl, Bt, Ct


@triton.jit
def _selective_scan(
    u_ptr, dl_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dbias_ptr, init_ptr, y_ptr, last_ptr,
    d, n, l, ch_per_group,
    s_ub, s_ud, s_ul, s_db, s_dd, s_dl, s_Ad, s_An, s_Bb, s_Bg, s_Bn, s_Bl, s_Cb, s_Cg, s_Cn, s_Cl,
    s_zb, s_zd, s_zl, s_ib, s_id, s_in, s_yb, s_yd, s_yl,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DB: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_INIT: tl.constexpr, GROUPED: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr,
):
    pid_b, pid_d = tl.program_id(0), tl.program_id(1)
    offs_d = pid_d * BD + tl.arange(0, BD)
    offs_n = tl.arange(0, BN)
    md, mn = offs_d < d, offs_n < n
    m2 = md[:, None] & mn[None, :]
    # A pre-scaled by log2(e): the per-step decay is then one exp2
    A2 = tl.load(A_ptr + offs_d[:, None] * s_Ad + offs_n[None, :] * s_An, mask=m2, other=0.0).to(tl.float32) * 1.4426950408889634
    if HAS_DB:
        db = tl.load(dbias_ptr + offs_d, mask=md, other=0.0).to(tl.float32)
    if HAS_D:
        Dv = tl.load(D_ptr + offs_d, mask=md, other=0.0).to(tl.float32)
    if HAS_INIT:
        h = tl.load(init_ptr + pid_b * s_ib + offs_d[:, None] * s_id + offs_n[None, :] * s_in, mask=m2, other=0.0)
        h = h.to(tl.float32)
    else:
        h = tl.zeros((BD, BN), dtype=tl.float32)

    u_p = u_ptr + pid_b * s_ub + offs_d * s_ud
    dl_p = dl_ptr + pid_b * s_db + offs_d * s_dd
    if GROUPED:
        grp = offs_d // ch_per_group
        B_p = B_ptr + pid_b * s_Bb + grp[:, None] * s_Bg + offs_n[None, :] * s_Bn
        C_p = C_ptr + pid_b * s_Cb + grp[:, None] * s_Cg + offs_n[None, :] * s_Cn
    else:
        B_p = B_ptr + pid_b * s_Bb + offs_n * s_Bn
        C_p = C_ptr + pid_b * s_Cb + offs_n * s_Cn
    z_p = z_ptr + pid_b * s_zb + offs_d * s_zd
    y_p = y_ptr + pid_b * s_yb + offs_d * s_yd

    u, dl, Bt, Ct = _load_step(u_p, dl_p, B_p, C_p, 0, l, md, mn, s_ul, s_dl, s_Bl, s_Cl, GROUPED)
    for t in range(l):
        u_n, dl_n, B_n, C_n = _load_step(u_p, dl_p, B_p, C_p, t + 1, l, md, mn, s_ul, s_dl, s_Bl, s_Cl, GROUPED)
        if HAS_Z:
            zt = tl.load(z_p + t * s_zl, mask=md, other=0.0).to(tl.float32)
        if HAS_DB:
            dl += db
        if SOFTPLUS:
            dl = softplus(dl)
        if GROUPED:
            h = tl.exp2(dl[:, None] * A2) * h + (dl * u)[:, None] * Bt
            y = tl.sum(h * Ct, axis=1)
        else:
            h = tl.exp2(dl[:, None] * A2) * h + (dl * u)[:, None] * Bt[None, :]
            y = tl.sum(h * Ct[None, :], axis=1)
        if HAS_D:
            y += u * Dv
        if HAS_Z:
            y *= silu(zt)
        tl.store(y_p + t * s_yl, y.to(y_ptr.dtype.element_ty), mask=md)
        u, dl, Bt, Ct = u_n, dl_n, B_n, C_n
    tl.store(last_ptr + pid_b * d * n + offs_d[:, None] * n + offs_n[None, :], h, mask=m2)


def selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                   initial_state=None, return_last_state=False):
    """Selective scan, as ``selective_scan_ref``.

    u, delta, z: (b, d, l); A: (d, n); B, C: (b, n, l) or grouped (b, g, n, l);
    D, delta_bias: (d,); initial_state: (b, d, n).
    Returns y (b, d, l) in u's dtype and, if asked, the last state (b, d, n) float32.
    """
    b, d, l = u.shape
    n = A.shape[1]
    if B.dim() == 3:  # one group: a stride-0 group axis keeps a single kernel
        B, C = B.unsqueeze(1), C.unsqueeze(1)
    g = B.shape[1]
    y = torch.empty((b, d, l), device=u.device, dtype=u.dtype)
    last = torch.empty((b, d, n), device=u.device, dtype=torch.float32)
    BN = pow2(n, 2)
    # enough programs to cover the SMs twice before the tile grows
    BD = 32 if b * d >= 32 * 264 else 16
    if BD * BN > 2048:
        BD = max(1, 2048 // BN)
    _selective_scan[(b, triton.cdiv(d, BD))](
        u, delta, A, B, C, D if D is not None else u, z if z is not None else u,
        delta_bias if delta_bias is not None else u, initial_state if initial_state is not None else u, y, last,
        d, n, l, d // g,
        *u.stride(), *delta.stride(), *A.stride(), *B.stride(), *C.stride(),
        *(z.stride() if z is not None else (0, 0, 0)),
        *(initial_state.stride() if initial_state is not None else (0, 0, 0)), *y.stride(),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_DB=delta_bias is not None, SOFTPLUS=delta_softplus,
        HAS_INIT=initial_state is not None, GROUPED=g > 1, BD=BD, BN=BN, num_warps=max(1, min(4, BD * BN // 256)),
    )
    return (y, last) if return_last_state else y
