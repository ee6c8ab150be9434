"""Triton selective state update (one decode token) for Mamba-1 and Mamba-2.

Same signature as ``ssmq.ops.state_update.selective_state_update_ref``. Mamba-1
is run as Mamba-2 with one head (h = 1, p = d). One program owns a (BP, n) tile
of one row's state: read once, advanced, written back in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ssmq.kernels._common import pow2, silu, sm_count, softplus
from ssmq.ops.layout import heads_per_group


@triton.jit
def _state_update(
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dtb_ptr, idx_ptr, out_ptr,
    p, n, heads_per_group,
    s_sb, s_sh, s_sp, s_sn,
    s_xb, s_xh, s_xp, s_dtb, s_dth, s_dtp, s_Ah, s_Ap, s_An,
    s_Bb, s_Bg, s_Bn, s_Cb, s_Cg, s_Cn, s_Dh, s_Dp, s_zb, s_zh, s_zp, s_dbh, s_dbp,
    s_ob, s_oh, s_op,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DTB: tl.constexpr, HAS_IDX: tl.constexpr,
    SOFTPLUS: tl.constexpr, TIE_HDIM: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
):
    pid_b, pid_h, pid_p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_p = pid_p * BP + tl.arange(0, BP)
    offs_n = tl.arange(0, BN)
    mp, mn = offs_p < p, offs_n < n
    m2 = mp[:, None] & mn[None, :]
    if HAS_IDX:
        slot = tl.load(idx_ptr + pid_b).to(tl.int64)
    else:
        slot = pid_b.to(tl.int64)
    grp = pid_h // heads_per_group

    s_ptrs = state_ptr + slot * s_sb + pid_h * s_sh + offs_p[:, None] * s_sp + offs_n[None, :] * s_sn
    hs = tl.load(s_ptrs, mask=m2, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + pid_b * s_xb + pid_h * s_xh + offs_p * s_xp, mask=mp, other=0.0).to(tl.float32)
    Bv = tl.load(B_ptr + pid_b * s_Bb + grp * s_Bg + offs_n * s_Bn, mask=mn, other=0.0).to(tl.float32)
    Cv = tl.load(C_ptr + pid_b * s_Cb + grp * s_Cg + offs_n * s_Cn, mask=mn, other=0.0).to(tl.float32)
    if TIE_HDIM:
        # Mamba-2: dt and A are one scalar per head, so the decay is one exp, not BP*BN
        dt = tl.load(dt_ptr + pid_b * s_dtb + pid_h * s_dth).to(tl.float32)
        if HAS_DTB:
            dt += tl.load(dtb_ptr + pid_h * s_dbh).to(tl.float32)
        if SOFTPLUS:
            dt = softplus(dt)
        dA = tl.exp(dt * tl.load(A_ptr + pid_h * s_Ah).to(tl.float32))
        hs = hs * dA + (x * dt)[:, None] * Bv[None, :]
    else:
        dt = tl.load(dt_ptr + pid_b * s_dtb + pid_h * s_dth + offs_p * s_dtp, mask=mp, other=0.0).to(tl.float32)
        if HAS_DTB:
            dt += tl.load(dtb_ptr + pid_h * s_dbh + offs_p * s_dbp, mask=mp, other=0.0).to(tl.float32)
        if SOFTPLUS:
            dt = softplus(dt)
        A = tl.load(A_ptr + pid_h * s_Ah + offs_p[:, None] * s_Ap + offs_n[None, :] * s_An,
                    mask=m2, other=0.0).to(tl.float32)
        hs = hs * tl.exp(dt[:, None] * A) + (x * dt)[:, None] * Bv[None, :]
    tl.store(s_ptrs, hs.to(state_ptr.dtype.element_ty), mask=m2)

    y = tl.sum(hs * Cv[None, :], axis=1)
    if HAS_D:
        y += x * tl.load(D_ptr + pid_h * s_Dh + offs_p * s_Dp, mask=mp, other=0.0).to(tl.float32)
    if HAS_Z:
        y *= silu(tl.load(z_ptr + pid_b * s_zb + pid_h * s_zh + offs_p * s_zp, mask=mp, other=0.0).to(tl.float32))
    tl.store(out_ptr + pid_b * s_ob + pid_h * s_oh + offs_p * s_op, y.to(out_ptr.dtype.element_ty), mask=mp)


def _strides(t, k):
    return t.stride() if t is not None else (0,) * k


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                           state_batch_indices=None):
    """Advance the state one token, as ``selective_state_update_ref``; updates ``state`` in place.

    Mamba-1 | Mamba-2: state (s, d, n) | (s, h, p, n); x, dt, z (b, d) | (b, h, p);
    A (d, n) | (h, p, n); B, C (b, n) | (b, g, n); D, dt_bias (d,) | (h, p).
    Returns y shaped like x, in x's dtype.
    """
    multihead = state.dim() == 4
    if not multihead:  # views with h = 1: no copies, the kernel writes the caller's state
        state = state.unsqueeze(1)
        x, dt, z = (t.unsqueeze(1) if t is not None else None for t in (x, dt, z))
        A, D, dt_bias = (t.unsqueeze(0) if t is not None else None for t in (A, D, dt_bias))
        B, C = B.unsqueeze(1), C.unsqueeze(1)
    b, h, p = x.shape
    n, g = state.shape[-1], B.shape[1]
    rep = heads_per_group(h, g)
    out = torch.empty((b, h, p), device=x.device, dtype=x.dtype)
    tie = (dt.stride(2) == 0 and A.stride(1) == 0 and A.stride(2) == 0
           and (dt_bias is None or dt_bias.stride(1) == 0))
    BN = pow2(n, 16)
    BP = max(4, min(pow2(p), 4096 // BN))  # ~4K state elements a program: enough loads in flight
    # ...but at small batch, at least two programs per SM: Mamba-1 at batch 1 is one "head" of
    # p = d_inner channels, which 4K-element tiles would spread over only d_inner / 256 SMs
    while BP > 16 and b * h * triton.cdiv(p, BP) < 2 * sm_count(x.device):
        BP //= 2
    grid = (b, h, triton.cdiv(p, BP))
    _state_update[grid](
        state, x, dt, A, B, C, D if D is not None else x, z if z is not None else x,
        dt_bias if dt_bias is not None else x,
        state_batch_indices if state_batch_indices is not None else x, out,
        p, n, rep,
        *state.stride(), *x.stride(), *dt.stride(), *A.stride(), *B.stride(), *C.stride(),
        *_strides(D, 2), *_strides(z, 3), *_strides(dt_bias, 2), *out.stride(),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_DTB=dt_bias is not None,
        HAS_IDX=state_batch_indices is not None, SOFTPLUS=dt_softplus, TIE_HDIM=tie,
        BP=BP, BN=BN, num_warps=4,
    )
    return out if multihead else out.squeeze(1)
