"""Triton selective state update (one decode token) for Mamba-1 and Mamba-2, float or int8 state.

``selective_state_update`` has the signature of ``ssmq.ops.state_update.selective_state_update_ref``,
``quant_state_update`` that of ``ssmq.ops.quant_ssm.quant_state_update_ref`` (Quamba / Quamba2: x, B, C as
int8 codes + scales, the state as int8 codes + (G, n) scales and a channel -> group index, or + dynamic row
scales, ``RowScales``: one per (slot, channel), rewritten with the codes from the new row's absmax). Both launch the
same kernel: Mamba-1 is run as Mamba-2 with one head (h = 1, p = d). One program owns a (BP, n) tile of
one row's state: read once (int8 codes dequantized in registers), advanced in float32, written back in
place (re-quantized for an int8 state), so a decode step touches only the served rows, in one launch.
``replay_state_update`` (ReplaySSM) is the same kernel on a checkpoint and a ring of the steps since: Mamba-2
folds the ring into y without materializing the state, which it writes only when the ring is full.
"""

from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl

from ssmq.kernels import configs
from ssmq.errors import SSMQError
from ssmq.kernels._common import (_MAGIC_RNE, _PACK_PTX, _UNPACK_PTX, cdiv, gdc_enter, int8_to_float, pdl_args, pow2,
    rne_int8, rne_int8_of_product, rne_int8_sat, silu, sm_count, softplus)
from ssmq.ops.layout import heads_per_group
from ssmq.ops.quant_ssm import RowScales


CFG = configs.load("state_update")  # launch settings (configs/state_update.json, keys in docs/kernels.md)


@triton.jit
def _advance(hs, x, dt, Bv, A, TIE_HDIM: tl.constexpr):
    """One recurrent step of a (BP, BN) state tile: hs * exp(Δ·A) + (Δ·x) B (Δ, A scalars per head when TIE_HDIM,
    else Δ (BP,) and A (BP, BN)); the plain step and every replayed ring entry."""
    if TIE_HDIM:
        dA = tl.exp(dt * A)
    else:
        dA = tl.exp(dt[:, None] * A)
    return hs * dA + (x * dt)[:, None] * Bv[None, :]


@triton.jit
def _replay(hs, A, rx, rdt, rB, cnt, s_rxr, s_rdtr, s_rdtp, s_rBr, offs_p, mp, mn, TIE_HDIM: tl.constexpr,
            RING_STAGES: tl.constexpr):
    """The tile advanced through a ring's cnt entries (rx, rB: the tile's rows of entry 0; rdt: its Δ), a step each."""
    for j in tl.range(0, cnt, num_stages=RING_STAGES):
        xj = tl.load(rx + j * s_rxr, mask=mp, other=0.0).to(tl.float32)
        Bj = tl.load(rB + j * s_rBr, mask=mn, other=0.0).to(tl.float32)
        if TIE_HDIM:
            dtj = tl.load(rdt + j * s_rdtr)
        else:
            dtj = tl.load(rdt + j * s_rdtr + offs_p * s_rdtp, mask=mp, other=0.0)
        hs = _advance(hs, xj, dtj, Bj, A, TIE_HDIM)
    return hs


@triton.jit
def _vec(ptr, scale_ptr, offs, s, s_scale, m, Q: tl.constexpr):
    """B or C of the group at ``offs`` (a row of n or a chunk of it), float32 (int8 codes times their scales)."""
    v = tl.load(ptr + offs * s, mask=m, other=0.0).to(tl.float32)
    if Q:
        v = v * tl.load(scale_ptr + offs * s_scale, mask=m, other=0.0)
    return v


@triton.jit
def _ring_fold(rx, rdt, s_rxr, s_rdtr, offs_r, mr, mp, x, dt, A, bc, bt):
    """Mamba-2's state after the ring's entries (mr) and the token is decay · ckpt + Σ_j w_j x_j B_jᵀ (the token's
    w is Δ); given B_j · C (bc) and the token's B · C (bt), returns decay and y less its checkpoint term."""
    Xr = tl.load(rx[None, :] + offs_r[:, None] * s_rxr, mask=mr[:, None] & mp[None, :], other=0.0)  # (RP, BP)
    dtr = tl.load(rdt + offs_r * s_rdtr, mask=mr, other=0.0)  # (RP,), 0 past the ring's entries
    w = dtr * tl.exp(A * (tl.cumsum(dtr, axis=0, reverse=True) - dtr + dt))  # Δ_j exp(A Σ_{i>j} Δ_i), token included
    decay = tl.exp(A * (tl.sum(dtr, axis=0) + dt))
    return decay, tl.sum(Xr.to(tl.float32) * (w * bc)[:, None], axis=0) + dt * bt * x


@triton.jit
def _state_scales(ss_ptr, row, offs_n, s_ssg, s_ssn, m2):
    """The (BP, BN) scales of an int8 state tile: each channel's row of the (G, n) table (a few KB: L1/L2 hits)."""
    return tl.load(ss_ptr + row[:, None] * s_ssg + offs_n[None, :] * s_ssn, mask=m2, other=1.0)


@triton.jit
def _write_rows(s_ptrs, rs_rows, hs, mp, m2, PTX_CODES: tl.constexpr):
    """Store a float32 state tile (whole rows: BNC = BN) as int8 codes with dynamic row scales, as
    ``quantize_state_rows_ref``: scale = amax / 127 a row, codes rne(hs · (127 / amax)). Two exact divisions a row;
    a value costs one fused multiply-add rounding (rne_int8_of_product) — no table to gather, no reciprocal a value,
    and no clamps: |hs · 127 / amax| <= 127 (the product rounded once lands on 127 at most)."""
    amax = tl.max(tl.abs(tl.where(m2, hs, 0.0)), axis=1)
    inv = tl.where(amax > 0, tl.math.div_rn(tl.full(amax.shape, 127.0, tl.float32), tl.maximum(amax, 1e-30)), 0.0)
    tl.store(rs_rows, tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32)), mask=mp)
    tl.store(s_ptrs, rne_int8_of_product(hs, inv[:, None], PTX_CODES, CLAMP=False), mask=m2)


@triton.jit
def _rcp_approx(x):
    """1 / x by one MUFU.RCP (rcp.approx.ftz: <= 1 ulp; the scales are normal floats, never denormal)."""
    return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def _load_state(s_ptrs, sc, m2, Q_STATE: tl.constexpr, PTX_CODES: tl.constexpr):
    """A float32 state tile: int8 codes times their scales sc (PTX_CODES: converted by bit assembly), or the float
    state as it is."""
    if Q_STATE:
        return int8_to_float(tl.load(s_ptrs, mask=m2, other=0), PTX_CODES) * sc
    else:
        return tl.load(s_ptrs, mask=m2, other=0.0).to(tl.float32)


