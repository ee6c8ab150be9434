"""Triton GEMV for decode: ``F.linear`` when x has a few rows (batch-1..8 tokens).

At decode the weight is read once for a handful of rows, so the op is bound by
weight bytes over memory bandwidth; cuBLAS picks GEMM tilings that reach only
part of it at these shapes. One program owns a BLOCK_N slice of outputs for up
to 8 rows: it streams its (BLOCK_N, K) slab of the weight once, in
(BLOCK_N, BLOCK_K) tiles, and applies each tile to every row (float32 sums).
When the output slices alone give too few programs to keep every SM streaming
(small N), K is split too: each split writes float32 partial sums and a small
second kernel adds them up with the bias.

``gated_rmsnorm_linear`` runs the same kernel with a prologue (GATED_NORM) that makes x from Mamba-2's
gated RMSNorm on the fly, so the norm costs no kernel of its own: x = y * silu(z) * norm_weight, in float32,
applied unnormalised. The rms scale rstd = rsqrt(mean(g²) + eps) of g = y * silu(z) is one number per
(row, norm group), so it factors out of the group's share of the dot product: the program sums g² and the
products over a group, then adds rstd * (group's products) to the output (exact, not an approximation).
Tiles never straddle a group (BLOCK_K divides group_size) and K splits start on group boundaries.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ssmq.kernels._common import dot_precision, pow2, silu, sm_count

MAX_ROWS = 8  # rows an FMA program serves (a DOT program serves 16); more rows take more programs, each
# re-reading its weight slab

# Launch heuristic (see _config); tests and the benchmark override entries. Picked from a sweep on an H100
# at Mamba2-2.7B's in_proj (10576, 2560), out_proj (2560, 5120) and lm_head (50288, 2560), fp16, weights
# streamed from HBM (rotated past L2), CUDA-graph replays.
#   PATH: None (heuristic), "fma" or "dot" (forced).
#   FMA path: each tile applied by float32 multiply-adds. Fastest for one row (tl.dot would pad it to 16)
#     and, at two rows, where tl.dot's 16-wide N blocks are too few to fill the GPU without a K split.
#     Tiles of TILE_FMA / rows weight elements, BK_FMA / rows wide: a thread keeps TILE / (32 * warps)
#     float32 sums whatever the rows.
#   DOT path: tl.dot on (16, BK) x (BK, BN) tiles, rows padded to 16: at 4-8 rows FMAs would cost
#     rows multiply-adds per weight element, on the order of the load time.
#   WAVES: programs wanted per SM before K is split (resident programs hide each other's load
#     latency and even out the tail); a split costs float32 partials and a second kernel.
#   MIN_SPLIT_K: the fewest K elements one split streams.
#   Gated-norm prologue (gated_rmsnorm_linear): BLOCK_K is halved (down to 16) until it divides the norm
#     group and splits are whole groups; where that leaves fewer than WAVES programs per SM, BLOCK_N is
#     halved (down to 16 on the DOT path, 1 on FMA) instead.
CFG = dict(PATH=None, FMA_MAX_ROWS=2, BK_FMA=1024, TILE_FMA=2048, warps_fma=2, stages_fma=1,
           BN_DOT=32, BK_DOT=128, warps_dot=4, stages_dot=4, WAVES=2, MAX_SPLIT=8, MIN_SPLIT_K=512)


@triton.jit
def _gemv(
    x_ptr, z_ptr, nw_ptr, w_ptr, b_ptr, out_ptr, M, N, K, k_split, gsize, eps,
    s_xm, s_zm, s_wn, s_om, s_os,
    HAS_BIAS: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr, EVEN_K: tl.constexpr,
    GATED_NORM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # GATED_NORM: x_ptr holds y, and z_ptr / nw_ptr the gate and the norm weight; groups of gsize
    # channels, k_split a multiple of gsize, gsize a multiple of BLOCK_K (else z_ptr, nw_ptr, gsize,
    # eps are unused)
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
    if GATED_NORM:
        z_ptrs = z_ptr + rows[:, None] * s_zm + (k0 + offs_k)[None, :]
        # the norm weight as a (BLOCK_M, BLOCK_K) tile, like y and z: a (BLOCK_K,) one would be laid out
        # a scalar per thread, too narrow for the DOT path's pipelined (cp.async) loads
        nw_ptrs = tl.broadcast_to(nw_ptr + (k0 + offs_k)[None, :], (BLOCK_M, BLOCK_K))
        # acc holds the current group's products; total the rstd-scaled sums of the groups done.
        # The group's sum of g² is kept elementwise too, reduced once per group.
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        sumsq = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for k in range(0, k_len, BLOCK_K):
        if EVEN_K:
            # no K mask: a mask of unknown alignment along K would split the 16-byte weight loads
            w = tl.load(w_ptrs, mask=mn[:, None], other=0.0)
            xv = tl.load(x_ptrs, mask=mm[:, None], other=0.0)
            if GATED_NORM:
                zv = tl.load(z_ptrs, mask=mm[:, None], other=0.0)
                nwv = tl.load(nw_ptrs, mask=mm[:, None], other=0.0)
        else:
            mk = offs_k < k_len - k
            w = tl.load(w_ptrs, mask=mn[:, None] & mk[None, :], other=0.0)
            xv = tl.load(x_ptrs, mask=mm[:, None] & mk[None, :], other=0.0)
            if GATED_NORM:
                zv = tl.load(z_ptrs, mask=mm[:, None] & mk[None, :], other=0.0)
                nwv = tl.load(nw_ptrs, mask=mm[:, None] & mk[None, :], other=0.0)
        if GATED_NORM:
            g = xv.to(tl.float32) * silu(zv.to(tl.float32))
            sumsq += g * g
            xv = g * nwv.to(tl.float32)
            if DOT:
                # tl.dot takes the weight's dtype, and unnormalised x can pass float16's range:
                # each row of the tile goes in at unit rms, its products scaled back after
                rms = tl.sqrt(tl.sum(xv * xv, axis=1) / BLOCK_K + 1e-30)
                xs = (xv * (1.0 / rms)[:, None]).to(w.dtype)
                acc += tl.dot(xs, tl.trans(w), input_precision=PRECISION) * rms[:, None]
            else:
                acc += xv[:, None, :] * w.to(tl.float32)[None, :, :]
            z_ptrs += BLOCK_K
            nw_ptrs += BLOCK_K
        elif DOT:
            acc = tl.dot(xv, tl.trans(w), acc, input_precision=PRECISION)
        else:
            acc += xv.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        if GATED_NORM:
            if (k + BLOCK_K) % gsize == 0:  # k0 is a group boundary: this tile ends a group
                rstd = 1.0 / tl.sqrt(tl.sum(sumsq, axis=1) / gsize + eps)
                if DOT:
                    total += rstd[:, None] * acc
                else:
                    total += rstd[:, None] * tl.sum(acc, axis=2)
                acc = tl.zeros_like(acc)
                sumsq = tl.zeros_like(sumsq)
    if GATED_NORM:
        acc = total
    elif not DOT:
        acc = tl.sum(acc, axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mn, other=0.0).to(tl.float32)[None, :]
    o_ptrs = out_ptr + pid_k * s_os + rows[:, None] * s_om + offs_n[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mm[:, None] & mn[None, :])


@triton.jit
def _sum_splits(p_ptr, b_ptr, out_ptr, MN, N, n_split, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(n_split):
        acc += tl.load(p_ptr + s * MN + offs, mask=m, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=m)


def _plan(dot: bool, M: int, N: int, K: int, sms: int, cfg: dict, group: int | None = None) -> dict | None:
    """One path's launch; ``group``: the gated-norm prologue's group size (tiles and splits within groups),
    None for the plain GEMV. None when no BLOCK_K >= 16 divides the group."""
    if dot:
        BM, BN, BK = 16, min(cfg["BN_DOT"], pow2(N, 16)), min(cfg["BK_DOT"], pow2(K, 16))
        nw, stages, bn_min = cfg["warps_dot"], cfg["stages_dot"], 16
    else:
        BM = pow2(min(M, MAX_ROWS))
        BK = min(max(16, cfg["BK_FMA"] // BM), pow2(K, 16))
        nw, stages, bn_min = cfg["warps_fma"], cfg["stages_fma"], 1
    if group is None:
        # a BK that divides K drops the K mask from the loop (EVEN_K); halve down to a quarter for it
        for bk in (BK, BK // 2, BK // 4):
            if bk >= 16 and K % bk == 0:
                BK = bk
                break
    else:
        # a tile must not straddle two norm groups
        while BK >= 16 and group % BK:
            BK //= 2
        if BK < 16:
            return None
    if not dot:
        BN = min(max(1, cfg["TILE_FMA"] // (BK * BM)), pow2(N))
    m_blocks = triton.cdiv(M, BM)
    # K splits start on multiples of BK, and of the group with the prologue
    unit = BK if group is None else group
    while True:
        n_blocks = triton.cdiv(N, BN)
        # split K only as far as needed to give every SM WAVES programs, and keep splits long
        want = triton.cdiv(cfg["WAVES"] * sms, max(1, n_blocks * m_blocks))
        split = max(1, min(cfg["MAX_SPLIT"], want, K // cfg["MIN_SPLIT_K"]))
        k_split = triton.cdiv(triton.cdiv(K, split), unit) * unit if K else 0
        split = triton.cdiv(K, k_split) if K else 1
        # whole-group splits can fall short of the programs wanted: narrower output blocks instead
        if group is None or n_blocks * m_blocks * split >= cfg["WAVES"] * sms or BN <= bn_min:
            break
        BN //= 2
    return dict(DOT=dot, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, num_warps=nw, num_stages=stages,
                EVEN_K=K % BK == 0, split=split, k_split=k_split, grid=(n_blocks * m_blocks, split))


def _config(M: int, N: int, K: int, sms: int, cfg=None, group: int | None = None) -> dict | None:
    """Path, block sizes, warps and the K split for an (M, N, K) product on ``sms`` SMs (pure Python).

    ``group``: with the gated-norm prologue, its group size; the path is the plain GEMV's, and None
    comes back when no plan keeps tiles within groups (the caller falls back)."""
    cfg = CFG if cfg is None else cfg
    if cfg["PATH"] is not None:
        dot = cfg["PATH"] == "dot"
    else:
        rows = pow2(min(M, MAX_ROWS))
        if rows == 1 or rows > cfg["FMA_MAX_ROWS"]:
            dot = rows > 1
        else:
            dot = _plan(True, M, N, K, sms, cfg)["split"] == 1
    return _plan(dot, M, N, K, sms, cfg, group)


def _launch(x2, weight, bias, out, M, N, K, c, gated=None):
    """Run plan ``c`` on rows x2 (M, K) into out (..., N); ``gated``: (z2, norm_weight, eps, group_size)."""
    split = c["split"]
    # split > 1: float32 partial sums (split, M, N); the bias waits for the final sum
    part = out if split == 1 else torch.empty((split, M, N), device=x2.device, dtype=torch.float32)
    z2, nw, eps, gs = gated if gated is not None else (x2, x2, 0.0, 1)
    _gemv[c["grid"]](
        x2, z2, nw, weight, bias if bias is not None else weight, part, M, N, K, c["k_split"], gs, eps,
        x2.stride(0), z2.stride(0), weight.stride(0), N, M * N,
        HAS_BIAS=bias is not None and split == 1, DOT=c["DOT"], PRECISION=dot_precision(x2.dtype),
        EVEN_K=c["EVEN_K"], GATED_NORM=gated is not None,
        BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"],
        num_warps=c["num_warps"], num_stages=c["num_stages"],
    )
    if split > 1:
        BLOCK = 1024
        _sum_splits[(triton.cdiv(M * N, BLOCK),)](
            part, bias if bias is not None else part, out, M * N, N, split,
            HAS_BIAS=bias is not None, BLOCK=BLOCK, num_warps=4,
        )
    return out


def _unit_stride(t):
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def linear_decode(x, weight, bias=None, cfg=None):
    """``F.linear(x, weight, bias)`` for few rows, streaming the weight once.

    x: (..., K); weight: (N, K) with unit stride on K (nn.Linear's layout); bias: (N,) or None;
    all one dtype (float16, bfloat16 or float32). Returns (..., N) in x's dtype, sums in float32.
    Meant for at most MAX_ROWS rows (prod of x's leading dims); more rows work, each further
    block of rows re-reading the weight. ``cfg`` overrides entries of CFG (tests, tuning).
    """
    K = x.shape[-1]
    N = weight.shape[0]
    if weight.shape[-1] != K:
        raise ValueError(f"x has {K} features, weight is {tuple(weight.shape)}")
    M = math.prod(x.shape[:-1])
    x2 = _unit_stride(x.reshape(M, K))
    weight, bias = _unit_stride(weight), _unit_stride(bias)
    out = torch.empty((*x.shape[:-1], N), device=x.device, dtype=x.dtype)
    if M == 0 or N == 0:
        return out
    c = _config(M, N, K, sm_count(x.device), CFG if cfg is None else {**CFG, **cfg})
    return _launch(x2, weight, bias, out, M, N, K, c)


def gated_rmsnorm_linear(y, z, norm_weight, eps, group_size, weight, bias=None, cfg=None):
    """Mamba-2's gated RMSNorm then out_proj in one weight pass, as ``gated_rmsnorm_linear_ref``:
    ``F.linear(rmsnorm_gated(y, norm_weight, z, eps, group_size), weight, bias)``.

    y, z: (..., K); norm_weight: (K,); group_size divides K (None: K); weight: (N, K); bias: (N,) or
    None; y, z, weight, bias one dtype (float16, bfloat16 or float32), norm_weight any float dtype.
    Returns (..., N) in y's dtype. The normalised input is never rounded to y's dtype (float32 on the
    FMA path), so this is, if anything, closer to exact than the two-kernel composition. Meant for at
    most MAX_ROWS rows, as ``linear_decode``; where no plan keeps tiles within norm groups (group_size
    not a multiple of 16) it runs the composition (norm kernel, then ``linear_decode``).
    """
    K = y.shape[-1]
    N = weight.shape[0]
    gs = K if group_size is None else int(group_size)
    if z.shape != y.shape or norm_weight.shape != (K,) or weight.shape[-1] != K:
        raise ValueError(f"y {tuple(y.shape)}, z {tuple(z.shape)}, norm_weight {tuple(norm_weight.shape)}, "
                         f"weight {tuple(weight.shape)} do not agree")
    if gs <= 0 or K % gs:
        raise ValueError(f"group_size {gs} does not divide {K}")
    M = math.prod(y.shape[:-1])
    out = torch.empty((*y.shape[:-1], N), device=y.device, dtype=y.dtype)
    if M == 0 or N == 0:
        return out
    c = _config(M, N, K, sm_count(y.device), CFG if cfg is None else {**CFG, **cfg}, group=gs)
    if c is None:
        from ssmq.kernels.norm import rmsnorm_gated

        return linear_decode(rmsnorm_gated(y, norm_weight, z, eps, gs), weight, bias, cfg)
    y2, z2 = _unit_stride(y.reshape(M, K)), _unit_stride(z.reshape(M, K))
    weight, bias, norm_weight = _unit_stride(weight), _unit_stride(bias), _unit_stride(norm_weight)
    return _launch(y2, weight, bias, out, M, N, K, c, gated=(z2, norm_weight, float(eps), gs))
