"""Grouped GEMM for the experts of a mixture of experts, with top-k routing: ``ops.moe.moe_experts_ref`` on the GPU.

The t·k (token, expert) pairs are sorted by expert and cut into blocks of BLOCK_M rows that each belong to one expert
(an expert's last block partly filled). One launch computes every block's [gate | up] product, activation and gate
(``_moe_up``: the rows of x gathered by token, h written in sorted order), a second its down product times the routing
weight (``_moe_down``: written back to the pair's own row); the k rows of a token are then summed in float32. Every
expert's weight tile is read once per block of its tokens, instead of once per expert module and token group as the
reference's loop does, and nothing depends on the routing on the host: the block tables are built on the device and the
grid is sized for the worst case (ceil(t·k / BLOCK_M) + E blocks, those past the last holding no rows), so a CUDA
graph captures it.

The weight format (``ops.moe``'s table) is a parameter of both kernels (W_MODE): float tiles are read as they are;
int8 and packed int4 codes are dequantized in registers to x's dtype (code · scale in float32, rounded once: the
weight ``quant_linear_ref`` multiplies by) before the product; fp8 codes likewise with float x, or, for FP8 W8A8
(A_FP8), multiplied as e4m3 by e4m3 activation codes (x's rows quantized once before the up kernel, whatever expert
a row goes to; h's rows before the down kernel), both scales applied in the epilogue.

Glossary: t tokens, d model width, f expert hidden size, E experts, k experts per token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ssmq.errors import SSMQError
from ssmq.kernels._common import dot_precision, gdc_enter, pdl_args, pow2, silu
from ssmq.kernels.quant_gemm import quantize_act
from ssmq.ops.moe import check_experts

BLOCK_M = 16  # (token, expert) rows a block: decode routes a handful of tokens to each expert


def launch_shape(x_dtype: torch.dtype, quantized: bool) -> tuple[int, int]:
    """(largest BLOCK_N / BLOCK_K, warps) of both launches. Quantized weights take 8 warps (with 4, the sm_90 build of
    the up kernel on int8 / fp8 codes spills 1.2 KB a thread), and 32-wide tiles under float32 activations (64-wide
    ones spill); no quantized launch spills (tests/test_kernel_compile.py)."""
    if not quantized:
        return 64, 4
    return (32 if x_dtype == torch.float32 else 64), 8


def block_tables(idx: torch.Tensor, n_experts: int, block_m: int = BLOCK_M):
    """idx (t, k) -> (order (t·k,) the pairs sorted by expert, as indices into idx.flatten(); per block of the grid:
    expert (B,), first and end row in ``order`` (B,), int32), B = ceil(t·k / block_m) + E. Device ops only."""
    flat = idx.reshape(-1).long()
    n, dev = flat.numel(), flat.device
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(n_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    n_blocks = (counts + block_m - 1) // block_m
    blocks_to = torch.cumsum(n_blocks, 0)  # one past each expert's last block
    rows_from = torch.cumsum(counts, 0) - counts  # each expert's first row in the sorted pairs
    b = torch.arange(triton.cdiv(n, block_m) + n_experts, device=dev)
    e = torch.searchsorted(blocks_to, b, right=True)  # E for the blocks past the last
    valid = e < n_experts
    e = e.clamp(max=n_experts - 1)
    start = rows_from[e] + (b - (blocks_to[e] - n_blocks[e])) * block_m
    end = torch.minimum(start + block_m, rows_from[e] + counts[e])
    start, end = torch.where(valid, start, 0), torch.where(valid, end, 0)
    return order, e.to(torch.int32), start.to(torch.int32), end.to(torch.int32)


@triton.jit
def _expert_block(be_ptr, bs_ptr, bend_ptr, BLOCK_M: tl.constexpr):
    """This program's block of (token, expert) pairs: its expert, its rows in ``order``, their mask, and whether it
    has any (blocks past the last one are empty)."""
    blk = tl.program_id(0)
    start, end = tl.load(bs_ptr + blk), tl.load(bend_ptr + blk)
    rows = start + tl.arange(0, BLOCK_M)
    return tl.load(be_ptr + blk).to(tl.int64), rows, rows < end, start < end


@triton.jit
def _w_tile(w_ptr, w_row, s_ptr, s_row, offs_k, k0, group, mn, mk, W_MODE: tl.constexpr, A_FP8: tl.constexpr,
            OP: tl.constexpr):
    """The (BLOCK_N, BLOCK_K) weight tile at columns k0 + offs_k of the rows at w_row (mask mn, columns mk), as the
    product takes it: float as stored; codes (W_MODE 1 int8, 2 packed int4, 3 fp8 as raw bytes) times their scale
    (s_row + the group of k0) rounded to OP; e4m3 as stored with A_FP8 (its per-channel scale applied in the
    epilogue)."""
    mask = mn[:, None] & mk[None, :]
    if W_MODE == 2:  # byte j holds column 2j in its low nibble, 2j + 1 in its high one, two's complement
        b = tl.load(w_ptr + w_row + (k0 + offs_k[None, :]) // 2, mask=mask, other=0).to(tl.int32)
        nib = (b >> ((offs_k[None, :] % 2) * 4)) & 15
        q = nib - ((nib & 8) << 1)
    else:
        q = tl.load(w_ptr + w_row + k0 + offs_k[None, :], mask=mask, other=0)
    if W_MODE == 3:
        q = q.to(tl.float8e4nv, bitcast=True)
    if W_MODE == 0 or A_FP8:
        w = q
    else:
        s = tl.load(s_ptr + s_row + k0 // group, mask=mn, other=0.0)
        w = (q.to(tl.float32) * s[:, None]).to(OP)
    return w


@triton.jit
def _x_tile(x_ptr, xq_ptr, off, mask, A_FP8: tl.constexpr):
    """A tile of the rows multiplied: float, or e4m3 codes (raw bytes) with A_FP8."""
    if A_FP8:
        v = tl.load(xq_ptr + off, mask=mask, other=0).to(tl.float8e4nv, bitcast=True)
    else:
        v = tl.load(x_ptr + off, mask=mask, other=0.0)
    return v


@triton.jit
def _dot(a, w, acc, A_FP8: tl.constexpr, PRECISION: tl.constexpr):
    if A_FP8:  # e4m3 x e4m3, float32 accumulation (no reduced-precision accumulation on sm_90): exact products. At
        # 16-row tiles the sm_90 build multiplies them as fp16 (the codes widened exactly) on the fp16 MMA
        acc = tl.dot(a, tl.trans(w), acc, max_num_imprecise_acc=0)
    else:
        acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _moe_up(
    x_ptr, xq_ptr, xs_ptr, wg_ptr, wu_ptr, sg_ptr, su_ptr, h_ptr, order_ptr, be_ptr, bs_ptr, bend_ptr,
    d, f, k, s_xt, s_we, s_wf, s_se, n_groups, group, s_ht,
    GATED: tl.constexpr, W_MODE: tl.constexpr, A_FP8: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr = False,
):
    # x_ptr: float x (t, d); with A_FP8 its e4m3 codes (raw bytes) at xq_ptr and per-token scales at xs_ptr are read
    # instead (s_xt: the row stride of the tensor read). Weights (E, f, d) (int4 (E, f, d // 2)) at strides s_we,
    # s_wf; scales (E, f, n_groups) at s_se, one a group of ``group`` columns (per channel: one group of d)
    gdc_enter(USE_GDC)
    e, rows, mr, nonempty = _expert_block(be_ptr, bs_ptr, bend_ptr, BLOCK_M)
    pid_n = tl.program_id(1)
    tok = (tl.load(order_ptr + rows, mask=mr, other=0) // k).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mn = offs_n < f
    offs_k = tl.arange(0, BLOCK_K)
    x_off = tok[:, None] * s_xt + offs_k[None, :]
    w_row = e * s_we + offs_n.to(tl.int64)[:, None] * s_wf
    s_row = e * s_se + offs_n.to(tl.int64) * n_groups
    dt = h_ptr.dtype.element_ty
    OP = x_ptr.dtype.element_ty
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_len = tl.where(nonempty, d, 0)  # an empty block (past the last) runs no iteration
    for k0 in range(0, k_len, BLOCK_K):
        mk = offs_k < d - k0
        xv = _x_tile(x_ptr, xq_ptr, x_off + k0, mr[:, None] & mk[None, :], A_FP8)
        wu = _w_tile(wu_ptr, w_row, su_ptr, s_row, offs_k, k0, group, mn, mk, W_MODE, A_FP8, OP)
        acc_u = _dot(xv, wu, acc_u, A_FP8, PRECISION)
        if GATED:
            wg = _w_tile(wg_ptr, w_row, sg_ptr, s_row, offs_k, k0, group, mn, mk, W_MODE, A_FP8, OP)
            acc_g = _dot(xv, wg, acc_g, A_FP8, PRECISION)
    if A_FP8:  # quant_linear_ref's fp8 product: Σ x_q · w_q, times x's row scale and w's channel scale
        xs = tl.load(xs_ptr + tok, mask=mr, other=0.0)
        acc_u = acc_u * (xs[:, None] * tl.load(su_ptr + s_row, mask=mn, other=0.0)[None, :])
        if GATED:
            acc_g = acc_g * (xs[:, None] * tl.load(sg_ptr + s_row, mask=mn, other=0.0)[None, :])
    # rounded where the reference's linears and activation round, to x's dtype
    u = acc_u.to(dt).to(tl.float32)
    if GATED:
        h = silu(acc_g.to(dt).to(tl.float32)).to(dt).to(tl.float32) * u
    else:
        h = tl.maximum(u, 0.0)
        h = h * h
    tl.store(h_ptr + rows.to(tl.int64)[:, None] * s_ht + offs_n[None, :], h.to(dt), mask=mr[:, None] & mn[None, :])


@triton.jit
def _moe_down(
    h_ptr, hq_ptr, hs_ptr, wd_ptr, sd_ptr, rw_ptr, y_ptr, order_ptr, be_ptr, bs_ptr, bend_ptr,
    d, f, s_ht, s_we, s_wd, s_se, n_groups, group, s_yp,
    W_MODE: tl.constexpr, A_FP8: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr = False,
):
    # h_ptr: the up kernel's h (t·k, f), whose dtype the product rounds to; with A_FP8 its codes at hq_ptr and row
    # scales at hs_ptr are read instead. Weights (E, d, f) (int4 (E, d, f // 2)), scales (E, d, n_groups)
    gdc_enter(USE_GDC)
    e, rows, mr, nonempty = _expert_block(be_ptr, bs_ptr, bend_ptr, BLOCK_M)
    pid_n = tl.program_id(1)
    pair = tl.load(order_ptr + rows, mask=mr, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mn = offs_n < d
    offs_k = tl.arange(0, BLOCK_K)
    h_off = rows.to(tl.int64)[:, None] * s_ht + offs_k[None, :]
    w_row = e * s_we + offs_n.to(tl.int64)[:, None] * s_wd
    s_row = e * s_se + offs_n.to(tl.int64) * n_groups
    dt = h_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_len = tl.where(nonempty, f, 0)
    for k0 in range(0, k_len, BLOCK_K):
        mk = offs_k < f - k0
        hv = _x_tile(h_ptr, hq_ptr, h_off + k0, mr[:, None] & mk[None, :], A_FP8)
        w = _w_tile(wd_ptr, w_row, sd_ptr, s_row, offs_k, k0, group, mn, mk, W_MODE, A_FP8, dt)
        acc = _dot(hv, w, acc, A_FP8, PRECISION)
    if A_FP8:
        hs = tl.load(hs_ptr + rows, mask=mr, other=0.0)
        acc = acc * (hs[:, None] * tl.load(sd_ptr + s_row, mask=mn, other=0.0)[None, :])
    rw = tl.load(rw_ptr + pair, mask=mr, other=0.0).to(tl.float32)
    y = acc.to(dt).to(tl.float32) * rw[:, None]
    tl.store(y_ptr + pair[:, None] * s_yp + offs_n[None, :], y, mask=mr[:, None] & mn[None, :])


_W_MODES = {torch.int8: 1, torch.uint8: 2, torch.float8_e4m3fn: 3}  # other (float) weights: 0


def _weights(w, s, width: int, fp8: bool, cap: int):
    """A stack of weights for a kernel: (tensor, scales (E, out, groups), groups, group size, BLOCK_K <= cap). fp8
    codes travel as raw bytes; BLOCK_K divides the group (a tile reads one scale a row)."""
    w = w.contiguous()
    bk = min(cap, pow2(width, 32 if fp8 else 16))
    if s is None:
        return w, w, 1, width, bk
    s = (s if s.dim() == 3 else s.unsqueeze(-1)).contiguous()
    groups = s.shape[2]
    group = width // groups
    if groups > 1:
        bk = min(bk, group & -group)  # the largest power of two dividing the group
        if bk < 16 or group * groups != width:
            raise SSMQError(f"grouped experts need groups of a multiple of 16 columns dividing {width}, got {group}")
    return (w.view(torch.int8) if w.dtype == torch.float8_e4m3fn else w), s, groups, group, bk


def moe_experts(x, weights, idx, w_up, w_down, w_gate=None, act="silu", w_scales=None, act_fp8=False):
    """As ``moe_experts_ref``: x (t, d), weights (t, k) float32, idx (t, k), w_up / w_gate (E, f, d), w_down (E, d, f)
    (quantized: codes and ``w_scales`` as ``ops.moe`` lays them out; ``act_fp8``: FP8 W8A8) -> (t, d) in x's dtype."""
    check_experts(w_up, w_down, w_gate, act, w_scales, act_fp8)
    t, d = x.shape
    k = idx.shape[1]
    E, f = w_up.shape[:2]
    x = x if x.stride(-1) == 1 else x.contiguous()
    s_up, s_down, s_gate = w_scales or (None, None, None)
    mode = _W_MODES.get(w_up.dtype, 0)
    cap, warps = launch_shape(x.dtype, mode != 0)
    w_up, s_up, groups_up, group_up, bk_up = _weights(w_up, s_up, d, act_fp8, cap)
    if w_gate is not None:
        w_gate, s_gate, *_ = _weights(w_gate, s_gate, d, act_fp8, cap)
    w_down, s_down, groups_dn, group_dn, bk_dn = _weights(w_down, s_down, f, act_fp8, cap)
    if t == 0:
        return torch.empty(0, d, device=x.device, dtype=x.dtype)
    order, blk_e, blk_s, blk_end = block_tables(idx, E)
    h = torch.empty(t * k, f, device=x.device, dtype=x.dtype)  # sorted by expert
    y = torch.empty(t * k, d, device=x.device, dtype=torch.float32)  # each pair's row, routing weight applied
    rw = weights.reshape(-1).float().contiguous()
    xq, xs = quantize_act(x, None, True, torch.float8_e4m3fn) if act_fp8 else (x, rw)
    precision = dot_precision(x.dtype)
    n_blocks = blk_e.numel()
    bn_up = min(cap, pow2(f, 16))
    _moe_up[(n_blocks, triton.cdiv(f, bn_up))](
        x, xq.view(torch.int8) if act_fp8 else x, xs, w_up if w_gate is None else w_gate, w_up,
        s_up if s_gate is None else s_gate, s_up, h, order, blk_e, blk_s, blk_end,
        d, f, k, xq.stride(0), w_up.stride(0), w_up.stride(1), s_up.stride(0), groups_up, group_up, h.stride(0),
        GATED=w_gate is not None, W_MODE=mode, A_FP8=act_fp8, PRECISION=precision, BLOCK_M=BLOCK_M, BLOCK_N=bn_up,
        BLOCK_K=bk_up, num_warps=warps, **pdl_args(x),
    )
    hq, hs = quantize_act(h, None, True, torch.float8_e4m3fn) if act_fp8 else (h, rw)
    bn_dn = min(cap, pow2(d, 16))
    _moe_down[(n_blocks, triton.cdiv(d, bn_dn))](
        h, hq.view(torch.int8) if act_fp8 else h, hs, w_down, s_down, rw, y, order, blk_e, blk_s, blk_end,
        d, f, h.stride(0), w_down.stride(0), w_down.stride(1), s_down.stride(0), groups_dn, group_dn, y.stride(0),
        W_MODE=mode, A_FP8=act_fp8, PRECISION=precision, BLOCK_M=BLOCK_M, BLOCK_N=bn_dn, BLOCK_K=bk_dn, num_warps=warps,
        **pdl_args(x),
    )
    return y.view(t, k, d).sum(1).to(x.dtype)