@triton.jit
def _write_state(s_ptrs, hs, sc, m2, Q_STATE: tl.constexpr, FAST_RCP: tl.constexpr, PTX_CODES: tl.constexpr,
                 RCP_TABLE: tl.constexpr):
    """Store a float32 state tile: re-quantized with its scales sc (RCP_TABLE: sc holds their reciprocals) for an
    int8 state, else cast."""
    if Q_STATE:
        # not div_rn: the exact division costs ~15 instructions a state value and would make a large-batch step
        # compute-bound. '/' (div.full) or, FAST_RCP, rcp.approx and a multiply: the codes can then
        # differ from the reference's only where hs / sc is within 2 ulp of a rounding boundary: as rare as, and no
        # different from, what exp and fused multiply-adds already do to the float32 state (tests allow one step).
        # PTX_CODES: that multiply fused with the rounding (rne_int8_of_product) and the codes packed by prmt.
        # RCP_TABLE: the reciprocals read (L1 hits, as the scales) and the product rounded by one saturating
        # conversion a value (rne_int8_sat): no MUFU, no clamps.
        if RCP_TABLE:
            tl.store(s_ptrs, rne_int8_sat(hs * sc, PTX_CODES), mask=m2)
        elif FAST_RCP:
            tl.store(s_ptrs, rne_int8_of_product(hs, _rcp_approx(sc), PTX_CODES), mask=m2)
        else:
            tl.store(s_ptrs, rne_int8_of_product(hs / sc, 1.0, PTX_CODES), mask=m2)
    else:
        tl.store(s_ptrs, hs.to(s_ptrs.dtype.element_ty), mask=m2)


