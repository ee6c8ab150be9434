"""Triton fused Mamba-2 decode step: conv update + SiLU + Δ + state update + D + gate + gated RMSNorm
(+ int8 quantization of the output) in two kernels per layer instead of three (conv, state update, norm).

Same signature as ``ssmq.ops.mamba2_decode.mamba2_decode_step_ref``. At decode these stages move almost no
bytes besides the SSM state, so their launches and ramps (~2 µs each) are the cost.

A prototype: no configuration runs it. It passes its GPU tests on an H100 and equals the reference in Triton's
interpreter (also with programs run in random order), but it measured no faster end to end than the three kernels
of ``kernels.mamba2_decode_step`` (2.83 against 2.88 ms a token, Mamba2-2.7B batch 1 on an H100, within the
spread): at batch 1 the step is bound by launches that PDL already overlaps. Why the conv state is shifted in the
tail kernel: a version that shifted it in the step kernel let Triton load the x channels' conv state twice in two
register layouts (one for the convolution, one for the shift's stores), so one warp could shift a column before
another had read it (seen in the sm_90 TTGIR). Here each element is loaded and stored by one thread.

``_mamba2_decode_step``: one program per (batch row, T consecutive tiles of BP channels of one B/C group)
owns (BP, n) tiles of the state, as the plain state update does; it convolves its tiles' x channels and, once
for its T tiles, the n B and n C channels of its group, all from the OLD conv state; then Δ, the state update,
D and the gate. It stores, per tile, the sum of squares of the gated y (y rounded to the output dtype first,
as the unfused path rounds it) and gated y · norm weight (float32 scratch).
``_mamba2_decode_tail``: per row, one program per unit of whole norm groups and whole B/C groups (the row when
quantizing) writes out = gated · weight · rstd, rstd from the tiles' partial sums in a fixed order
(deterministic), then the int8 codes with their per-token (or static) scale; further programs shift the conv
state (the kernel boundary orders the shift after every read).

Why not one kernel: a version with the tail in each unit's last program (acq_rel counter, "threadfence
reduction") measured 6.0 vs 6.9 µs at batch 1 (Mamba2-2.7B), about what the two-kernel one measured (6.2), and
adds an ordering argument across programs that the launch boundary makes unnecessary.

The scratch lives in a per-device workspace that only grows; old buffers are kept alive because captured CUDA
graphs hold their addresses. Launches must not run concurrently on two streams.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ssmq.kernels._common import cdiv, gdc_enter, pdl_args, pow2, silu, sm_count, softplus
from ssmq.ops.layout import NO_DT_LIMIT, has_dt_limit, heads_per_group

QUANT_EPS = tl.constexpr(1e-8)  # ssmq.ops.quant_linear.EPS
MAX_TAIL = 8192  # elements the tail kernel holds at once (norm groups up to this size)
# MAX_TILES > 1 (several tiles a program, the B/C conv shared by them) equals the reference in the interpreter
# but gave wrong states on the H100 at batch 32 (T = 8), probably the conv-state race above: off until verified.
NUM_WARPS, MAX_TILES = 4, 1  # module-level, as MAX_TAIL, so the benchmark can time other choices
# Larger batches run the three single-stage kernels, where launches are amortized: the one-kernel version
# measured slower there (H100, bench_kernels --only decode, Mamba2-2.7B: 46.8 vs 37.2 us at batch 32).
FUSED_MAX_BATCH = 8


@triton.jit
def _row_and_slot(idx_ptr, HAS_IDX: tl.constexpr):
    """(batch row of this program = program_id(1), its cache slot), both int64."""
    row = tl.program_id(1).to(tl.int64)
    if HAS_IDX:
        slot = tl.load(idx_ptr + row).to(tl.int64)
    else:
        slot = row
    return row, slot


@triton.jit
def _mamba2_decode_step(
    xbc_ptr, z_ptr, dt_ptr, cs_ptr, cw_ptr, cb_ptr, st_ptr, A_ptr, D_ptr, dtb_ptr, nw_ptr, idx_ptr,
    part_ptr, gw_ptr,
    d, p, n, ngroups, dt_lo, dt_hi,
    s_xb, s_zb, s_dtb, s_dth, s_cs, s_cc, s_cw, s_wc, s_ww, s_ss, s_sh, s_sp, s_sn,
    W: tl.constexpr, HAS_CBIAS: tl.constexpr, HAS_IDX: tl.constexpr, CLAMP: tl.constexpr,
    BP: tl.constexpr, BN: tl.constexpr, T: tl.constexpr, USE_GDC: tl.constexpr = False,
):
    gdc_enter(USE_GDC)
    pid = tl.program_id(0)  # grid (programs of a row, rows)
    row, slot = _row_and_slot(idx_ptr, HAS_IDX)
    io_ty = xbc_ptr.dtype.element_ty
    ntiles = d // BP  # tiles of BP channels in a row; this program owns T consecutive ones
    c_first = pid * T * BP
    grp = c_first // (d // ngroups)  # all T tiles lie in one B/C group

    # conv + SiLU of the group's B and C channels from the OLD conv state (the tail kernel shifts it)
    offs_n = tl.arange(0, BN)
    mn = offs_n < n
    cB = d + grp * n + offs_n
    cC = cB + ngroups * n
    accB = tl.load(xbc_ptr + row * s_xb + cB, mask=mn, other=0.0).to(tl.float32) \
        * tl.load(cw_ptr + cB * s_wc + (W - 1) * s_ww, mask=mn, other=0.0).to(tl.float32)
    accC = tl.load(xbc_ptr + row * s_xb + cC, mask=mn, other=0.0).to(tl.float32) \
        * tl.load(cw_ptr + cC * s_wc + (W - 1) * s_ww, mask=mn, other=0.0).to(tl.float32)
    if HAS_CBIAS:
        accB += tl.load(cb_ptr + cB, mask=mn, other=0.0).to(tl.float32)
        accC += tl.load(cb_ptr + cC, mask=mn, other=0.0).to(tl.float32)
    for k in tl.static_range(W - 1):
        accB += tl.load(cs_ptr + slot * s_cs + cB * s_cc + k * s_cw, mask=mn, other=0.0).to(tl.float32) \
            * tl.load(cw_ptr + cB * s_wc + k * s_ww, mask=mn, other=0.0).to(tl.float32)
        accC += tl.load(cs_ptr + slot * s_cs + cC * s_cc + k * s_cw, mask=mn, other=0.0).to(tl.float32) \
            * tl.load(cw_ptr + cC * s_wc + k * s_ww, mask=mn, other=0.0).to(tl.float32)
    Bv = silu(accB).to(io_ty).to(tl.float32)
    Cv = silu(accC).to(io_ty).to(tl.float32)

    offs_p = tl.arange(0, BP)
    m2 = (offs_p < BP)[:, None] & mn[None, :]
    for t in range(T):
        cx = c_first + t * BP + offs_p
        head = (c_first + t * BP) // p
        # conv + SiLU of this tile's x channels (the tail kernel shifts their conv state: written here, the
        # shift raced with this program's own reads, which Triton had duplicated into another layout)
        xin = tl.load(xbc_ptr + row * s_xb + cx).to(tl.float32)
        acc = xin * tl.load(cw_ptr + cx * s_wc + (W - 1) * s_ww).to(tl.float32)
        if HAS_CBIAS:
            acc += tl.load(cb_ptr + cx).to(tl.float32)
        for k in tl.static_range(W - 1):
            acc += tl.load(cs_ptr + slot * s_cs + cx * s_cc + k * s_cw).to(tl.float32) \
                * tl.load(cw_ptr + cx * s_wc + k * s_ww).to(tl.float32)
        x = silu(acc).to(io_ty).to(tl.float32)
        # Δ, then the state update of the (BP, n) tile, D skip
        dt = softplus(tl.load(dt_ptr + row * s_dtb + head * s_dth).to(tl.float32) + tl.load(dtb_ptr + head))
        if CLAMP:
            dt = tl.minimum(tl.maximum(dt, dt_lo), dt_hi)
        s_ptrs = st_ptr + slot * s_ss + head * s_sh + (cx - head * p)[:, None] * s_sp + offs_n[None, :] * s_sn
        hs = tl.load(s_ptrs, mask=m2, other=0.0).to(tl.float32)
        hs = hs * tl.exp(dt * tl.load(A_ptr + head)) + (x * dt)[:, None] * Bv[None, :]
        tl.store(s_ptrs, hs.to(st_ptr.dtype.element_ty), mask=m2)
        y = (tl.sum(hs * Cv[None, :], axis=1) + x * tl.load(D_ptr + head)).to(io_ty)
        # gate; the tail needs only the sum of squares of the gated tile and gated * norm weight
        gated = y.to(tl.float32) * silu(tl.load(z_ptr + row * s_zb + cx).to(tl.float32))
        tl.store(part_ptr + row * ntiles + c_first // BP + t, tl.sum(gated * gated, axis=0))
        tl.store(gw_ptr + row * d + cx, gated * tl.load(nw_ptr + cx).to(tl.float32))


@triton.jit
def _mamba2_decode_tail(
    xbc_ptr, cs_ptr, idx_ptr, out_ptr, q_ptr, qs_ptr, part_ptr, gw_ptr,
    d, n, ngroups, gs, unit, eps, s_xb, s_cs, s_cc, s_cw, s_ob, s_qb,
    W: tl.constexpr, HAS_IDX: tl.constexpr, QUANT: tl.constexpr, STATIC_SCALE: tl.constexpr, BP: tl.constexpr,
    SB: tl.constexpr, NGB: tl.constexpr, GSB: tl.constexpr, PPG: tl.constexpr, ONE_BLOCK: tl.constexpr,
    USE_GDC: tl.constexpr = False,
):
    """Programs 0 .. d/unit - 1 of a row: one unit's gated norm from the tiles' partial sums, quantization.
    The next programs: the conv state shift of SB channels each (every channel, now that every reader is done)."""
    gdc_enter(USE_GDC)
    u = tl.program_id(0)
    row, slot = _row_and_slot(idx_ptr, HAS_IDX)
    ntiles = d // BP
    nunits = d // unit
    if u >= nunits:
        c = (u - nunits) * SB + tl.arange(0, SB)
        m = c < d + 2 * ngroups * n
        base = cs_ptr + slot * s_cs + c * s_cc
        new = tl.load(xbc_ptr + row * s_xb + c, mask=m)
        for k in tl.static_range(W - 2):  # each element loaded and stored by one thread, in this order
            tl.store(base + k * s_cw, tl.load(base + (k + 1) * s_cw, mask=m), mask=m)
        tl.store(base + (W - 2) * s_cw, new.to(cs_ptr.dtype.element_ty), mask=m)
        return
    # the unit's norm groups, NGB at a time as a (NGB, GSB) block: one round of loads when the unit fits
    if ONE_BLOCK:
        o, c, m = _norm_block(u * unit, (u + 1) * unit, row, ntiles, d, gs, eps, part_ptr, gw_ptr, out_ptr, s_ob,
                              BP, NGB, GSB, PPG)
        if QUANT:  # the unit is the whole row, still in registers
            amax = tl.max(tl.max(tl.abs(o.to(tl.float32)), axis=1), axis=0)
            scale = _row_scale(amax, qs_ptr, row, STATIC_SCALE)
            _store_codes(q_ptr + row * s_qb + c, o.to(tl.float32), scale, m)
    else:
        amax = 0.0
        for g0 in range(u * unit, (u + 1) * unit, NGB * gs):
            o, c, m = _norm_block(g0, (u + 1) * unit, row, ntiles, d, gs, eps, part_ptr, gw_ptr, out_ptr, s_ob,
                                  BP, NGB, GSB, PPG)
            if QUANT:
                amax = tl.maximum(amax, tl.max(tl.max(tl.abs(o.to(tl.float32)), axis=1), axis=0))
        if QUANT:  # the unit is the whole row: a second pass over what this program just wrote
            scale = _row_scale(amax, qs_ptr, row, STATIC_SCALE)
            tl.debug_barrier()  # its normalised row is re-read by other threads of it
            offs_g, offs_c = tl.arange(0, NGB), tl.arange(0, GSB)
            for g0 in range(0, d, NGB * gs):
                gstart = g0 + offs_g * gs
                c = gstart[:, None] + offs_c[None, :]
                m = (gstart < d)[:, None] & (offs_c < gs)[None, :]
                o = tl.load(out_ptr + row * s_ob + c, mask=m, other=0.0).to(tl.float32)
                _store_codes(q_ptr + row * s_qb + c, o, scale, m)


@triton.jit
def _norm_block(g0, end, row, ntiles, d, gs, eps, part_ptr, gw_ptr, out_ptr, s_ob,
                BP: tl.constexpr, NGB: tl.constexpr, GSB: tl.constexpr, PPG: tl.constexpr):
    """Normalise the NGB norm groups from channel g0 (those before ``end``); returns (out block, channels, mask)."""
    offs_g, offs_c, offs_j = tl.arange(0, NGB), tl.arange(0, GSB), tl.arange(0, PPG)
    gstart = g0 + offs_g * gs
    mg = gstart < end
    # fixed-order sums of the tiles' partial sums: deterministic, so CUDA-graph decode equals eager
    ss = tl.sum(tl.load(part_ptr + row * ntiles + (gstart // BP)[:, None] + offs_j[None, :],
                        mask=mg[:, None] & (offs_j < gs // BP)[None, :], other=0.0), axis=1)
    rstd = 1.0 / tl.sqrt(ss / gs + eps)
    c = gstart[:, None] + offs_c[None, :]
    m = mg[:, None] & (offs_c < gs)[None, :]
    gw = tl.load(gw_ptr + row * d + c, mask=m, other=0.0)
    o = (gw * rstd[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * s_ob + c, o, mask=m)
    return o, c, m


@triton.jit
def _row_scale(amax, qs_ptr, row, STATIC_SCALE: tl.constexpr):
    if STATIC_SCALE:
        scale = tl.load(qs_ptr).to(tl.float32)
    else:
        scale = tl.maximum(tl.math.div_rn(amax, 127.0), QUANT_EPS)
        tl.store(qs_ptr + row, scale)
    return scale


@triton.jit
def _store_codes(ptrs, o, scale, mask):
    # symmetric int8, round half to even: clamp, then the 1.5 * 2^23 trick (exact for |v| < 2^22; rint has
    # no interpreter twin); clamping first cannot change a code
    qv = tl.minimum(tl.maximum(tl.math.div_rn(o, scale), -129.0), 128.0)
    qv = (qv + 12582912.0) - 12582912.0
    qv = tl.minimum(tl.maximum(qv, -128.0), 127.0)
    tl.store(ptrs, qv.to(tl.int8), mask=mask)


_WORKSPACE: dict = {}


def _workspace(device, partials: int, gated: int):
    """(partial sums, gated · weight) float32 scratch of at least these sizes for this device: the two kernels'
    hand-over. Grows by allocating larger buffers and never frees the older ones: captured graphs point at them."""
    bufs = _WORKSPACE.setdefault(str(device), [])
    for part, gw in bufs:
        if part.numel() >= partials and gw.numel() >= gated:
            return part, gw
    part = torch.empty(max(partials, 256 * 512), dtype=torch.float32, device=device)
    gw = torch.empty(max(gated, 256 * 8192), dtype=torch.float32, device=device)
    bufs.append((part, gw))
    return part, gw


def tile_channels(b: int, h: int, p: int, n: int, norm_group_size: int, device) -> int:
    """BP: channels of one head per tile, a power of two dividing p and the norm group (0: none fits).

    ~4K state elements a tile, but at least two programs per SM at small batch (as the state update).
    """
    common = math.gcd(p, norm_group_size)
    bp = common & -common  # largest power of two dividing both
    bp = min(bp, max(4, 4096 // pow2(n, 16)))
    while bp > 16 and b * h * (p // bp) < 2 * sm_count(device):
        bp //= 2
    return bp if bp >= 4 else 0


def tiles_per_program(b: int, ntiles: int, group_tiles: int, device) -> int:
    """T: consecutive tiles of one B/C group a program runs, so it convolves the group's B and C once for T
    tiles instead of once per tile; a power of two dividing ``group_tiles``, at most 16, keeping >= 4 programs
    per SM."""
    t = 1
    while t < MAX_TILES and group_tiles % (2 * t) == 0 and b * ntiles // (2 * t) >= 4 * sm_count(device):
        t *= 2
    return t


def mamba2_decode_step(xbc, z, dt, conv_state, conv_weight, conv_bias, ssm_state, A, D, dt_bias, norm_weight,
                       ngroups, norm_group_size, eps, dt_limit=NO_DT_LIMIT, slots=None, quantize=False,
                       out_scale=None):
    """The fused decode step, as ``mamba2_decode_step_ref`` (same arguments, same returns)."""
    b = xbc.shape[0]
    _, h, p, n = ssm_state.shape
    d = h * p
    conv_dim, w = conv_weight.shape
    gs = norm_group_size
    heads_per_group(h, ngroups)
    if d % gs or conv_dim != d + 2 * ngroups * n:
        raise ValueError(f"inconsistent Mamba-2 decode shapes: h={h} g={ngroups} p={p} n={n} conv_dim={conv_dim} "
                         f"norm group {gs}")
    bp = tile_channels(b, h, p, n, gs, xbc.device)
    if bp == 0 or w < 2 or pow2(gs) > MAX_TAIL or b > FUSED_MAX_BATCH:
        from ssmq.kernels import conv1d, norm, state_update  # the three single-stage kernels
        from ssmq.ops.mamba2_decode import compose
        return compose(conv1d.causal_conv1d_update, state_update.selective_state_update, norm.rmsnorm_gated,
                       xbc, z, dt, conv_state, conv_weight, conv_bias, ssm_state, A, D, dt_bias, norm_weight,
                       ngroups, gs, eps, dt_limit, slots, quantize, out_scale)
    if xbc.stride(-1) != 1:
        xbc = xbc.contiguous()
    if z.stride(-1) != 1:
        z = z.contiguous()
    out = torch.empty((b, d), device=xbc.device, dtype=xbc.dtype)
    q = torch.empty((b, d), device=xbc.device, dtype=torch.int8) if quantize else out
    if out_scale is not None:
        scale = out_scale.float().reshape(())
    else:
        scale = torch.empty(b, device=xbc.device, dtype=torch.float32) if quantize else out
    if b == 0:
        return (out, q, scale) if quantize else out
    ntiles, dg = d // bp, d // ngroups
    T = tiles_per_program(b, ntiles, dg // bp, xbc.device)
    # the tail's unit of channels: whole norm groups and whole B/C groups; the row when quantizing
    unit = d if quantize else math.lcm(gs, dg)
    ngb = max(1, min(pow2(unit // gs), MAX_TAIL // pow2(gs)))
    part, gw = _workspace(xbc.device, b * ntiles, b * d)
    A, D, dt_bias = (t.float().contiguous() for t in (A, D, dt_bias))
    idx = slots if slots is not None else xbc
    _mamba2_decode_step[(ntiles // T, b)](
        xbc, z, dt, conv_state, conv_weight, conv_bias if conv_bias is not None else conv_weight, ssm_state,
        A, D, dt_bias, norm_weight.contiguous(), idx, part, gw,
        d, p, n, ngroups, float(dt_limit[0]), float(min(dt_limit[1], 3.0e38)),
        xbc.stride(0), z.stride(0), *dt.stride(), *conv_state.stride(), *conv_weight.stride(), *ssm_state.stride(),
        W=w, HAS_CBIAS=conv_bias is not None, HAS_IDX=slots is not None, CLAMP=has_dt_limit(dt_limit),
        BP=bp, BN=pow2(n, 16), T=T, num_warps=NUM_WARPS, num_stages=1, **pdl_args(xbc),
    )
    block = ngb * pow2(gs)
    sb = 1024  # conv channels a shift program moves
    _mamba2_decode_tail[(d // unit + cdiv(conv_dim, sb), b)](
        xbc, conv_state, idx, out, q, scale, part, gw, d, n, ngroups, gs, unit, eps,
        xbc.stride(0), *conv_state.stride(), out.stride(0), q.stride(0),
        W=w, HAS_IDX=slots is not None, QUANT=quantize, STATIC_SCALE=out_scale is not None, BP=bp,
        SB=sb, NGB=ngb, GSB=pow2(gs), PPG=pow2(gs // bp),
        ONE_BLOCK=ngb * gs >= unit, num_warps=min(16, max(4, block // 512)), **pdl_args(xbc),
    )
    return (out, q, scale) if quantize else out
