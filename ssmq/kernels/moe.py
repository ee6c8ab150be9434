"""Grouped GEMM for the experts of a mixture of experts, with top-k routing: ``ops.moe.moe_experts_ref`` on the GPU.

The t·k (token, expert) pairs are sorted by expert and cut into blocks of BLOCK_M rows that each belong to one expert
(an expert's last block partly filled). One launch computes every block's [gate | up] product, activation and gate
(``_moe_up``: the rows of x gathered by token, h written in sorted order), a second its down product times the routing
weight (``_moe_down``: written back to the pair's own row); the k rows of a token are then summed in float32. Every
expert's weight tile is read once per block of its tokens, instead of once per expert module and token group as the
reference's loop does, and nothing depends on the routing on the host: the block tables are built on the device and the
grid is sized for the worst case (ceil(t·k / BLOCK_M) + E blocks, those past the last holding no rows), so a CUDA
graph captures it.

Glossary: t tokens, d model width, f expert hidden size, E experts, k experts per token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ssmq.kernels._common import dot_precision, gdc_enter, pdl_args, pow2, silu
from ssmq.ops.moe import MOE_ACTS

BLOCK_M = 16  # (token, expert) rows a block: decode routes a handful of tokens to each expert


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
def _moe_up(
    x_ptr, wg_ptr, wu_ptr, h_ptr, order_ptr, be_ptr, bs_ptr, bend_ptr,
    d, f, k, s_xt, s_we, s_wf, s_ht,
    GATED: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr = False,
):
    gdc_enter(USE_GDC)
    e, rows, mr, nonempty = _expert_block(be_ptr, bs_ptr, bend_ptr, BLOCK_M)
    pid_n = tl.program_id(1)
    tok = (tl.load(order_ptr + rows, mask=mr, other=0) // k).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mn = offs_n < f
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tok[:, None] * s_xt + offs_k[None, :]
    w_off = e * s_we + offs_n.to(tl.int64)[:, None] * s_wf + offs_k[None, :]
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_len = tl.where(nonempty, d, 0)  # an empty block (past the last) runs no iteration
    for k0 in range(0, k_len, BLOCK_K):
        mk = offs_k < d - k0
        xv = tl.load(x_ptrs + k0, mask=mr[:, None] & mk[None, :], other=0.0)
        wu = tl.load(wu_ptr + w_off + k0, mask=mn[:, None] & mk[None, :], other=0.0)
        acc_u = tl.dot(xv, tl.trans(wu), acc_u, input_precision=PRECISION)
        if GATED:
            wg = tl.load(wg_ptr + w_off + k0, mask=mn[:, None] & mk[None, :], other=0.0)
            acc_g = tl.dot(xv, tl.trans(wg), acc_g, input_precision=PRECISION)
    dt = h_ptr.dtype.element_ty
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
    h_ptr, wd_ptr, rw_ptr, y_ptr, order_ptr, be_ptr, bs_ptr, bend_ptr,
    d, f, s_ht, s_we, s_wd, s_yp,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_GDC: tl.constexpr = False,
):
    gdc_enter(USE_GDC)
    e, rows, mr, nonempty = _expert_block(be_ptr, bs_ptr, bend_ptr, BLOCK_M)
    pid_n = tl.program_id(1)
    pair = tl.load(order_ptr + rows, mask=mr, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mn = offs_n < d
    offs_k = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + rows.to(tl.int64)[:, None] * s_ht + offs_k[None, :]
    w_ptrs = wd_ptr + e * s_we + offs_n.to(tl.int64)[:, None] * s_wd + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_len = tl.where(nonempty, f, 0)
    for k0 in range(0, k_len, BLOCK_K):
        mk = offs_k < f - k0
        hv = tl.load(h_ptrs + k0, mask=mr[:, None] & mk[None, :], other=0.0)
        w = tl.load(w_ptrs + k0, mask=mn[:, None] & mk[None, :], other=0.0)
        acc = tl.dot(hv, tl.trans(w), acc, input_precision=PRECISION)
    rw = tl.load(rw_ptr + pair, mask=mr, other=0.0).to(tl.float32)
    y = acc.to(h_ptr.dtype.element_ty).to(tl.float32) * rw[:, None]
    tl.store(y_ptr + pair[:, None] * s_yp + offs_n[None, :], y, mask=mr[:, None] & mn[None, :])


def moe_experts(x, weights, idx, w_up, w_down, w_gate=None, act="silu"):
    """As ``moe_experts_ref``: x (t, d), weights (t, k) float32, idx (t, k), w_up / w_gate (E, f, d), w_down (E, d, f)
    -> (t, d) in x's dtype."""
    if act not in MOE_ACTS or (w_gate is None) != (act == "relu2"):
        raise ValueError(f"act {act!r} with{'out' if w_gate is None else ''} a gate: expected silu with a gate or "
                         "relu2 without")
    t, d = x.shape
    k = idx.shape[1]
    E, f, _ = w_up.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    w_up, w_down = w_up.contiguous(), w_down.contiguous()
    w_gate = None if w_gate is None else w_gate.contiguous()
    if t == 0:
        return torch.empty(0, d, device=x.device, dtype=x.dtype)
    order, blk_e, blk_s, blk_end = block_tables(idx, E)
    h = torch.empty(t * k, f, device=x.device, dtype=x.dtype)  # sorted by expert
    y = torch.empty(t * k, d, device=x.device, dtype=torch.float32)  # each pair's row, routing weight applied
    rw = weights.reshape(-1).float().contiguous()
    precision = dot_precision(x.dtype)
    n_blocks = blk_e.numel()
    bn_up, bk_up = min(64, pow2(f, 16)), min(64, pow2(d, 16))
    _moe_up[(n_blocks, triton.cdiv(f, bn_up))](
        x, w_up if w_gate is None else w_gate, w_up, h, order, blk_e, blk_s, blk_end,
        d, f, k, x.stride(0), w_up.stride(0), w_up.stride(1), h.stride(0),
        GATED=w_gate is not None, PRECISION=precision, BLOCK_M=BLOCK_M, BLOCK_N=bn_up, BLOCK_K=bk_up, num_warps=4,
        **pdl_args(x),
    )
    bn_dn, bk_dn = min(64, pow2(d, 16)), min(64, pow2(f, 16))
    _moe_down[(n_blocks, triton.cdiv(d, bn_dn))](
        h, w_down, rw, y, order, blk_e, blk_s, blk_end,
        d, f, h.stride(0), w_down.stride(0), w_down.stride(1), y.stride(0),
        PRECISION=precision, BLOCK_M=BLOCK_M, BLOCK_N=bn_dn, BLOCK_K=bk_dn, num_warps=4, **pdl_args(x),
    )
    return y.view(t, k, d).sum(1).to(x.dtype)