@triton.jit
def _state_update(
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dtb_ptr, idx_ptr, out_ptr,
    ss_ptr, ssi_ptr, sidx_ptr, xs_ptr, Bs_ptr, Cs_ptr, rs_ptr,
    p, n,
    s_sb, s_sh, s_sp, s_sn,
    s_xb, s_xh, s_xp, s_dtb, s_dth, s_dtp, s_Ah, s_Ap, s_An,
    s_Bb, s_Bg, s_Bn, s_Cb, s_Cg, s_Cn, s_Dh, s_Dp, s_zb, s_zh, s_zp, s_dbh, s_dbp,
    s_ob, s_oh, s_op,
    s_ssg, s_ssn, s_sidx, s_rsb, s_rsh, s_rsp,
    s_xsb, s_xsh, s_xsp, s_Bsb, s_Bsg, s_Bsn, s_Csb, s_Csg, s_Csn,
    rx_ptr, rdt_ptr, rB_ptr, cnt_ptr, done_ptr, ring_cap, progs_per_slot,
    s_rxs, s_rxr, s_rxh, s_rxp, s_rdts, s_rdtr, s_rdth, s_rdtp, s_rBs, s_rBr, s_rBg, s_rBn,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DTB: tl.constexpr, HAS_IDX: tl.constexpr,
    SOFTPLUS: tl.constexpr, TIE_HDIM: tl.constexpr,
    Q_STATE: tl.constexpr, ROWS: tl.constexpr, HAS_SIDX: tl.constexpr, Q_X: tl.constexpr, Q_B: tl.constexpr,
    Q_C: tl.constexpr,
    REPLAY: tl.constexpr, RING_STAGES: tl.constexpr, RP: tl.constexpr, BNC: tl.constexpr,
    FOLD_STAGES: tl.constexpr, FAST_RCP: tl.constexpr, PTX_CODES: tl.constexpr, RCP_TABLE: tl.constexpr,
    EVEN: tl.constexpr,
    HPG: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, USE_GDC: tl.constexpr = False,
):
    gdc_enter(USE_GDC)
    pid_b, pid_h, pid_p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_p = pid_p * BP + tl.arange(0, BP)
    offs_n = tl.arange(0, BN)
    if EVEN:  # the tile inside the state (p % BP == 0, n == BN): all-true masks, which the compiler drops
        mp, mn = tl.full((BP,), 1, tl.int1), tl.full((BN,), 1, tl.int1)
    else:
        mp, mn = offs_p < p, offs_n < n
    if HAS_IDX:
        slot = tl.load(idx_ptr + pid_b).to(tl.int64)
    else:
        slot = pid_b.to(tl.int64)
    grp = pid_h // HPG  # a constexpr divisor: a multiply and a shift, not a ~20-instruction integer division

    s_rows = state_ptr + slot * s_sb + pid_h * s_sh + offs_p[:, None] * s_sp  # (BP, 1): the tile's rows
    # row scales on Mamba-2's plain step: each row's scale folded into the head's decay, one multiply a row, so the
    # codes' values go straight into the step (code · (scale · exp(Δ·A)) + (Δ·x) B: _advance with the scale applied
    # first, one multiply a value fewer; ncu: this kernel is issue-bound)
    FOLD: tl.constexpr = Q_STATE and ROWS and TIE_HDIM and not REPLAY
    row, rsc = offs_p, 1.0
    if Q_STATE and ROWS:  # dynamic row scales: one per channel row of the tile, (BP, 1) against its values
        rs_rows = rs_ptr + slot * s_rsb + pid_h * s_rsh + offs_p * s_rsp
        rsc = tl.load(rs_rows, mask=mp, other=0.0)[:, None]
    elif Q_STATE:
        # the (G, n) table row of each channel: index[channel] (sort-and-cluster groups), or the channel itself
        # (s_ssg = 0 when G = 1)
        chan = pid_h * p + offs_p
        if HAS_SIDX:
            row = tl.load(sidx_ptr + chan * s_sidx, mask=mp, other=0).to(tl.int64)
        else:
            row = chan.to(tl.int64)
    x = tl.load(x_ptr + pid_b * s_xb + pid_h * s_xh + offs_p * s_xp, mask=mp, other=0.0).to(tl.float32)
    if Q_X:
        x = x * tl.load(xs_ptr + pid_b * s_xsb + pid_h * s_xsh + offs_p * s_xsp, mask=mp, other=0.0)
    B_row, Bs_row = B_ptr + pid_b * s_Bb + grp * s_Bg, Bs_ptr + pid_b * s_Bsb + grp * s_Bsg
    C_row, Cs_row = C_ptr + pid_b * s_Cb + grp * s_Cg, Cs_ptr + pid_b * s_Csb + grp * s_Csg
    if TIE_HDIM:
        # Mamba-2: dt and A are one scalar per head, so the decay is one exp, not BP*BN
        A = tl.load(A_ptr + pid_h * s_Ah).to(tl.float32)
        dt = tl.load(dt_ptr + pid_b * s_dtb + pid_h * s_dth).to(tl.float32)
        if HAS_DTB:
            dt += tl.load(dtb_ptr + pid_h * s_dbh).to(tl.float32)
    else:  # (A (BP, n) is read by column chunk, below)
        dt = tl.load(dt_ptr + pid_b * s_dtb + pid_h * s_dth + offs_p * s_dtp, mask=mp, other=0.0).to(tl.float32)
        if HAS_DTB:
            dt += tl.load(dtb_ptr + pid_h * s_dbh + offs_p * s_dbp, mask=mp, other=0.0).to(tl.float32)
    if SOFTPLUS:
        dt = softplus(dt)

    if REPLAY:
        # ReplaySSM: the state holds the slot's checkpoint; the ring, the cnt steps taken since (x, discretized Δ, B)
        cnt = tl.load(cnt_ptr + slot)
        rx = rx_ptr + slot * s_rxs + pid_h * s_rxh + offs_p * s_rxp
        rdt = rdt_ptr + slot * s_rdts + pid_h * s_rdth
        rB_row = rB_ptr + slot * s_rBs + grp * s_rBg
        rB = rB_row + offs_n * s_rBn
    if REPLAY and TIE_HDIM and cnt < ring_cap:  # (constexprs first: a static branch for the other kernels)
        # Mamba-2, the ring not full: Δ·A is one scalar a step, so the entries need no replaying. With the token
        # as entry cnt (w = Δ), the current state is one decayed rank-(cnt + 1) update of the checkpoint,
        #     state = decay · ckpt + Σ_j w_j x_j B_jᵀ,   decay = exp(A Σ_j Δ_j),   w_j = Δ_j exp(A Σ_{i>j} Δ_i),
        # so y = C · state needs no state at all: decay (ckpt · C) + Σ_j w_j (B_j · C) x_j, from one load of the
        # ring's rows: one multiply-add a state value, where replaying costs two a value an entry (up to K - 1 of
        # them, each behind a serial load of the entry). Only a step that writes the checkpoint materializes it.
        # The checkpoint is read in column chunks, software-pipelined (FOLD_STAGES: cp.async into shared memory),
        # so that the loads in flight are not bounded by registers: they are all this branch keeps of the tile.
        offs_r = tl.arange(0, RP)
        mr = offs_r < cnt
        yc = tl.zeros((BP,), tl.float32)  # ckpt · C
        bc = tl.zeros((RP,), tl.float32)  # B_j · C
        bt = 0.0  # B · C of the token
        for c in tl.range(0, BN, BNC, num_stages=FOLD_STAGES):
            offs_c = c + tl.arange(0, BNC)
            mc = mn if BNC == BN else offs_c < n
            mc2 = mp[:, None] & mc[None, :]
            Cc = _vec(C_row, Cs_row, offs_c, s_Cn, s_Csn, mc, Q_C)
            if Q_STATE and ROWS:
                ck = _load_state(s_rows + offs_c[None, :] * s_sn, rsc, mc2, Q_STATE, PTX_CODES)
            elif Q_STATE:
                ck = _load_state(s_rows + offs_c[None, :] * s_sn, _state_scales(ss_ptr, row, offs_c, s_ssg, s_ssn, mc2),
                                 mc2, Q_STATE, PTX_CODES)
            else:
                ck = _load_state(s_rows + offs_c[None, :] * s_sn, 1.0, mc2, Q_STATE, PTX_CODES)
            Brc = tl.load(rB_row + offs_r[:, None] * s_rBr + offs_c[None, :] * s_rBn, mask=mr[:, None] & mc[None, :],
                          other=0.0)
            yc += tl.sum(ck * Cc[None, :], axis=1)
            bc += tl.sum(Brc.to(tl.float32) * Cc[None, :], axis=1)
            bt += tl.sum(_vec(B_row, Bs_row, offs_c, s_Bn, s_Bsn, mc, Q_B) * Cc, axis=0)
        decay, y = _ring_fold(rx, rdt, s_rxr, s_rdtr, offs_r, mr, mp, x, dt, A, bc, bt)
        y += decay * yc
    else:
        # The tile is stepped and written in column chunks (BNC: one for the plain step by default), so that the
        # registers hold one chunk of it (occupancy)
        y = tl.zeros((BP,), tl.float32)
        if REPLAY and TIE_HDIM:
            # Mamba-2, the ring full: y folded as above, from the ring's rows loaded at once, which also brings them
            # into L1 for the replay below: its entry-by-entry loads (chunks x entries) then hit L1, not L2 in turn
            offs_r = tl.arange(0, RP)
            mr = offs_r < cnt
            Cv = _vec(C_row, Cs_row, offs_n, s_Cn, s_Csn, mn, Q_C)
            Br = tl.load(rB_row + offs_r[:, None] * s_rBr + offs_n[None, :] * s_rBn, mask=mr[:, None] & mn[None, :],
                         other=0.0)
            decay, y = _ring_fold(rx, rdt, s_rxr, s_rdtr, offs_r, mr, mp, x, dt, A,
                                  tl.sum(Br.to(tl.float32) * Cv[None, :], axis=1),
                                  tl.sum(_vec(B_row, Bs_row, offs_n, s_Bn, s_Bsn, mn, Q_B) * Cv, axis=0))
        for c in tl.range(0, BN, BNC, num_stages=1):
            offs_c = c + tl.arange(0, BNC)
            mc = mn if BNC == BN else offs_c < n
            mc2 = mp[:, None] & mc[None, :]
            s_ptrs = s_rows + offs_c[None, :] * s_sn
            if Q_STATE and ROWS:
                sc = rsc
            elif Q_STATE:
                sc = _state_scales(ss_ptr, row, offs_c, s_ssg, s_ssn, mc2)
            else:
                sc = 1.0
            if FOLD:
                hs = int8_to_float(tl.load(s_ptrs, mask=mc2, other=0), PTX_CODES) * (sc * tl.exp(dt * A))
            else:
                hs = _load_state(s_ptrs, sc, mc2, Q_STATE, PTX_CODES)
            if not REPLAY or TIE_HDIM:  # C read with the state (its load overlaps; int8 plain: 96 registers, not 126)
                Cc = _vec(C_row, Cs_row, offs_c, s_Cn, s_Csn, mc, Q_C)
            if REPLAY and TIE_HDIM:  # y's checkpoint term, from the chunk before its replay
                y += decay * tl.sum(hs * Cc[None, :], axis=1)
            if TIE_HDIM:
                Ac = A
            else:
                Ac = tl.load(A_ptr + pid_h * s_Ah + offs_p[:, None] * s_Ap + offs_c[None, :] * s_An,
                             mask=mc2, other=0.0).to(tl.float32)
            if REPLAY:  # the entries replayed one by one, in registers (Mamba-2: only when the ring is full, 1 in K)
                hs = _replay(hs, Ac, rx, rdt, rB_row + offs_c * s_rBn, cnt, s_rxr, s_rdtr, s_rdtp, s_rBr, offs_p, mp,
                             mc, TIE_HDIM, RING_STAGES)
            if FOLD:  # (decayed above)
                hs += (x * dt)[:, None] * _vec(B_row, Bs_row, offs_c, s_Bn, s_Bsn, mc, Q_B)[None, :]
            else:
                hs = _advance(hs, x, dt, _vec(B_row, Bs_row, offs_c, s_Bn, s_Bsn, mc, Q_B), Ac, TIE_HDIM)
            if REPLAY:
                if cnt == ring_cap:  # the ring full: the state becomes the checkpoint
                    if Q_STATE and ROWS:
                        _write_rows(s_ptrs, rs_rows, hs, mp, mc2, PTX_CODES)
                    else:
                        if Q_STATE:  # the scales read again, not kept live through the replay (registers: occupancy)
                            sc = _state_scales(ssi_ptr if RCP_TABLE else ss_ptr, row, offs_c, s_ssg, s_ssn, mc2)
                        _write_state(s_ptrs, hs, sc, mc2, Q_STATE, FAST_RCP, PTX_CODES, RCP_TABLE)
            elif Q_STATE and ROWS:
                _write_rows(s_ptrs, rs_rows, hs, mp, mc2, PTX_CODES)
            else:
                if Q_STATE and RCP_TABLE:
                    sc = _state_scales(ssi_ptr, row, offs_c, s_ssg, s_ssn, mc2)
                _write_state(s_ptrs, hs, sc, mc2, Q_STATE, FAST_RCP, PTX_CODES, RCP_TABLE)
            if not (REPLAY and TIE_HDIM):  # y reads the float32 state, before its re-quantization (as the reference)
                if REPLAY:  # C read after the replay: not live through the ring loop
                    Cc = _vec(C_row, Cs_row, offs_c, s_Cn, s_Csn, mc, Q_C)
                y += tl.sum(hs * Cc[None, :], axis=1)
    if HAS_D:
        y += x * tl.load(D_ptr + pid_h * s_Dh + offs_p * s_Dp, mask=mp, other=0.0).to(tl.float32)
    if HAS_Z:
        y *= silu(tl.load(z_ptr + pid_b * s_zb + pid_h * s_zh + offs_p * s_zp, mask=mp, other=0.0).to(tl.float32))
    tl.store(out_ptr + pid_b * s_ob + pid_h * s_oh + offs_p * s_op, y.to(out_ptr.dtype.element_ty), mask=mp)

    if REPLAY:
        # the step's inputs join the ring unless it was full (then its state was written as the checkpoint above)
        # (the flags as vectors over the tile: Triton's interpreter refuses a scalar bool inside a mask)
        cnt_p, cnt_n = offs_p * 0 + cnt, offs_n * 0 + cnt
        append_p, append_n = cnt_p < ring_cap, cnt_n < ring_cap
        tl.store(rx + cnt * s_rxr, x.to(rx_ptr.dtype.element_ty), mask=mp & append_p)
        if TIE_HDIM:  # one Δ per head: the tile holding channel 0 writes it
            tl.store(rdt + cnt * s_rdtr + offs_p * 0, dt + offs_p * 0.0, mask=append_p & (offs_p == 0))
        else:
            tl.store(rdt + cnt * s_rdtr + offs_p * s_rdtp, dt, mask=mp & append_p)
        # one program writes its group's B: the first tile of the group's first head
        m_B = mn & append_n & ((offs_n * 0 + pid_p * BP + pid_h % HPG) == 0)
        Bv = _vec(B_row, Bs_row, offs_n, s_Bn, s_Bsn, m_B, Q_B)
        tl.store(rB + cnt * s_rBr, Bv.to(rB_ptr.dtype.element_ty), mask=m_B)

        # advance the slot's ring count once every program of the slot has read it: each program tallies itself
        # (atomic, acq_rel: its read of cnt happened before), the last one writes the new count and zeroes the tally
        # for the next launch. In the kernel rather than as torch ops after it: those would be ~5 launches a layer.
        done = tl.atomic_add(done_ptr + slot, 1)
        last = ((offs_p * 0 + done) == progs_per_slot - 1) & (offs_p == pid_p * BP)  # one lane of the last program
        new_cnt = tl.where(cnt_p == ring_cap, 0, cnt_p + 1)
        tl.store(cnt_ptr + slot + offs_p * 0, new_cnt, mask=last)
        tl.store(done_ptr + slot + offs_p * 0, offs_p * 0, mask=last)


