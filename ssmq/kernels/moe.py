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
int8, packed int4 and fp8 weight-only codes are converted in registers (code · scale in float32 rounded once to x's
dtype, the weight ``quant_linear_ref`` multiplies by; or, as the launch table chooses, converted in 16 bits and scaled
before or after the product: ``CFG``); for FP8 W8A8 (A_FP8) codes are multiplied as e4m3 by e4m3 activation codes
(x's rows quantized once before the up kernel, whatever expert a row goes to; h's rows before the down kernel), both
scales applied in the epilogue.

Glossary: t tokens, d model width, f expert hidden size, E experts, k experts per token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ssmq.errors import SSMQError
from ssmq.kernels import configs
from ssmq.kernels._common import along_n, cdiv, dot_precision, gdc_enter, pdl_args, pow2, silu, tile_zeros
from ssmq.kernels.gemm_parts import _i8_to_f16, _w_dot
from ssmq.kernels.qgemm_mid import _asm, _i4_half
from ssmq.kernels.quant_gemm import quantize_act
from ssmq.ops.moe import check_experts

# Launch settings by weight format and rows an expert (configs/moe.json): "float" weights, "fp8-w8a8", "float32" and
# "bfloat16" activations on weight-only codes, and weight-only "int8", "int4", "fp8" codes under float16. Each entry:
# max_rows (the mean (token, expert) pairs an expert, ceil(t·k / E), it serves), BM (rows a block, both launches) and
# the up / down launches' BN, BK (caps), warps, stages, and how codes become the product's operand:
#   CVT 0: code · scale in float32, rounded once to x's dtype (int4: each column's byte loaded on its own);
#   CVT 1: codes converted in 16 bits (int4 / int8 to fp16 by bit assembly on CUDA), times the scale rounded to 16
#          bits (the weight rounded twice), or with POST the float32 product scaled instead (per group after each
#          tile's product, per channel once at the end);
#   XS (int4, CVT 1): the x columns of the low / high nibbles, numbered as the GEMMs' X_SPLIT
#          (``gemm_parts._w4_dot``): 0 the weight tile's halves interleaved back into k order (one product), 1 two
#          strided loads, 2 the x tile split in registers;
#   SWAP (CVT 1): the product formed as h.T = W @ x.T, the weight tile the tensor-core instruction's M side.
CFG = configs.load("moe")
BLOCK_M = 16  # rows a block of the tables' default (and of the float entries)


def _key(x_dtype: torch.dtype, mode: int, act_fp8: bool) -> str:
    """The table a call reads: its weight format, or for weight-only codes under float32 / bfloat16 activations
    their dtype (the int8 / int4 / fp8 entries were timed under float16)."""
    if mode == 0:
        return "float"
    if act_fp8:
        return "fp8-w8a8"
    if x_dtype in (torch.float32, torch.bfloat16):
        return str(x_dtype).removeprefix("torch.")
    return {1: "int8", 2: "int4", 3: "fp8"}[mode]


