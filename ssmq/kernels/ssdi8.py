"""Triton twins of the integer stages of SSDi8 (``ssmq.ops.ssd_int8``); ``ssd_int8`` has the reference's signature.

Glossary as ``ssmq.ops.ssd_int8``. Four launches do the integer work, the float glue (Δ, dA_cumsum, the LUTs, the
quantization of X_scaled, ChunkScan2 on float X) is the reference's own torch code, so the results equal the
reference bit for bit where the arithmetic is integer:
    _chunk_state_q    int8 X_scaled (T, p) x int8 B (T, n) -> int32 on tensor cores, requantized to the int8 state in
                      the epilogue (one float32 multiply, round half to even, clamp): the chunk state is stored int8
    _state_passing_q  s <- clamp(((decay_q · s + 2^6) >> 7) + chunk_q): int32 registers, int8 in and out
    _chunk_bmm_q      C_q · B_qᵀ per (chunk, group), int32 out
    _chunk_scan_off_q C_q (T, n) x int8 state (n, p) -> int32, the LUT epilogue in float32 (same order as the
                      reference: acc · LUT_off[t] · state_scale[p])
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ssmq.kernels._common import pow2
from ssmq.ops.ssd_int8 import IntStages, run_ssd_int8


@triton.jit
def _round_half_even(v):
    # no libdevice (the interpreter has none): floor and the exact remainder v - floor(v)
    r = tl.floor(v)
    d = v - r
    odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
    return tl.where((d > 0.5) | ((d == 0.5) & odd), r + 1.0, r)


@triton.jit
def _chunk_state_q(xs_ptr, B_ptr, mult_ptr, out_ptr, T, h, p, g, n,
                   BT: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr):
    # xs (b, c, T, h, p) int8; B (b, c, T, g, n) int8; mult (h, p) float32; out (b, c, h, p, n) int8
    pid_bc, pid_h, pid_pn = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n_blocks = tl.cdiv(n, BN)
    offs_p = (pid_pn // n_blocks) * BP + tl.arange(0, BP)
    offs_n = (pid_pn % n_blocks) * BN + tl.arange(0, BN)
    grp = pid_h // (h // g)
    acc = tl.zeros((BP, BN), dtype=tl.int32)
    for t0 in range(0, T, BT):
        offs_t = t0 + tl.arange(0, BT)
        mt = offs_t < T
        xs = tl.load(xs_ptr + ((pid_bc * T + offs_t[None, :]) * h + pid_h) * p + offs_p[:, None],
                     mask=mt[None, :] & (offs_p[:, None] < p), other=0)
        bq = tl.load(B_ptr + ((pid_bc * T + offs_t[:, None]) * g + grp) * n + offs_n[None, :],
                     mask=mt[:, None] & (offs_n[None, :] < n), other=0)
        acc += tl.dot(xs, bq, out_dtype=tl.int32)
    mult = tl.load(mult_ptr + pid_h * p + offs_p, mask=offs_p < p, other=0.0)
    q = tl.minimum(tl.maximum(_round_half_even(acc.to(tl.float32) * mult[:, None]), -128.0), 127.0)
    mask = (offs_p[:, None] < p) & (offs_n[None, :] < n)
    tl.store(out_ptr + ((pid_bc * h + pid_h) * p + offs_p[:, None]) * n + offs_n[None, :], q.to(tl.int8), mask=mask)


@triton.jit
def _state_passing_q(chunk_ptr, decay_ptr, init_ptr, enter_ptr, final_ptr, nc, h, m,
                     HAS_INIT: tl.constexpr, BLOCK: tl.constexpr, SHIFT: tl.constexpr):
    # chunk / enter (b, c, h, m = p·n) int8; decay (b, c, h) int32; init / final (b, h, m) int8
    pid_b, pid_h, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs = pid_m * BLOCK + tl.arange(0, BLOCK)
    mask = offs < m
    if HAS_INIT:
        s = tl.load(init_ptr + (pid_b * h + pid_h) * m + offs, mask=mask, other=0).to(tl.int32)
    else:
        s = tl.zeros((BLOCK,), dtype=tl.int32)
    for c in range(nc):
        row = ((pid_b * nc + c) * h + pid_h) * m
        tl.store(enter_ptr + row + offs, s.to(tl.int8), mask=mask)
        dq = tl.load(decay_ptr + (pid_b * nc + c) * h + pid_h)
        ch = tl.load(chunk_ptr + row + offs, mask=mask, other=0).to(tl.int32)
        s = ((dq * s + (1 << (SHIFT - 1))) >> SHIFT) + ch
        s = tl.minimum(tl.maximum(s, -128), 127)
    tl.store(final_ptr + (pid_b * h + pid_h) * m + offs, s.to(tl.int8), mask=mask)


@triton.jit
def _chunk_bmm_q(C_ptr, B_ptr, out_ptr, T, g, n, BM: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr):
    # C, B (b, c, T, g, n) int8 -> out (b, c, t, s, g) int32
    pid_bc, pid_g, pid_ts = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    s_blocks = tl.cdiv(T, BS)
    offs_t = (pid_ts // s_blocks) * BM + tl.arange(0, BM)
    offs_s = (pid_ts % s_blocks) * BS + tl.arange(0, BS)
    acc = tl.zeros((BM, BS), dtype=tl.int32)
    for k0 in range(0, n, BK):
        offs_k = k0 + tl.arange(0, BK)
        mk = offs_k < n
        cq = tl.load(C_ptr + ((pid_bc * T + offs_t[:, None]) * g + pid_g) * n + offs_k[None, :],
                     mask=(offs_t[:, None] < T) & mk[None, :], other=0)
        bq = tl.load(B_ptr + ((pid_bc * T + offs_s[None, :]) * g + pid_g) * n + offs_k[:, None],
                     mask=(offs_s[None, :] < T) & mk[:, None], other=0)
        acc += tl.dot(cq, bq, out_dtype=tl.int32)
    mask = (offs_t[:, None] < T) & (offs_s[None, :] < T)
    tl.store(out_ptr + ((pid_bc * T + offs_t[:, None]) * T + offs_s[None, :]) * g + pid_g, acc, mask=mask)


@triton.jit
def _chunk_scan_off_q(C_ptr, S_ptr, lut_ptr, ss_ptr, out_ptr, T, h, p, g, n,
                      BM: tl.constexpr, BP: tl.constexpr, BK: tl.constexpr):
    # C (b, c, T, g, n) int8; S = entering state (b, c, h, p, n) int8; lut (b, c, T, h); ss (h, p)
    # -> out (b, c, T, h, p) float32 = float32(acc) · lut[t] · ss[p]
    pid_bc, pid_h, pid_tp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    p_blocks = tl.cdiv(p, BP)
    offs_t = (pid_tp // p_blocks) * BM + tl.arange(0, BM)
    offs_p = (pid_tp % p_blocks) * BP + tl.arange(0, BP)
    grp = pid_h // (h // g)
    acc = tl.zeros((BM, BP), dtype=tl.int32)
    for k0 in range(0, n, BK):
        offs_k = k0 + tl.arange(0, BK)
        mk = offs_k < n
        cq = tl.load(C_ptr + ((pid_bc * T + offs_t[:, None]) * g + grp) * n + offs_k[None, :],
                     mask=(offs_t[:, None] < T) & mk[None, :], other=0)
        sq = tl.load(S_ptr + ((pid_bc * h + pid_h) * p + offs_p[None, :]) * n + offs_k[:, None],
                     mask=(offs_p[None, :] < p) & mk[:, None], other=0)
        acc += tl.dot(cq, sq, out_dtype=tl.int32)
    lut = tl.load(lut_ptr + (pid_bc * T + offs_t) * h + pid_h, mask=offs_t < T, other=0.0)
    ss = tl.load(ss_ptr + pid_h * p + offs_p, mask=offs_p < p, other=0.0)
    y = acc.to(tl.float32) * lut[:, None] * ss[None, :]
    mask = (offs_t[:, None] < T) & (offs_p[None, :] < p)
    tl.store(out_ptr + ((pid_bc * T + offs_t[:, None]) * h + pid_h) * p + offs_p[None, :], y, mask=mask)


def _blk(x: int, cap: int) -> int:
    return min(cap, pow2(x, 16))  # tl.dot needs >= 16 on every side


def chunk_state_q(xs_q, B_q, mult):
    """xs_q (b, c, T, h, p) int8, B_q (b, c, T, g, n) int8, mult (h, p) -> int8 chunk states (b, c, h, p, n)."""
    b, c, T, h, p = xs_q.shape
    g, n = B_q.shape[3], B_q.shape[4]
    out = torch.empty(b, c, h, p, n, dtype=torch.int8, device=xs_q.device)
    BT, BP, BN = _blk(T, 64), _blk(p, 64), _blk(n, 64)
    grid = (b * c, h, triton.cdiv(p, BP) * triton.cdiv(n, BN))
    _chunk_state_q[grid](xs_q.contiguous(), B_q.contiguous(), mult.float().contiguous(), out, T, h, p, g, n,
                         BT=BT, BP=BP, BN=BN)
    return out


def state_passing_q(chunk_q, decay_q, initial_q=None):
    """As ``ops.ssd_int8.state_passing_int8``: (entering (b, c, h, p, n) int8, final (b, h, p, n) int8)."""
    from ssmq.ops.ssd_int8 import DECAY_BITS

    b, c, h, p, n = chunk_q.shape
    enter = torch.empty_like(chunk_q)
    final = torch.empty(b, h, p, n, dtype=torch.int8, device=chunk_q.device)
    BLOCK = min(1024, pow2(p * n))
    init = initial_q.contiguous() if initial_q is not None else final
    _state_passing_q[(b, h, triton.cdiv(p * n, BLOCK))](
        chunk_q.contiguous(), decay_q.to(torch.int32).contiguous(), init, enter, final, c, h, p * n,
        HAS_INIT=initial_q is not None, BLOCK=BLOCK, SHIFT=DECAY_BITS)
    return enter, final


def chunk_bmm_q(C_q, B_q):
    b, c, T, g, n = C_q.shape
    out = torch.empty(b, c, T, T, g, dtype=torch.int32, device=C_q.device)
    BM, BK = _blk(T, 64), _blk(n, 64)
    _chunk_bmm_q[(b * c, g, triton.cdiv(T, BM) ** 2)](C_q.contiguous(), B_q.contiguous(), out, T, g, n,
                                                      BM=BM, BS=BM, BK=BK)
    return out


def chunk_scan_off_q(C_q, entering_q, lut, state_scale):
    """C_q (b, c, T, g, n), entering_q (b, c, h, p, n) int8, lut (b, c, T, h) = exp(Acs)·C_scale -> (b, c, T, h, p)."""
    b, c, T, g, n = C_q.shape
    h, p = entering_q.shape[2], entering_q.shape[3]
    out = torch.empty(b, c, T, h, p, dtype=torch.float32, device=C_q.device)
    BM, BP, BK = _blk(T, 64), _blk(p, 64), _blk(n, 64)
    _chunk_scan_off_q[(b * c, h, triton.cdiv(T, BM) * triton.cdiv(p, BP))](
        C_q.contiguous(), entering_q.contiguous(), lut.float().contiguous(), state_scale.float().contiguous(), out,
        T, h, p, g, n, BM=BM, BP=BP, BK=BK)
    return out


TRITON_STAGES = IntStages(chunk_state_q, state_passing_q, chunk_bmm_q, chunk_scan_off_q)


def ssd_int8(*args, **kwargs):
    """``ssmq.ops.ssd_int8.ssd_int8_ref`` on the Triton integer stages (same signature and results)."""
    return run_ssd_int8(TRITON_STAGES, *args, **kwargs)