# The plain Mamba-2 step (Δ and A one scalar a head, no checkpoint ring) with several tiles a program: ``_step``. A
# program walks NT consecutive (head, row block) tiles of one batch row: Δ, A and the slot read once a tile, B and C
# once a program when its tiles share a group, optionally the next tile's state loaded before the current one is
# computed (prefetch), an int8 state with row scales read and written as int32 words of 4 codes (words: a prefetched
# tile stays 4 codes a register). Settings by state format: CFG["step"] (float, int8_rows, int8_table).
STEP_CFG = CFG["step"]


@triton.jit
def _unwords(w, PTX: tl.constexpr):
    """(R, W) int32 words of 4 int8 codes each (code 4j + k in byte k, little-endian) -> (R, 4 W) float32 codes.
    PTX: by bit assembly (``ssmq.kernels._common.int8_to_float``), 4 outputs a word; else by shifts."""
    if PTX:
        f0, f1, f2, f3 = tl.inline_asm_elementwise(_UNPACK_PTX, "=r,=r,=r,=r,r", [w],
                                                   dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
                                                   is_pure=True, pack=1)
    else:
        f0, f1, f2, f3 = (w << 24) >> 24, (w << 16) >> 24, (w << 8) >> 24, w >> 24
    v = tl.join(tl.join(f0, f2), tl.join(f1, f3))  # [j, k, m] = code 4j + 2k + m
    v = tl.reshape(v, (w.shape[0], 4 * w.shape[1]))
    if PTX:
        return v - 8388736.0
    else:
        return v.to(tl.float32)


@triton.jit
def _words(v, r, PTX: tl.constexpr, CLAMP: tl.constexpr):
    """int8 codes of v · r (rounded half to even; CLAMP: clamped to [-128, 127], else |v · r| <= 127), (R, N) ->
    (R, N / 4) int32 words as ``_unwords`` reads them."""
    R: tl.constexpr = v.shape[0]
    W: tl.constexpr = v.shape[1] // 4
    if PTX:
        t = tl.fma(v, r, _MAGIC_RNE)  # the code in the low byte (rne_int8_of_product)
        if CLAMP:
            t = tl.minimum(tl.maximum(t, _MAGIC_RNE - 128.0), _MAGIC_RNE + 127.0)
    else:
        t = rne_int8(v * r).to(tl.int32) & 0xFF
    a, b = tl.split(tl.reshape(t, (R, W, 2, 2)))
    t0, t2 = tl.split(a)
    t1, t3 = tl.split(b)
    if PTX:
        return tl.inline_asm_elementwise(_PACK_PTX, "=r,r,r,r,r", [t0, t1, t2, t3], dtype=tl.int32, is_pure=True,
                                         pack=1)
    else:
        return t0 | (t1 << 8) | (t2 << 16) | (t3 << 24)


@triton.jit
def _step_raw(base, t, offs_r, offs_n, p, n, s_sh, s_sp, s_sn, TP: tl.constexpr, BP: tl.constexpr,
              EVEN: tl.constexpr):
    """Tile t's state as stored (codes or the float dtype): (BP, BN)."""
    rows = (t % TP) * BP + offs_r
    ptrs = base + (t // TP) * s_sh + rows[:, None] * s_sp + offs_n[None, :] * s_sn
    if EVEN:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=(rows < p)[:, None] & (offs_n < n)[None, :], other=0)