def launch_settings(x_dtype: torch.dtype, mode: int, act_fp8: bool, rows: int, cfg: dict | None = None) -> dict:
    """The table's entry for a weight format (W_MODE ``mode``) and ``rows`` (token, expert) pairs an expert on
    average: the first whose max_rows holds, else the last."""
    table = (cfg or CFG)[_key(x_dtype, mode, act_fp8)]
    return next((e for e in table if e["max_rows"] is None or rows <= e["max_rows"]), table[-1])


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
    b = torch.arange(cdiv(n, block_m) + n_experts, device=dev)
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
    product takes it under CVT 0: float as stored; codes (W_MODE 1 int8, 2 packed int4, 3 fp8 as raw bytes) times
    their scale (s_row + the group of k0) rounded to OP; e4m3 as stored with A_FP8 (its per-channel scale applied in
    the epilogue)."""
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
def _mm(a, w, acc, A_FP8: tl.constexpr, PRECISION: tl.constexpr, SWAP: tl.constexpr):
    """acc + a (BM, K) @ w (BN, K).T, or with SWAP acc + w @ a.T (acc (BN, BM))."""
    if A_FP8:  # e4m3 x e4m3, float32 accumulation (no reduced-precision accumulation on sm_90): exact products. At
        # 16-row tiles the sm_90 build multiplies them as fp16 (the codes widened exactly) on the fp16 MMA
        acc = tl.dot(a, tl.trans(w), acc, max_num_imprecise_acc=0)
    else:
        acc = _w_dot(w, a, acc, SWAP, tl.float32, PRECISION)
    return acc


@triton.jit
def _scaled(acc, rs, s_ptr, s_row, mn):
    """The epilogue of a product on codes: acc (BM, BN) times (row scale rs (BM,) x channel scale (BN,) at s_ptr +
    s_row)."""
    return acc * (rs[:, None] * tl.load(s_ptr + s_row, mask=mn, other=0.0)[None, :])


@triton.jit
def _k_step(acc, x_ptr, xq_ptr, x_row, mr, w_ptr, w_row, s_ptr, s_row, offs_k, k0, width, group, mn,
            W_MODE: tl.constexpr, A_FP8: tl.constexpr, PRECISION: tl.constexpr, CVT: tl.constexpr,
            POST: tl.constexpr, XS: tl.constexpr, SWAP: tl.constexpr, BF16: tl.constexpr, FAST_I8: tl.constexpr,
            ASM_LO: tl.constexpr, ASM_HI: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc plus the product of the rows at x_row (BM,) (mask mr) by the weight tile at columns k0 .. k0 + BLOCK_K of
    the rows at w_row (BN, 1) (mask mn; ``width`` columns in all). CVT, XS, SWAP: the comment above ``CFG``; POST: 0
    none, 1 per group after this tile's product, 2 per channel (left to the epilogue)."""
    OP = x_ptr.dtype.element_ty
    mk = offs_k < width - k0
    if CVT == 0:
        xv = _x_tile(x_ptr, xq_ptr, x_row[:, None] + k0 + offs_k[None, :], mr[:, None] & mk[None, :], A_FP8)
        w = _w_tile(w_ptr, w_row, s_ptr, s_row, offs_k, k0, group, mn, mk, W_MODE, A_FP8, OP)
        acc = _mm(xv, w, acc, A_FP8, PRECISION, SWAP)
    else:
        BN: tl.constexpr = w_row.shape[0]
        s = tl.load(s_ptr + s_row + k0 // group, mask=mn, other=0.0)
        if POST == 1:
            part = tl.zeros(acc.shape, dtype=tl.float32)
        else:
            part = acc
        if W_MODE == 2:
            KH: tl.constexpr = BLOCK_K // 2
            offs_h = tl.arange(0, KH)
            mh = offs_h < (width - k0) // 2
            wb = tl.load(w_ptr + w_row + k0 // 2 + offs_h[None, :], mask=mn[:, None] & mh[None, :],
                         other=0).to(tl.int8, bitcast=True)
            s16 = tl.broadcast_to(s.to(OP)[:, None], (BN, KH))
            lo = _i4_half(wb, s16, ASM_LO, False, BF16, POST == 0)
            hi = _i4_half(wb, s16, ASM_HI, True, BF16, POST == 0)
            if XS == 0:  # back in k order: one product with the contiguous x tile
                w = tl.reshape(tl.join(lo, hi), (BN, BLOCK_K))
                xv = tl.load(x_ptr + x_row[:, None] + k0 + offs_k[None, :], mask=mr[:, None] & mk[None, :],
                             other=0.0)
                part = _mm(xv, w, part, False, PRECISION, SWAP)
            else:
                if XS == 1:
                    xm = mr[:, None] & mh[None, :]
                    xe = tl.load(x_ptr + x_row[:, None] + k0 + 2 * offs_h[None, :], mask=xm, other=0.0)
                    xo = tl.load(x_ptr + x_row[:, None] + k0 + 2 * offs_h[None, :] + 1, mask=xm, other=0.0)
                else:
                    xv = tl.load(x_ptr + x_row[:, None] + k0 + offs_k[None, :], mask=mr[:, None] & mk[None, :],
                                 other=0.0)
                    xe, xo = tl.split(tl.reshape(xv, (xv.shape[0], KH, 2)))
                part = _mm(xe, lo, part, False, PRECISION, SWAP)
                part = _mm(xo, hi, part, False, PRECISION, SWAP)
        else:
            q = tl.load(w_ptr + w_row + k0 + offs_k[None, :], mask=mn[:, None] & mk[None, :], other=0)
            if W_MODE == 3:
                w = q.to(tl.float8e4nv, bitcast=True).to(OP)
            elif FAST_I8:
                w = _i8_to_f16(q)
            else:
                w = q.to(OP)
            if POST == 0:
                w = w * s.to(OP)[:, None]
            xv = tl.load(x_ptr + x_row[:, None] + k0 + offs_k[None, :], mask=mr[:, None] & mk[None, :], other=0.0)
            part = _mm(xv, w, part, False, PRECISION, SWAP)
        if POST == 1:
            acc += part * along_n(s, SWAP)
        else:
            acc = part
    return acc


@triton.jit
def _moe_up(
    x_ptr, xq_ptr, xs_ptr, wg_ptr, wu_ptr, sg_ptr, su_ptr, h_ptr, order_ptr, be_ptr, bs_ptr, bend_ptr,
    d, f, k, s_xt, s_we, s_wf, s_se, n_groups, group, s_ht,
    GATED: tl.constexpr, W_MODE: tl.constexpr, A_FP8: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CVT: tl.constexpr = 0,
    POST: tl.constexpr = 0, XS: tl.constexpr = 2, SWAP: tl.constexpr = False, BF16: tl.constexpr = False,
    FAST_I8: tl.constexpr = False, ASM_LO: tl.constexpr = "", ASM_HI: tl.constexpr = "",
    USE_GDC: tl.constexpr = False,
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
    x_row = tok * s_xt
    w_row = e * s_we + offs_n.to(tl.int64)[:, None] * s_wf
    s_row = e * s_se + offs_n.to(tl.int64) * n_groups
    dt = h_ptr.dtype.element_ty
    acc_u = tile_zeros(BLOCK_M, BLOCK_N, tl.float32, SWAP)
    acc_g = tile_zeros(BLOCK_M, BLOCK_N, tl.float32, SWAP)
    k_len = tl.where(nonempty, d, 0)  # an empty block (past the last) runs no iteration
    for k0 in range(0, k_len, BLOCK_K):
        acc_u = _k_step(acc_u, x_ptr, xq_ptr, x_row, mr, wu_ptr, w_row, su_ptr, s_row, offs_k, k0, d, group, mn,
                        W_MODE, A_FP8, PRECISION, CVT, POST, XS, SWAP, BF16, FAST_I8, ASM_LO, ASM_HI, BLOCK_K)
        if GATED:
            acc_g = _k_step(acc_g, x_ptr, xq_ptr, x_row, mr, wg_ptr, w_row, sg_ptr, s_row, offs_k, k0, d, group, mn,
                            W_MODE, A_FP8, PRECISION, CVT, POST, XS, SWAP, BF16, FAST_I8, ASM_LO, ASM_HI, BLOCK_K)
    if SWAP:
        acc_u = tl.trans(acc_u)
        acc_g = tl.trans(acc_g)
    if A_FP8 or POST == 2:  # the codes' product times the row scale (FP8 W8A8: x's; weight-only: 1) and w's channel
        # scale: quant_linear_ref's fp8 product Σ x_q · w_q · x_s · w_s, or a per-channel weight-only one
        if A_FP8:
            xs = tl.load(xs_ptr + tok, mask=mr, other=0.0)
        else:
            xs = tl.full((BLOCK_M,), 1.0, tl.float32)
        acc_u = _scaled(acc_u, xs, su_ptr, s_row, mn)
        if GATED:
            acc_g = _scaled(acc_g, xs, sg_ptr, s_row, mn)
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
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CVT: tl.constexpr = 0,
    POST: tl.constexpr = 0, XS: tl.constexpr = 2, SWAP: tl.constexpr = False, BF16: tl.constexpr = False,
    FAST_I8: tl.constexpr = False, ASM_LO: tl.constexpr = "", ASM_HI: tl.constexpr = "",
    USE_GDC: tl.constexpr = False,
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
    h_row = rows.to(tl.int64) * s_ht
    w_row = e * s_we + offs_n.to(tl.int64)[:, None] * s_wd
    s_row = e * s_se + offs_n.to(tl.int64) * n_groups
    dt = h_ptr.dtype.element_ty
    acc = tile_zeros(BLOCK_M, BLOCK_N, tl.float32, SWAP)
    k_len = tl.where(nonempty, f, 0)
    for k0 in range(0, k_len, BLOCK_K):
        acc = _k_step(acc, h_ptr, hq_ptr, h_row, mr, wd_ptr, w_row, sd_ptr, s_row, offs_k, k0, f, group, mn,
                      W_MODE, A_FP8, PRECISION, CVT, POST, XS, SWAP, BF16, FAST_I8, ASM_LO, ASM_HI, BLOCK_K)
    if SWAP:
        acc = tl.trans(acc)
    if A_FP8 or POST == 2:
        if A_FP8:
            hs = tl.load(hs_ptr + rows, mask=mr, other=0.0)
        else:
            hs = tl.full((BLOCK_M,), 1.0, tl.float32)
        acc = _scaled(acc, hs, sd_ptr, s_row, mn)
    rw = tl.load(rw_ptr + pair, mask=mr, other=0.0).to(tl.float32)
    y = acc.to(dt).to(tl.float32) * rw[:, None]
    tl.store(y_ptr + pair[:, None] * s_yp + offs_n[None, :], y, mask=mr[:, None] & mn[None, :])


_W_MODES = {torch.int8: 1, torch.uint8: 2, torch.float8_e4m3fn: 3}  # other (float) weights: 0


def _weights(w, s, width: int, fp8: bool):
    """A stack of weights for a kernel: (tensor, scales (E, out, groups), groups, group size, largest BLOCK_K). fp8
    codes travel as raw bytes; BLOCK_K divides the group (a tile reads one scale a row)."""
    w = w.contiguous()
    bk = pow2(width, 32 if fp8 else 16)
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


def launch_consts(launch: dict, x_dtype: torch.dtype, cuda: bool, mode: int, act_fp8: bool, groups: int,
                  bk_max: int, n: int) -> dict:
    """The constexprs and launch keywords of one kernel from a table entry's ``up`` / ``down`` settings (n: the
    kernel's output columns, bk_max: ``_weights``' largest BLOCK_K)."""
    bk = min(launch["BK"], bk_max)
    # int4 tiles of fewer than 32 columns (groups of 16) keep the float32 conversion: the 16-bit one gave wrong
    # results on an H100 there (8-byte tile rows), packed by bit assembly or not
    cvt = int(launch.get("CVT", 0) and mode != 0 and not act_fp8 and x_dtype != torch.float32
              and not (mode == 2 and bk < 32))
    xs = launch.get("XS", 2)
    bf16 = x_dtype == torch.bfloat16
    post = (1 if groups > 1 else 2) if cvt and launch.get("POST", False) else 0
    bn = min(launch["BN"], pow2(n, 16))
    # the bit assembly converts 4 codes a register: a thread must hold at least 4 of the tile's codes (with fewer,
    # the sm_90 build packs values of other positions)
    packed = cuda and cvt and bn * (bk // 2 if mode == 2 else bk) >= 4 * 32 * launch["warps"]
    asm = packed and mode == 2
    return dict(BLOCK_N=bn, BLOCK_K=bk, CVT=cvt, POST=post, XS=xs,
                SWAP=bool(cvt and launch.get("SWAP", False)), BF16=bf16,
                FAST_I8=bool(packed and mode == 1 and x_dtype == torch.float16),
                ASM_LO=_asm(False, bf16, post == 0) if asm else "", ASM_HI=_asm(True, bf16, post == 0) if asm else "",
                num_warps=launch["warps"], num_stages=launch.get("stages", 3))


def moe_experts(x, weights, idx, w_up, w_down, w_gate=None, act="silu", w_scales=None, act_fp8=False, cfg=None):
    """As ``moe_experts_ref``: x (t, d), weights (t, k) float32, idx (t, k), w_up / w_gate (E, f, d), w_down (E, d, f)
    (quantized: codes and ``w_scales`` as ``ops.moe`` lays them out; ``act_fp8``: FP8 W8A8) -> (t, d) in x's dtype.
    cfg: launch settings in place of ``CFG`` (a tuner's candidates)."""
    check_experts(w_up, w_down, w_gate, act, w_scales, act_fp8)
    t, d = x.shape
    k = idx.shape[1]
    E, f = w_up.shape[:2]
    x = x if x.stride(-1) == 1 else x.contiguous()
    if t == 0:
        return torch.empty(0, d, device=x.device, dtype=x.dtype)
    s_up, s_down, s_gate = w_scales or (None, None, None)
    mode = _W_MODES.get(w_up.dtype, 0)
    entry = launch_settings(x.dtype, mode, act_fp8, -(-t * k // E), cfg)
    w_up, s_up, groups_up, group_up, bk_up = _weights(w_up, s_up, d, act_fp8)
    if w_gate is not None:
        w_gate, s_gate, *_ = _weights(w_gate, s_gate, d, act_fp8)
    w_down, s_down, groups_dn, group_dn, bk_dn = _weights(w_down, s_down, f, act_fp8)
    bm = entry["BM"]
    order, blk_e, blk_s, blk_end = block_tables(idx, E, bm)
    h = torch.empty(t * k, f, device=x.device, dtype=x.dtype)  # sorted by expert
    y = torch.empty(t * k, d, device=x.device, dtype=torch.float32)  # each pair's row, routing weight applied
    rw = weights.reshape(-1).float().contiguous()
    xq, xs = quantize_act(x, None, True, torch.float8_e4m3fn) if act_fp8 else (x, rw)
    precision = dot_precision(x.dtype)
    n_blocks = blk_e.numel()
    up = launch_consts(entry["up"], x.dtype, x.is_cuda, mode, act_fp8, groups_up, bk_up, f)
    _moe_up[(n_blocks, cdiv(f, up["BLOCK_N"]))](
        x, xq.view(torch.int8) if act_fp8 else x, xs, w_up if w_gate is None else w_gate, w_up,
        s_up if s_gate is None else s_gate, s_up, h, order, blk_e, blk_s, blk_end,
        d, f, k, xq.stride(0), w_up.stride(0), w_up.stride(1), s_up.stride(0), groups_up, group_up, h.stride(0),
        GATED=w_gate is not None, W_MODE=mode, A_FP8=act_fp8, PRECISION=precision, BLOCK_M=bm, **up, **pdl_args(x),
    )
    hq, hs = quantize_act(h, None, True, torch.float8_e4m3fn) if act_fp8 else (h, rw)
    dn = launch_consts(entry["down"], x.dtype, x.is_cuda, mode, act_fp8, groups_dn, bk_dn, d)
    _moe_down[(n_blocks, cdiv(d, dn["BLOCK_N"]))](
        h, hq.view(torch.int8) if act_fp8 else h, hs, w_down, s_down, rw, y, order, blk_e, blk_s, blk_end,
        d, f, h.stride(0), w_down.stride(0), w_down.stride(1), s_down.stride(0), groups_dn, group_dn, y.stride(0),
        W_MODE=mode, A_FP8=act_fp8, PRECISION=precision, BLOCK_M=bm, **dn, **pdl_args(x),
    )
    return y.view(t, k, d).sum(1).to(x.dtype)
