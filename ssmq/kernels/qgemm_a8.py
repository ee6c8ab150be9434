"""W4A8 / W8A8 GEMM on int8 tensor cores (decode rows, serving batches, prefill): ``ops.quant_linear_ref`` for int8
activation codes x (m, k) with a per-tensor () or per-token (m,) scale, times symmetric int4 (packed) or int8 weight
codes with per-group, per-channel or per-tensor scales, bit for bit (``ops.quant_linear.int_matmul_ref``'s contract).

  - int4 codes become int8 tensor-core operands in registers, four bytes (eight codes) a register: each nibble moved
    to the high half of its byte (low nibble: one shift and one mask; high nibble: one mask) is the int8 16 q, in
    [-128, 112]. The int32 products of a tile are then 16x the codes' products, exact (|sum| < 2^31 for k < 2^17),
    and one arithmetic shift by 4 gives the codes' sums exactly.
  - per-group scales: each group of k (BLOCK_K == group) is one int32 product, converted to float32 exactly (an
    integer add and a float subtract of the magic number 1.5 * 2^23 where |sum| < 2^22, i.e. no quarter-rate I2F;
    ``MAGIC``; int4: the sums of 16 q converted as they are and s / 16 taken instead of s, the same product since
    a power of two scales exactly), scaled by s = x_scale * w_scale[:, t] (one a column for a per-tensor x scale)
    and added in group order, each product and sum rounded apart (compiled without FMA contraction):
    ``int_matmul_ref``'s epilogue, so no K split (it would reorder the sums). Instead, a narrow output takes
    narrower column tiles (``fill``), and ``GPS`` groups a loop step are independent products whose loads overlap.
    Per-channel / per-tensor scales: one int32 accumulator over all of k, scaled once at the end; K may be split
    there (int32 partials add exactly, ``gemm_parts._split_gather`` sums them in the last program of a tile).
  - ``SWAP``: the product is formed as out.T = W @ x.T, so the weight tile is the tensor-core instruction's M side
    (64 rows a warp group, operand from registers on Hopper) and x's rows its N side (16-256).
  - ``X_SPLIT`` (int4): 0 the weight tile's low / high codes interleaved back into k order (one product with the
    contiguous x tile), 1 the even / odd x columns loaded apart (two products), 2 a contiguous x tile split in
    registers (two products).

Launch settings per row range are ``configs/qgemm_a8.json``'s ROWS_W4 / ROWS_W8 (the first entry whose max_rows
holds); which row ranges run here is its ROUTE (``dispatch.quant_linear_a8_rows``), from measurements in its why.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ssmq.kernels import configs
from ssmq.kernels._common import (along_m, along_n, cdiv, gdc_enter, pdl_args, pow2, rows_entry, sm_count,
                                  tile_zeros, whole_loop_steps)
from ssmq.kernels.dispatch import quant_linear_a8_rows, select
from ssmq.kernels.launch import fast_launch
from ssmq.kernels.gemm_parts import _code_tiles, _out_offsets, _split_gather, _w4_dot, _w_dot, split_buffers
from ssmq.ops.quant_linear import code_type, weight_format

CFG = configs.load("qgemm_a8")  # launch settings and routes (configs/qgemm_a8.json)

# 16 q of each int4 code q of four packed bytes: the nibble in its byte's high half, the low half zero
_NIB_LO = tl.constexpr("{ .reg .b32 t; shl.b32 t, $1, 4; and.b32 $0, t, 0xF0F0F0F0; }")
_NIB_HI = tl.constexpr("and.b32 $0, $1, 0xF0F0F0F0;")


@triton.jit
def _nib16(wb, HI: tl.constexpr, PTX: tl.constexpr):
    """16 q for the low (HI: high) int4 code q of each packed byte of wb (int8, any shape), as int8. PTX: two (one)
    instructions for four bytes; else (the interpreter) the same bits by int8 shifts and masks."""
    if PTX:
        r = tl.inline_asm_elementwise(asm=_NIB_HI if HI else _NIB_LO, constraints="=r,r", args=[wb],
                                      dtype=tl.int8, is_pure=True, pack=4)
    else:
        r = ((wb & -16) if HI else (wb << 4)).to(tl.int8)
    return r


@triton.jit
def _i32_f32(v, MAGIC: tl.constexpr):
    """int32 v as float32, exactly: MAGIC (|v| < 2^22) by the bits of 1.5 * 2^23 + v less 1.5 * 2^23 (an integer
    add and a float subtract, both full rate), else by a conversion."""
    if MAGIC:
        r = (v + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0
    else:
        r = v.to(tl.float32)
    return r


@fast_launch
@triton.jit
def _a8_qmm(
    x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, part_ptr, cnt_ptr,
    M, N, K, k_split, n_groups, s_xm, s_wn, s_om,
    W4: tl.constexpr, WS_MODE: tl.constexpr, XS_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
    NSP: tl.constexpr, PTX: tl.constexpr, MAGIC: tl.constexpr, SWAP: tl.constexpr, X_SPLIT: tl.constexpr,
    GPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_GDC: tl.constexpr = False,
):
    # Program (tile, pid_k): an output tile over a k range (``gemm_parts._code_tiles``; K and k_split multiples of
    # GPS * BLOCK_K; per-group scales: BLOCK_K == group, one split). MAGIC (per-group sums to float32): 0 a
    # conversion, 1 the magic number (int4: on the shifted sums), 2 (int4) on the 16 q sums. WS_MODE: 0 per tensor,
    # 1 per channel, 2 per group. Accumulators are (BLOCK_N, BLOCK_M) with SWAP (out.T), else (BLOCK_M, BLOCK_N).
    gdc_enter(USE_GDC)  # PDL: see ssmq.kernels._common
    tile, pid_k, offs_m, offs_n, mm, mn, rows, cols, k_len, w_ptrs, x_ptrs, s_ptrs = _code_tiles(
        x_ptr, w_ptr, ws_ptr, M, N, K, k_split, n_groups, s_xm, s_wn, W4, X_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K)
    WK: tl.constexpr = BLOCK_K // 2 if W4 else BLOCK_K  # code bytes a weight row a step
    if XS_ROWS:
        xs = tl.load(xs_ptr + offs_m, mask=mm, other=0.0)
    else:
        xs = tl.load(xs_ptr + offs_m * 0)
    x0 = tl.load(xs_ptr)  # the per-tensor scale (XS_ROWS: unused)
    if WS_MODE == 2 and MAGIC == 2:  # 16 q sums scaled by s / 16: exact (a power of two), no shift a sum
        xs16 = xs * 0.0625
        x016 = x0 * 0.0625
    else:
        xs16 = xs
        x016 = x0
    acc = tile_zeros(BLOCK_M, BLOCK_N, tl.float32, SWAP)
    acc_i = tile_zeros(BLOCK_M, BLOCK_N, tl.int32, SWAP)
    for k in range(0, k_len, BLOCK_K * GPS):
        for g in tl.static_range(GPS):  # GPS independent tiles a step: their loads and products overlap
            w = tl.load(w_ptrs + g * WK, mask=mn[:, None], other=0).to(tl.int8, bitcast=True)
            if WS_MODE == 2:
                part = tl.zeros(acc_i.shape, dtype=tl.int32)  # this group's products alone
            else:
                part = acc_i
            if W4:
                part = _w4_dot(_nib16(w, False, PTX), _nib16(w, True, PTX), x_ptrs + g * BLOCK_K, mm, part, SWAP,
                               X_SPLIT, tl.int32, BLOCK_M, BLOCK_N, BLOCK_K)
            else:
                part = _w_dot(w, tl.load(x_ptrs + g * BLOCK_K, mask=mm[:, None], other=0), part, SWAP, tl.int32)
            if WS_MODE == 2:
                # int_matmul_ref's order: s_t = x_scale * w_scale[:, t]; out += float(acc_t) * s_t (MAGIC 2: the
                # 16 q sum times s_t / 16, the same product); a per-tensor x scale makes s_t one a column
                s = tl.load(s_ptrs + g, mask=mn, other=0.0)
                pf = _i32_f32(part if (MAGIC == 2 or not W4) else (part >> 4), MAGIC != 0)
                if XS_ROWS:
                    acc += pf * (along_m(xs16, SWAP) * along_n(s, SWAP))
                else:
                    acc += pf * along_n(x016 * s, SWAP)
            else:
                acc_i = part
        w_ptrs += WK * GPS
        x_ptrs += BLOCK_K * GPS
        s_ptrs += GPS
    p_off, o_off, mo, first = _out_offsets(offs_m, offs_n, rows, cols, mm, mn, N, s_om, SWAP)
    if WS_MODE != 2:  # per channel / per tensor: the exact int32 sum over k, scaled once
        if SPLIT:
            tl.store(part_ptr + pid_k * M * N + p_off, acc_i, mask=mo)
            acc_i, last = _split_gather(part_ptr, cnt_ptr, tile, tl.num_programs(1), M * N, p_off, mo, first, NSP)
            mo = mo & last[:, None]
        if WS_MODE == 1:
            sc = tl.load(ws_ptr + offs_n, mask=mn, other=0.0)
        else:
            sc = tl.load(ws_ptr + offs_n * 0)
        af = ((acc_i >> 4) if W4 else acc_i).to(tl.float32)
        acc = af * (along_m(xs, SWAP) * along_n(sc, SWAP))
    if HAS_BIAS:
        b = tl.load(b_ptr + offs_n, mask=mn, other=0.0).to(tl.float32)
        acc += along_n(b, SWAP)
    tl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty), mask=mo)


def _step_k(K: int, f: dict, e: dict) -> int | None:
    """The k a step (the group size for grouped codes), None when K or the group does not fit the kernel (K not a
    multiple of it, not a power of two of at least a tensor-core step of int8 codes a product (32; int4: 64, its
    two halves), at most 512)."""
    g = f["group_size"]
    BK = g if g is not None else min(e["BK"], pow2(K))
    if K % BK or BK & (BK - 1) or BK < (64 if f["bits"] == 4 else 32) or BK > 512:
        return None
    return BK


def _magic(f: dict, BK: int) -> int:
    """How a group's int32 sum becomes float32 (``_a8_qmm``'s MAGIC): 2 (int4) the sums of 16 q by the magic number
    (|sum| <= 16 * 128 * 8 * group < 2^22), 1 the codes' sums by it (|sum| <= 128 * max|code| * group < 2^22), else
    0 (a conversion; per-channel / per-tensor codes convert once, at the end)."""
    if f["group_size"] is None:
        return 0
    if f["bits"] == 4:
        return 2 if 16 * 128 * 8 * BK < 1 << 22 else int(128 * 8 * BK < 1 << 22)
    return int(128 * 128 * BK < 1 << 22)


def _plan(M: int, N: int, K: int, f: dict, sms: int, cfg: dict) -> dict:
    """Tiles, groups a step, K split and grid for M x (N, K) in format f (a layout ``_step_k`` accepts). The entry's
    BN halves (down to 16) while the tiles number fewer than ``fill`` x SMs: a narrow output (out_proj) gets more
    programs instead of a K split that per-group sums cannot take."""
    e = rows_entry(M, f["bits"], cfg)
    BK = _step_k(K, f, e)
    BM = min(e["BM"], pow2(M, 16))
    BN = e["BN"]
    while BN > 16 and cdiv(M, BM) * cdiv(N, BN) < e.get("fill", 0) * sms:
        BN //= 2
    tiles = cdiv(M, BM) * cdiv(N, BN)
    steps = K // BK
    split = 1
    if f["group_size"] is None:  # int32 partials add exactly; grouped sums keep their order (no split)
        split = max(1, min(cfg["MAX_SPLIT"], cdiv(int(e["waves"] * sms), tiles), K // cfg["MIN_SPLIT_K"], steps))
    gps, per, split = whole_loop_steps(steps, e.get("GPS", 1), split)
    return dict(BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GPS=gps, split=split, k_split=per * BK, tiles=tiles,
                grid=(tiles, split), num_warps=e["warps"], num_stages=e["stages"], SWAP=e["SWAP"],
                X_SPLIT=e["X_SPLIT"])


def _scale_ok(x_scale, lead) -> bool:
    return x_scale is not None and x_scale.dtype == torch.float32 and (
        x_scale.numel() == 1 or tuple(x_scale.shape) == tuple(lead))


def launch(x: torch.Tensor, w_q: torch.Tensor, f: dict, w_zero=None, x_scale=None, cfg=None, codes=None) -> dict:
    """The fields ``dispatch.quant_linear_a8_rows`` selects on: code type, x's dtype (``codes``: the dtype x will be
    quantized to), rows, zero points, and whether the layout fits (``fits``: int8 x of k features with unit column
    stride and a float32 scale () or one a row, stored integer codes with unit column stride, a tiling ``_plan``
    accepts)."""
    cfg = CFG if cfg is None else cfg
    M = math.prod(x.shape[:-1])
    K = f["k"]
    lead = x.shape[:-1]
    x_ok = codes is not None or (x.stride(-1) == 1 and _scale_ok(x_scale, lead))
    fits = (not f["fp8"] and x_ok and x.shape[-1] == K and w_q.stride(-1) == 1 and M > 0
            and _step_k(K, f, rows_entry(M, f["bits"], cfg)) is not None)
    dtype = codes if codes is not None else x.dtype
    return dict(code=code_type(f), x=str(dtype).removeprefix("torch."), rows=M,
                zero=w_zero is not None, fits=fits)


def serves(x: torch.Tensor, w_q, w_scale, w_zero=None, x_scale=None, cfg=None) -> dict | None:
    """``weight_format(w_q, w_scale, w_zero)`` when the selection table (``dispatch.quant_linear_a8_rows`` of CFG)
    sends this call here, else None."""
    if x.dtype != torch.int8:  # the table's first requirement, checked before the weight's format is read
        return None
    cfg = CFG if cfg is None else cfg
    f = weight_format(w_q, w_scale, w_zero)
    return f if select(quant_linear_a8_rows(cfg), launch(x, w_q, f, w_zero, x_scale, cfg)) == "qgemm_a8" else None


def serves_codes(x: torch.Tensor, w_q, w_scale, act_dtype, cfg=None) -> bool:
    """Whether float x (..., k), quantized to ``act_dtype`` codes (``quantize_act``: contiguous, a float32 scale),
    would be served here (``dispatch.quant_linear_act``)."""
    if act_dtype != torch.int8:
        return False
    cfg = CFG if cfg is None else cfg
    f = weight_format(w_q, w_scale)
    return select(quant_linear_a8_rows(cfg), launch(x, w_q, f, None, None, cfg, codes=act_dtype)) == "qgemm_a8"


def quant_linear_a8(x, x_scale, w_q, w_scale, f: dict | None = None, bias=None, out_dtype=None, cfg=None):
    """``ops.quant_linear_ref(x, w_q, w_scale, None, x_scale, bias, out_dtype)`` for int8 codes x (..., k) with a
    float32 scale () or x.shape[:-1], on symmetric int4 / int8 codes of format f (``weight_format``; a layout
    ``launch`` says fits): (..., n) in ``out_dtype`` (default float32)."""
    cfg = CFG if cfg is None else {**CFG, **cfg}
    f = f or weight_format(w_q, w_scale)
    M, K, N = math.prod(x.shape[:-1]), f["k"], f["n"]
    x2 = x.reshape(M, K)
    out = torch.empty((*x.shape[:-1], N), device=x.device, dtype=out_dtype or torch.float32)
    if M == 0 or N == 0:
        return out
    c = _plan(M, N, K, f, sm_count(x.device), cfg)
    split = c["split"]
    part, cnt = split_buffers(split, M, N, c["tiles"], x.device, torch.int32, out)
    ws_mode = 2 if w_scale.dim() == 2 else int(w_scale.dim() == 1)
    xs = x_scale.reshape(-1) if x_scale.numel() > 1 else x_scale.reshape(1)
    _a8_qmm[c["grid"]](
        x2, xs, w_q, w_scale, bias if bias is not None else w_scale, out.view(M, N), part, cnt,
        M, N, K, c["k_split"], w_scale.shape[1] if ws_mode == 2 else 1, x2.stride(0), w_q.stride(0), N,
        W4=f["bits"] == 4, WS_MODE=ws_mode, XS_ROWS=xs.numel() > 1,
        HAS_BIAS=bias is not None, SPLIT=split > 1, NSP=pow2(split), PTX=x.is_cuda, MAGIC=_magic(f, c["BLOCK_K"]),
        SWAP=c["SWAP"], X_SPLIT=c["X_SPLIT"], GPS=c["GPS"], BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"],
        BLOCK_K=c["BLOCK_K"], num_warps=c["num_warps"], num_stages=c["num_stages"], **pdl_args(x2),
        # int_matmul_ref's separately rounded products and sums
        enable_fp_fusion=False)
    return out