@triton.jit
def _step_tile(
    raw, t, pid_b, slot, base, x_ptr, dt_ptr, A_ptr, Bv, Cv, D_ptr, z_ptr, dtb_ptr, out_ptr,
    ss_ptr, sidx_ptr, xs_ptr, rs_ptr, offs_r, offs_n, offs_s, p, n,
    s_sh, s_sp, s_sn, s_xb, s_xh, s_xp, s_dtb, s_dth, s_Ah, s_Dh, s_Dp,
    s_zb, s_zh, s_zp, s_dbh, s_ob, s_oh, s_op, s_ssg, s_ssn, s_sidx, s_rsb, s_rsh, s_rsp,
    s_xsb, s_xsh, s_xsp,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DTB: tl.constexpr, SOFTPLUS: tl.constexpr,
    Q_STATE: tl.constexpr, ROWS: tl.constexpr, HAS_SIDX: tl.constexpr, Q_X: tl.constexpr,
    FAST_RCP: tl.constexpr, PTX_CODES: tl.constexpr, EVEN: tl.constexpr, WORDS: tl.constexpr, TP: tl.constexpr,
    BP: tl.constexpr,
):
    """Advance tile t (its stored values ``raw``; its group's B and C, float32 (BN,)), write it back and write its
    rows of y."""
    head = t // TP
    rows = (t % TP) * BP + offs_r
    if EVEN:
        mp, mn = tl.full((BP,), 1, tl.int1), tl.full(offs_n.shape, 1, tl.int1)
    else:
        mp, mn = rows < p, offs_n < n
    m2 = mp[:, None] & mn[None, :]
    A = tl.load(A_ptr + head * s_Ah).to(tl.float32)
    dt = tl.load(dt_ptr + pid_b * s_dtb + head * s_dth).to(tl.float32)
    if HAS_DTB:
        dt += tl.load(dtb_ptr + head * s_dbh).to(tl.float32)
    if SOFTPLUS:
        dt = softplus(dt)
    dA = tl.exp(dt * A)  # one exp a head
    x = tl.load(x_ptr + pid_b * s_xb + head * s_xh + rows * s_xp, mask=mp, other=0.0).to(tl.float32)
    if Q_X:
        x = x * tl.load(xs_ptr + pid_b * s_xsb + head * s_xsh + rows * s_xsp, mask=mp, other=0.0)
    dBx = (x * dt)[:, None] * Bv[None, :]
    s_ptrs = base + head * s_sh + rows[:, None] * s_sp + offs_s[None, :] * s_sn
    if Q_STATE:
        if WORDS:  # (EVEN)
            codes = _unwords(raw, PTX_CODES)
        else:
            codes = int8_to_float(raw, PTX_CODES)
    if Q_STATE and ROWS:
        # each row's scale folded into the head's decay: code · (scale · exp(Δ·A)) + (Δ·x) B
        rs_rows = rs_ptr + slot * s_rsb + head * s_rsh + rows * s_rsp
        rsc = tl.load(rs_rows, mask=mp, other=0.0)
        hs = codes * (rsc * dA)[:, None] + dBx
        if WORDS:  # as _write_rows
            amax = tl.max(tl.abs(hs), axis=1)
            inv = tl.where(amax > 0, tl.math.div_rn(tl.full(amax.shape, 127.0, tl.float32), tl.maximum(amax, 1e-30)),
                           0.0)
            tl.store(rs_rows, tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32)))
            tl.store(s_ptrs, _words(hs, inv[:, None], PTX_CODES, False))
        else:
            _write_rows(s_ptrs, rs_rows, hs, mp, m2, PTX_CODES)
    elif Q_STATE:
        chan = head * p + rows
        if HAS_SIDX:
            row = tl.load(sidx_ptr + chan * s_sidx, mask=mp, other=0).to(tl.int64)
        else:
            row = chan.to(tl.int64)
        sc = _state_scales(ss_ptr, row, offs_n, s_ssg, s_ssn, m2)
        hs = codes * sc * dA + dBx
        if WORDS:  # as _write_state
            if FAST_RCP:
                tl.store(s_ptrs, _words(hs, _rcp_approx(sc), PTX_CODES, True))
            else:
                tl.store(s_ptrs, _words(hs / sc, 1.0, PTX_CODES, True))
        else:
            _write_state(s_ptrs, hs, sc, m2, Q_STATE, FAST_RCP, PTX_CODES, False)
    else:
        hs = raw.to(tl.float32) * dA + dBx
        if EVEN:
            tl.store(s_ptrs, hs.to(s_ptrs.dtype.element_ty))
        else:
            tl.store(s_ptrs, hs.to(s_ptrs.dtype.element_ty), mask=m2)
    y = tl.sum(hs * Cv[None, :], axis=1)
    if HAS_D:
        y += x * tl.load(D_ptr + head * s_Dh + rows * s_Dp, mask=mp, other=0.0).to(tl.float32)
    if HAS_Z:
        y *= silu(tl.load(z_ptr + pid_b * s_zb + head * s_zh + rows * s_zp, mask=mp, other=0.0).to(tl.float32))
    tl.store(out_ptr + pid_b * s_ob + head * s_oh + rows * s_op, y.to(out_ptr.dtype.element_ty), mask=mp)


