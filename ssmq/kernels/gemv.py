"""Triton GEMV for decode: ``F.linear`` when x has a few rows (batch-1..8 tokens).

At decode the weight is read once for a handful of rows, so the op is bound by
weight bytes over memory bandwidth; cuBLAS picks GEMM tilings that reach only
part of it at these shapes. One program owns a BLOCK_N slice of outputs for up
to 8 rows: it streams its (BLOCK_N, K) slab of the weight once, in
(BLOCK_N, BLOCK_K) tiles, and applies each tile to every row (float32 sums).
When the output slices alone give too few programs to keep every SM streaming
(small N), K is split too: each split writes float32 partial sums and a small
second kernel adds them up with the bias.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ssmq.kernels import configs
from ssmq.kernels._common import cdiv, dot_precision, gdc_enter, pdl_args, pow2, sm_count

MAX_ROWS = 8  # rows an FMA program serves (a DOT program serves 16); more rows take more programs, each
# re-reading its weight slab

CFG = configs.load("gemv")  # launch settings (configs/gemv.json, keys in docs/kernels.md)


@triton.jit
def _gemv_step(acc, xv, w, DOT: tl.constexpr, PRECISION: tl.constexpr):
    if DOT:
        acc = tl.dot(xv, tl.trans(w), acc, input_precision=PRECISION)
    else:
        acc += xv.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    return acc


@triton.jit
def _gemv(
    x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, k_split,
    s_xm, s_wn, s_om, s_os,
    HAS_BIAS: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr = False,
    EARLY: tl.constexpr = False,
):
    # row and output blocks share axis 0 (grid axes past 0 stop at 65535), output blocks fastest so
    # that programs running together read the same rows of x
    n_blocks = tl.cdiv(N, BLOCK_N)
    pid_n, pid_m, pid_k = tl.program_id(0) % n_blocks, tl.program_id(0) // n_blocks, tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mm, mn = offs_m < M, offs_n < N
    k0 = pid_k * k_split
    k_len = tl.minimum(k_split, K - k0)
    # int64 offsets: N * K of an lm_head, or M * N of many rows, can pass 2**31 elements
    rows = offs_m.to(tl.int64)
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * s_wn + (k0 + offs_k)[None, :]
    x_ptrs = x_ptr + rows[:, None] * s_xm + (k0 + offs_k)[None, :]
    if DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        # float32 products summed elementwise across the K loop, reduced over K once at the
        # end: a reduction per tile would cost cross-lane shuffles on every iteration
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    # the first K step peeled: with EARLY its weight tile is requested before waiting on the kernel before (PDL),
    # so the stream starts during that kernel's tail (the weight is a parameter: no decode kernel writes it); x
    # only after the wait
    if EVEN_K:  # (k_len >= BLOCK_K) no K mask, as in the loop
        mw, mx = mn[:, None], mm[:, None]
    else:
        mk = offs_k < k_len
        mw, mx = mn[:, None] & mk[None, :], mm[:, None] & mk[None, :]
    if not EARLY:  # nothing before the wait: the PDL contract of every other decode kernel
        gdc_enter(USE_GDC)
    w = tl.load(w_ptrs, mask=mw, other=0.0)
    if EARLY:
        gdc_enter(USE_GDC)
    xv = tl.load(x_ptrs, mask=mx, other=0.0)
    acc = _gemv_step(acc, xv, w, DOT, PRECISION)
    for k in range(BLOCK_K, k_len, BLOCK_K):
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        if EVEN_K:
            # no K mask: a mask of unknown alignment along K would split the 16-byte weight loads
            w = tl.load(w_ptrs, mask=mn[:, None], other=0.0)
            xv = tl.load(x_ptrs, mask=mm[:, None], other=0.0)
        else:
            mk = offs_k < k_len - k
            w = tl.load(w_ptrs, mask=mn[:, None] & mk[None, :], other=0.0)
            xv = tl.load(x_ptrs, mask=mm[:, None] & mk[None, :], other=0.0)
        acc = _gemv_step(acc, xv, w, DOT, PRECISION)
    if not DOT:
        acc = tl.sum(acc, axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mn, other=0.0).to(tl.float32)[None, :]
    o_ptrs = out_ptr + pid_k * s_os + rows[:, None] * s_om + offs_n[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mm[:, None] & mn[None, :])


@triton.jit
def _sum_splits(p_ptr, b_ptr, out_ptr, MN, N, n_split, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
                USE_GDC: tl.constexpr = False, s_om=0):
    gdc_enter(USE_GDC)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(n_split):
        acc += tl.load(p_ptr + s * MN + offs, mask=m, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=m, other=0.0).to(tl.float32)
    dst = offs
    if s_om != 0:  # output rows s_om apart (written into a wider tensor, ``linear_decode(out=...)``)
        dst = (offs // N) * s_om + offs % N
    tl.store(out_ptr + dst, acc.to(out_ptr.dtype.element_ty), mask=m)


def _plan(dot: bool, M: int, N: int, K: int, sms: int, cfg: dict) -> dict:
    if dot:
        BM, BN, BK = 16, min(cfg["BN_DOT"], pow2(N, 16)), min(cfg["BK_DOT"], pow2(K, 16))
        nw, stages = cfg["warps_dot"], cfg["stages_dot"]
    else:
        BM = pow2(min(M, MAX_ROWS))
        BK = min(max(16, cfg["BK_FMA"] // BM), pow2(K, 16))
        # a BK that divides K drops the K mask from the loop (EVEN_K); halve down to a quarter for it
        for bk in (BK, BK // 2, BK // 4):
            if bk >= 16 and K % bk == 0:
                BK = bk
                break
        BN = min(max(1, cfg["TILE_FMA"] // (BK * BM)), pow2(N))
        nw, stages = cfg["warps_fma"], cfg["stages_fma"]
    m_blocks, n_blocks = cdiv(M, BM), cdiv(N, BN)
    # split K only as far as needed to give every SM WAVES programs, and keep splits long
    want = cdiv(cfg["WAVES"] * sms, max(1, n_blocks * m_blocks))
    split = max(1, min(cfg["MAX_SPLIT"], want, K // cfg["MIN_SPLIT_K"]))
    k_split = cdiv(cdiv(K, split), BK) * BK if K else 0
    split = cdiv(K, k_split) if K else 1
    return dict(DOT=dot, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, num_warps=nw, num_stages=stages,
                EVEN_K=K % BK == 0, split=split, k_split=k_split, grid=(n_blocks * m_blocks, split))


def _config(M: int, N: int, K: int, sms: int, cfg=None) -> dict:
    """Path, block sizes, warps and the K split for an (M, N, K) product on ``sms`` SMs (pure Python)."""
    cfg = CFG if cfg is None else cfg
    if cfg["PATH"] is not None:
        return _plan(cfg["PATH"] == "dot", M, N, K, sms, cfg)
    rows = pow2(min(M, MAX_ROWS))
    if rows == 1 or rows > cfg["FMA_MAX_ROWS"]:
        return _plan(rows > 1, M, N, K, sms, cfg)
    dot = _plan(True, M, N, K, sms, cfg)
    return dot if dot["split"] == 1 else _plan(False, M, N, K, sms, cfg)


def linear_decode(x, weight, bias=None, cfg=None, out=None):
    """``F.linear(x, weight, bias)`` for few rows, streaming the weight once.

    x: (..., K); weight: (N, K) with unit stride on K (nn.Linear's layout); bias: (N,) or None;
    all one dtype (float16, bfloat16 or float32). Returns (..., N) in x's dtype, sums in float32.
    Meant for at most MAX_ROWS rows (prod of x's leading dims); more rows work, each further
    block of rows re-reading the weight. ``cfg`` overrides entries of CFG (tests, tuning).
    ``out``: (..., N) to write the result into instead (returned), in its own float dtype (the float32
    sums rounded once); its rows may be strided (a column slice of a wider tensor), its N not.
    """
    K = x.shape[-1]
    N = weight.shape[0]
    if weight.shape[-1] != K:
        raise ValueError(f"x has {K} features, weight is {tuple(weight.shape)}")
    M = math.prod(x.shape[:-1])
    x2 = x.reshape(M, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    if bias is not None and bias.stride(-1) != 1:
        bias = bias.contiguous()
    if out is None:
        out = torch.empty((*x.shape[:-1], N), device=x.device, dtype=x.dtype)
        s_om = N
    else:
        o2 = out.reshape(M, N) if tuple(out.shape) == (*x.shape[:-1], N) else None
        if o2 is None or (N > 1 and o2.stride(-1) != 1) \
                or o2.untyped_storage().data_ptr() != out.untyped_storage().data_ptr():
            raise ValueError(f"out {tuple(out.shape)} must be a ({', '.join(map(str, (*x.shape[:-1], N)))}) view "
                             f"with rows of unit stride")
        s_om = o2.stride(0)
    if M == 0 or N == 0:
        return out
    if K == 0:  # an empty sum: the bias alone (the kernel peels a first K step)
        return out.copy_(bias.expand_as(out) if bias is not None else torch.zeros_like(out))
    cfg_ = CFG if cfg is None else {**CFG, **cfg}
    c = _config(M, N, K, sm_count(x.device), cfg_)
    split = c["split"]
    # split > 1: float32 partial sums (split, M, N); the bias waits for the final sum
    part = out if split == 1 else torch.empty((split, M, N), device=x.device, dtype=torch.float32)
    _gemv[c["grid"]](
        x2, weight, bias if bias is not None else weight, part, M, N, K, c["k_split"],
        x2.stride(0), weight.stride(0), s_om if split == 1 else N, M * N,
        HAS_BIAS=bias is not None and split == 1, DOT=c["DOT"], PRECISION=dot_precision(x.dtype),
        EVEN_K=c["EVEN_K"], EARLY=cfg_["EARLY_TILE"],
        BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"],
        num_warps=c["num_warps"], num_stages=c["num_stages"], **pdl_args(x2),
    )
    if split > 1:
        BLOCK = 1024
        _sum_splits[(cdiv(M * N, BLOCK),)](
            part, bias if bias is not None else part, out, M * N, N, split,
            HAS_BIAS=bias is not None, BLOCK=BLOCK, num_warps=4, **pdl_args(x2), s_om=0 if s_om == N else s_om,
        )
    return out