@triton.jit
def _step(
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, dtb_ptr, idx_ptr, out_ptr,
    ss_ptr, sidx_ptr, xs_ptr, Bs_ptr, Cs_ptr, rs_ptr,
    p, n, NT,
    s_sb, s_sh, s_sp, s_sn, s_xb, s_xh, s_xp, s_dtb, s_dth, s_Ah,
    s_Bb, s_Bg, s_Bn, s_Cb, s_Cg, s_Cn, s_Dh, s_Dp, s_zb, s_zh, s_zp, s_dbh, s_ob, s_oh, s_op,
    s_ssg, s_ssn, s_sidx, s_rsb, s_rsh, s_rsp, s_xsb, s_xsh, s_xsp, s_Bsb, s_Bsg, s_Bsn, s_Csb, s_Csg, s_Csn,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DTB: tl.constexpr, HAS_IDX: tl.constexpr,
    SOFTPLUS: tl.constexpr, Q_STATE: tl.constexpr, ROWS: tl.constexpr, HAS_SIDX: tl.constexpr,
    Q_X: tl.constexpr, Q_B: tl.constexpr, Q_C: tl.constexpr, FAST_RCP: tl.constexpr, PTX_CODES: tl.constexpr,
    EVEN: tl.constexpr, WORDS: tl.constexpr, PREFETCH: tl.constexpr, ONE_GROUP: tl.constexpr, HPG: tl.constexpr,
    TP: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, TILES_FIRST: tl.constexpr, USE_GDC: tl.constexpr = False,
):
    """Grid (b, tiles // NT) (TILES_FIRST: (tiles // NT, b)): program (row, j) steps tiles j·NT .. j·NT + NT - 1 of
    the row (tile t: head t // TP, channels (t % TP)·BP .. + BP of it, all n states)."""
    gdc_enter(USE_GDC)
    if TILES_FIRST:  # grid (tiles // NT, b): programs launched together walk one slot's state in address order
        pid_b = tl.program_id(1)
        t0 = tl.program_id(0) * NT
    else:
        pid_b = tl.program_id(0)
        t0 = tl.program_id(1) * NT
    if HAS_IDX:
        slot = tl.load(idx_ptr + pid_b).to(tl.int64)
    else:
        slot = pid_b.to(tl.int64)
    base = state_ptr + slot * s_sb
    offs_r, offs_n = tl.arange(0, BP), tl.arange(0, BN)
    mn = offs_n < n
    if WORDS:  # an int8 state read and written as int32 words of 4 codes (s_sh, s_sp in words)
        base = base.to(tl.pointer_type(tl.int32))
        offs_s = tl.arange(0, BN // 4)
    else:
        offs_s = offs_n
    # B and C of the group: once a program when its tiles share one (ONE_GROUP), else a tile
    grp = (t0 // TP) // HPG
    Bv = _vec(B_ptr + pid_b * s_Bb + grp * s_Bg, Bs_ptr + pid_b * s_Bsb + grp * s_Bsg, offs_n, s_Bn, s_Bsn, mn, Q_B)
    Cv = _vec(C_ptr + pid_b * s_Cb + grp * s_Cg, Cs_ptr + pid_b * s_Csb + grp * s_Csg, offs_n, s_Cn, s_Csn, mn, Q_C)
    if PREFETCH:
        cur = _step_raw(base, t0, offs_r, offs_s, p, n, s_sh, s_sp, s_sn, TP, BP, EVEN)
        for i in range(1, NT):
            nxt = _step_raw(base, t0 + i, offs_r, offs_s, p, n, s_sh, s_sp, s_sn, TP, BP, EVEN)
            if not ONE_GROUP:
                grp = ((t0 + i - 1) // TP) // HPG
                Bv = _vec(B_ptr + pid_b * s_Bb + grp * s_Bg, Bs_ptr + pid_b * s_Bsb + grp * s_Bsg, offs_n, s_Bn,
                          s_Bsn, mn, Q_B)
                Cv = _vec(C_ptr + pid_b * s_Cb + grp * s_Cg, Cs_ptr + pid_b * s_Csb + grp * s_Csg, offs_n, s_Cn,
                          s_Csn, mn, Q_C)
            _step_tile(cur, t0 + i - 1, pid_b, slot, base, x_ptr, dt_ptr, A_ptr, Bv, Cv, D_ptr, z_ptr, dtb_ptr, out_ptr,
                       ss_ptr, sidx_ptr, xs_ptr, rs_ptr, offs_r, offs_n, offs_s, p, n, s_sh, s_sp, s_sn, s_xb, s_xh,
                       s_xp,
                       s_dtb, s_dth, s_Ah, s_Dh, s_Dp, s_zb, s_zh, s_zp, s_dbh, s_ob, s_oh, s_op, s_ssg, s_ssn,
                       s_sidx, s_rsb, s_rsh, s_rsp, s_xsb, s_xsh, s_xsp, HAS_D, HAS_Z, HAS_DTB, SOFTPLUS, Q_STATE,
                       ROWS, HAS_SIDX, Q_X, FAST_RCP, PTX_CODES, EVEN, WORDS, TP, BP)
            cur = nxt
        if not ONE_GROUP:
            grp = ((t0 + NT - 1) // TP) // HPG
            Bv = _vec(B_ptr + pid_b * s_Bb + grp * s_Bg, Bs_ptr + pid_b * s_Bsb + grp * s_Bsg, offs_n, s_Bn, s_Bsn,
                      mn, Q_B)
            Cv = _vec(C_ptr + pid_b * s_Cb + grp * s_Cg, Cs_ptr + pid_b * s_Csb + grp * s_Csg, offs_n, s_Cn, s_Csn,
                      mn, Q_C)
        _step_tile(cur, t0 + NT - 1, pid_b, slot, base, x_ptr, dt_ptr, A_ptr, Bv, Cv, D_ptr, z_ptr, dtb_ptr, out_ptr,
                       ss_ptr, sidx_ptr, xs_ptr, rs_ptr, offs_r, offs_n, offs_s, p, n, s_sh, s_sp, s_sn, s_xb, s_xh,
                       s_xp,
                       s_dtb, s_dth, s_Ah, s_Dh, s_Dp, s_zb, s_zh, s_zp, s_dbh, s_ob, s_oh, s_op, s_ssg, s_ssn,
                       s_sidx, s_rsb, s_rsh, s_rsp, s_xsb, s_xsh, s_xsp, HAS_D, HAS_Z, HAS_DTB, SOFTPLUS, Q_STATE,
                       ROWS, HAS_SIDX, Q_X, FAST_RCP, PTX_CODES, EVEN, WORDS, TP, BP)
    else:
        for i in range(0, NT):
            raw = _step_raw(base, t0 + i, offs_r, offs_s, p, n, s_sh, s_sp, s_sn, TP, BP, EVEN)
            if not ONE_GROUP:
                grp = ((t0 + i) // TP) // HPG
                Bv = _vec(B_ptr + pid_b * s_Bb + grp * s_Bg, Bs_ptr + pid_b * s_Bsb + grp * s_Bsg, offs_n, s_Bn,
                          s_Bsn, mn, Q_B)
                Cv = _vec(C_ptr + pid_b * s_Cb + grp * s_Cg, Cs_ptr + pid_b * s_Csb + grp * s_Csg, offs_n, s_Cn,
                          s_Csn, mn, Q_C)
            _step_tile(raw, t0 + i, pid_b, slot, base, x_ptr, dt_ptr, A_ptr, Bv, Cv, D_ptr, z_ptr, dtb_ptr, out_ptr,
                       ss_ptr, sidx_ptr, xs_ptr, rs_ptr, offs_r, offs_n, offs_s, p, n, s_sh, s_sp, s_sn, s_xb, s_xh,
                       s_xp,
                       s_dtb, s_dth, s_Ah, s_Dh, s_Dp, s_zb, s_zh, s_zp, s_dbh, s_ob, s_oh, s_op, s_ssg, s_ssn,
                       s_sidx, s_rsb, s_rsh, s_rsp, s_xsb, s_xsh, s_xsp, HAS_D, HAS_Z, HAS_DTB, SOFTPLUS, Q_STATE,
                       ROWS, HAS_SIDX, Q_X, FAST_RCP, PTX_CODES, EVEN, WORDS, TP, BP)


def _step_grid(b: int, h: int, p: int, n: int, fmt: str, device) -> tuple[dict, int, int, int]:
    """(settings, BP, TP, NT) of ``_step`` for b rows of h heads of (p, n) states: STEP_CFG's tile, halved (down to
    16 rows) while the grid would give an SM fewer than two tiles (small batches), and NT tiles a program."""
    cfg = STEP_CFG[fmt]
    sms = sm_count(device)
    BP = max(1, min(pow2(p), cfg["tile"] // pow2(n, 16)))
    while BP > 16 and b * h * cdiv(p, BP) < 2 * sms:
        BP //= 2
    TP = cdiv(p, BP)
    tiles = h * TP
    nt = max(1, min(cfg["max_tiles"], round(b * tiles / (cfg["programs_per_sm"] * sms))))
    while tiles % nt:
        nt -= 1
    return cfg, BP, TP, nt


def _launch_step(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices, ss, sidx, s_ssg, rs,
                 xs, Bs, Cs, out, rep, step):
    """The plain Mamba-2 step through ``_step`` (arguments as ``_launch`` has checked and shaped them; ``step``:
    ``_step_grid``'s)."""
    b, h, p = x.shape
    n = state.shape[-1]
    cfg, BP, TP, NT = step
    BN = pow2(n, 16)
    even = p % BP == 0 and n == BN
    st = state.stride()
    words = (cfg.get("words", False) and state.dtype == torch.int8 and even and st[3] == 1
             and all(v % 4 == 0 for v in st[:3]) and state.data_ptr() % 4 == 0)
    if words:  # the slot stride in bytes (applied before the cast), the others in int32 words
        st = (st[0], st[1] // 4, st[2] // 4, 1)
    dummy = out
    order = cfg.get("tiles_first", False)
    _step[(h * TP // NT, b) if order else (b, h * TP // NT)](
        state, x, dt, A, B, C, D if D is not None else x, z if z is not None else x,
        dt_bias if dt_bias is not None else x,
        state_batch_indices if state_batch_indices is not None else x, out,
        ss if ss is not None else dummy, sidx if sidx is not None else dummy,
        xs if xs is not None else dummy, Bs if Bs is not None else dummy, Cs if Cs is not None else dummy,
        rs if rs is not None else dummy,
        p, n, NT,
        *st, x.stride(0), x.stride(1), x.stride(2), dt.stride(0), dt.stride(1), A.stride(0),
        *B.stride(), *C.stride(), *_strides(D, 2), *_strides(z, 3), _strides(dt_bias, 2)[0], *out.stride(),
        s_ssg, ss.stride(1) if ss is not None else 0, sidx.stride(0) if sidx is not None else 0, *_strides(rs, 3),
        *_strides(xs, 3), *_strides(Bs, 3), *_strides(Cs, 3),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_DTB=dt_bias is not None,
        HAS_IDX=state_batch_indices is not None, SOFTPLUS=dt_softplus,
        Q_STATE=ss is not None or rs is not None, ROWS=rs is not None, HAS_SIDX=sidx is not None,
        Q_X=xs is not None, Q_B=Bs is not None, Q_C=Cs is not None,
        FAST_RCP=CFG["fast_rcp"] and state.is_cuda, PTX_CODES=CFG["ptx_codes"] and state.is_cuda,
        EVEN=even, WORDS=words, PREFETCH=cfg["prefetch"] and NT > 1,
        ONE_GROUP=(rep * TP) % NT == 0, HPG=rep, TP=TP, BP=BP, BN=BN, TILES_FIRST=order,
        num_warps=cfg["num_warps"], **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}), **pdl_args(x),
    )
    return out


def _strides(t, k):
    return t.stride() if t is not None else (0,) * k


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                           state_batch_indices=None):
    """Advance the state one token, as ``selective_state_update_ref``; updates ``state`` in place.

    Mamba-1 | Mamba-2: state (s, d, n) | (s, h, p, n); x, dt, z (b, d) | (b, h, p);
    A (d, n) | (h, p, n); B, C (b, n) | (b, g, n); D, dt_bias (d,) | (h, p).
    Returns y shaped like x, in x's dtype.
    """
    return _launch(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices)


def quant_state_update(state_q, state_scale, state_index, x_q, x_scale, dt, A, B_q, B_scale, C_q, C_scale,
                       D=None, z=None, dt_bias=None, dt_softplus=True, state_batch_indices=None, out_dtype=None):
    """One decode step on int8 codes, as ``quant_state_update_ref``; updates ``state_q`` in place.

    state_q: (s, d, n) | (s, h, p, n) int8 with state_scale (G, n) and state_index (d,) (None: G = 1 or G = d),
    or with state_scale ``RowScales`` (s, d) | (s, h, p) (rewritten in place with the codes), or a float state with
    state_scale None. x_q: (b, d) | (b, h, p), B_q, C_q: (b, n) | (b, g, n), int8 codes
    with scales broadcastable against them, or float with scale None. dt, z, A, D, dt_bias as
    ``selective_state_update``. Returns y (b, d) | (b, h, p): ``out_dtype``, else float32 for int8 x, else x's dtype
    (written so by the kernel: no cast after).
    """
    return _launch(state_q, x_q, dt, A, B_q, C_q, D, z, dt_bias, dt_softplus, state_batch_indices,
                   state_scale, state_index, x_scale, B_scale, C_scale, out_dtype)


def replay_state_update(ckpt, state_scale, state_index, ring, x_q, x_scale, dt, A, B_q, B_scale, C_q, C_scale,
                        D=None, z=None, dt_bias=None, dt_softplus=True, state_batch_indices=None, out_dtype=None):
    """A checkpointed (ReplaySSM) decode step, as ``ssmq.ops.replay_ssm.replay_state_update_ref``: the same kernel
    loads the checkpoint tile, replays the ring in registers, applies the token, writes y, and then writes the state
    (re-quantized for int8) only where the ring is full, else appends x, Δ, B to the ring; the last program of each
    slot advances its count. Rows must name distinct slots (as every decode step; a CUDA graph's padding rows share
    the scratch slot, whose ring is then garbage, as its state).
    """
    return _launch(ckpt, x_q, dt, A, B_q, C_q, D, z, dt_bias, dt_softplus, state_batch_indices,
                   state_scale, state_index, x_scale, B_scale, C_scale, out_dtype, ring)


def _ring_args(ring, state, h, p, g, n, tie, progs_per_slot):
    """Pointers, capacity, programs per slot and strides of a ``StateRing`` for the kernel (checked against the
    state's layout)."""
    if ring is None:
        return (None, None, None, None, None, 0, 0) + (0,) * 12
    slots, R = ring.x.shape[:2]
    if (slots != state.shape[0] or tuple(ring.x.shape[2:]) != (h, p) or tuple(ring.B.shape[2:]) != (g, n)
            or ring.dt.shape[-1] not in (1, p) or ring.count.shape != (slots,) or ring.done.shape != (slots,)):
        raise SSMQError(f"checkpoint ring x {tuple(ring.x.shape)}, B {tuple(ring.B.shape)}, dt {tuple(ring.dt.shape)} "
                        f"does not match the state ({slots} slots, h={h}, p={p}, g={g}, n={n})")
    if ring.dt.shape[-1] == 1 and not tie:
        raise SSMQError("a ring with one Δ per head needs Δ and A per head (Mamba-2: expanded over p, stride 0)")
    return (ring.x, ring.dt, ring.B, ring.count, ring.done, R, progs_per_slot, *ring.x.stride(), *ring.dt.stride(),
            *ring.B.stride())


def _input_scale(name, t, scale):
    """A code tensor's scale as a float32 view broadcast to the tensor's shape (strides 0: no copy)."""
    if scale is None:
        if t.dtype == torch.int8:
            raise SSMQError(f"{name} is int8 codes but has no scale")
        return None
    try:
        return scale.to(device=t.device, dtype=torch.float32).expand(t.shape)
    except RuntimeError:
        raise SSMQError(f"{name}_scale {tuple(scale.shape)} does not broadcast against {name} "
                        f"{tuple(t.shape)}") from None


def _state_table(state, scale, index, channels):
    """Check an int8 state's (G, n) table and index (d,); returns (table, index, row stride of the table)."""
    if isinstance(scale, RowScales):
        return None, None, 0
    if state.dtype != torch.int8:
        if scale is not None:
            raise SSMQError(f"state scales given for a {state.dtype} state (int8 codes expected)")
        return None, None, 0
    if scale is None or scale.dim() != 2 or scale.shape[1] != state.shape[-1]:
        raise SSMQError(f"an int8 state needs a (G, n = {state.shape[-1]}) scale table, got "
                        f"{None if scale is None else tuple(scale.shape)}")
    G = scale.shape[0]
    if index is not None and tuple(index.shape) != (channels,):
        raise SSMQError(f"state_index must be ({channels},) (channel -> scale group), got {tuple(index.shape)}")
    if index is None and G not in (1, channels):
        raise SSMQError(f"{G} state scale groups need a state_index (channel -> group)")
    scale = scale.float()  # a model cast with .half() casts the table too; the kernel reads float32
    return scale, index, scale.stride(0) if G > 1 else 0


def _row_scales(state, scale, index):
    """An int8 state's dynamic row scales (s, d) | (s, h, p) float32 (checked), or None for a table / float state."""
    if not isinstance(scale, RowScales):
        return None
    rs = scale.scale
    if state.dtype != torch.int8 or index is not None:
        raise SSMQError(f"row scales are for an int8 state without a state_index, got a {state.dtype} state"
                        + (" and an index" if index is not None else ""))
    if tuple(rs.shape) != tuple(state.shape[:-1]) or rs.dtype != torch.float32 or rs.device != state.device:
        raise SSMQError(f"row scales must be float32 {tuple(state.shape[:-1])} on {state.device} (one per row of "
                        f"the state {tuple(state.shape)}), got {rs.dtype} {tuple(rs.shape)} on {rs.device}")
    return rs


_RECIPROCALS = {}  # id of a scale table -> (a weak reference to it, its version, 1 / it in float32)


def _reciprocal_table(scale: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """1 / table (float32, as the kernel reads it), kept per scale tensor and recomputed when it changes in place
    (its version): the tables are model constants, so a decode step does not pay an extra launch for them. Not kept
    when computed inside a CUDA graph capture (its memory would belong to that graph): then the graph computes it."""
    key = id(scale)
    ref, version, inv = _RECIPROCALS.get(key, (None, None, None))
    if ref is not None and ref() is scale and version == scale._version and inv.device == table.device:
        return inv
    inv = 1.0 / table
    if not (table.is_cuda and torch.cuda.is_current_stream_capturing()):
        _RECIPROCALS[key] = (weakref.ref(scale, lambda _, key=key: _RECIPROCALS.pop(key, None)), scale._version, inv)
    return inv


def _launch(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices,
            state_scale=None, state_index=None, x_scale=None, B_scale=None, C_scale=None, out_dtype=None, ring=None):
    multihead = state.dim() == 4
    channels = state.shape[-2] * (state.shape[1] if multihead else 1)
    rs = _row_scales(state, state_scale, state_index)
    ss, sidx, s_ssg = _state_table(state, state_scale, state_index, channels)
    ssi = _reciprocal_table(state_scale, ss) if ss is not None and CFG["rcp_table"] else None
    xs, Bs, Cs = _input_scale("x", x, x_scale), _input_scale("B", B, B_scale), _input_scale("C", C, C_scale)
    out_dtype = out_dtype or (torch.float32 if x.dtype == torch.int8 else x.dtype)
    if not multihead:  # views with h = 1: no copies, the kernel writes the caller's state
        state = state.unsqueeze(1)
        x, dt, z, xs, rs = (t.unsqueeze(1) if t is not None else None for t in (x, dt, z, xs, rs))
        A, D, dt_bias = (t.unsqueeze(0) if t is not None else None for t in (A, D, dt_bias))
        B, C, Bs, Cs = (t.unsqueeze(1) if t is not None else None for t in (B, C, Bs, Cs))
    b, h, p = x.shape
    n, g = state.shape[-1], B.shape[1]
    rep = heads_per_group(h, g)
    out = torch.empty((b, h, p), device=x.device, dtype=out_dtype)
    tie = (dt.stride(2) == 0 and A.stride(1) == 0 and A.stride(2) == 0
           and (dt_bias is None or dt_bias.stride(1) == 0))
    if ring is None and tie and not (ss is not None and CFG["rcp_table"]):
        fmt = "float" if state.dtype != torch.int8 else "int8_rows" if rs is not None else "int8_table"
        step = _step_grid(b, h, p, n, fmt, x.device)
        if step[3] > 1:  # NT: one tile a program is this kernel's (below), which measured as fast or faster there
            _launch_step(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices, ss, sidx, s_ssg, rs,
                         xs, Bs, Cs, out, rep, step)
            return out if multihead else out.squeeze(1)
    BN = pow2(n, 16)
    cfg = CFG["replay"] if ring is not None else CFG
    if state.dtype == torch.int8:
        cfg = {**cfg, **CFG["replay_int8" if ring is not None else "int8"]}
    BNC = BN if rs is not None else min(BN, cfg["BNC"] or BN)  # row scales: a row's absmax needs all of it
    BP = max(4, min(pow2(p), cfg["tile"] // BNC))  # ~4K state values in registers: enough loads in flight
    # ...but at small batch, at least two programs per SM: Mamba-1 at batch 1 is one "head" of
    # p = d_inner channels, which 4K-element tiles would spread over only d_inner / 256 SMs
    while BP > 16 and b * h * cdiv(p, BP) < 2 * sm_count(x.device):
        BP //= 2
    BP = cfg["BP"] or BP
    grid = (b, h, cdiv(p, BP))
    dummy = out  # pointer for absent tensors (never read: its constexpr flag is off)
    rx, rdt, rB, cnt, done, *ring_rest = _ring_args(ring, state, h, p, g, n, tie, h * cdiv(p, BP))
    RP = pow2(ring_rest[0] + 1)  # the ring's entries and the token
    _state_update[grid](
        state, x, dt, A, B, C, D if D is not None else x, z if z is not None else x,
        dt_bias if dt_bias is not None else x,
        state_batch_indices if state_batch_indices is not None else x, out,
        ss if ss is not None else dummy, ssi if ssi is not None else dummy, sidx if sidx is not None else dummy,
        xs if xs is not None else dummy, Bs if Bs is not None else dummy, Cs if Cs is not None else dummy,
        rs if rs is not None else dummy,
        p, n,
        *state.stride(), *x.stride(), *dt.stride(), *A.stride(), *B.stride(), *C.stride(),
        *_strides(D, 2), *_strides(z, 3), *_strides(dt_bias, 2), *out.stride(),
        s_ssg, ss.stride(1) if ss is not None else 0, sidx.stride(0) if sidx is not None else 0, *_strides(rs, 3),
        *_strides(xs, 3), *_strides(Bs, 3), *_strides(Cs, 3),
        *(t if t is not None else dummy for t in (rx, rdt, rB, cnt, done)), *ring_rest,
        HAS_D=D is not None, HAS_Z=z is not None, HAS_DTB=dt_bias is not None,
        HAS_IDX=state_batch_indices is not None, SOFTPLUS=dt_softplus, TIE_HDIM=tie,
        Q_STATE=ss is not None or rs is not None, ROWS=rs is not None, HAS_SIDX=sidx is not None,
        Q_X=xs is not None, Q_B=Bs is not None,
        Q_C=Cs is not None, REPLAY=ring is not None, RING_STAGES=cfg.get("ring_stages", 1), RP=RP,
        BNC=BNC, FOLD_STAGES=cfg.get("fold_stages", 1), FAST_RCP=CFG["fast_rcp"] and state.is_cuda,
        PTX_CODES=CFG["ptx_codes"] and state.is_cuda, RCP_TABLE=ssi is not None, EVEN=p % BP == 0 and n == BN,
        HPG=rep, BP=BP, BN=BN,
        num_warps=cfg["num_warps"], **({"maxnreg": cfg["maxnreg"]} if cfg["maxnreg"] else {}), **pdl_args(x),
    )
    return out if multihead else out.squeeze(1)
