"""Weight-only low-bit GEMM for batched decode (2-512 rows; fewer than 16 padded to a 16-row tile):
``ops.quant_linear_ref`` for float16 / bfloat16 x times symmetric int4 per-group or int8 per-channel / per-tensor /
per-group codes, on tensor cores.

At 16-512 rows a weight element meets many rows, so the conversion of each code to the product's type must cost a
few integer instructions, not the quarter-rate I2F and F2F conversions of a dequantize-in-the-loop: an H100 SM
issues 16 I2F a clock against the 28 codes a clock its share of HBM delivers at int4. Here:
  - int4: a 32-bit register of 8 codes becomes 4 half2 registers by bit assembly (``_i4_pair``): one PRMT, three
    shifts, four LOP3 that place each nibble (its sign bit flipped) in the mantissa of 1024 (bf16: 128) and four
    packed subtractions of 1032 (136) that leave the exact code; int8: ``gemm_parts._i8_to_f16`` (fp16 only).
  - the group's scales multiply the converted codes in the same registers (one packed multiply a code pair, the
    weight rounded twice: code x scale in 16 bits, scale rounded to 16 bits first), or (``POST_SCALE``) each
    group's product is scaled in float32 after the dot.
  - ``SWAP``: the product is formed as out.T = W @ x.T, so the weight tile is the tensor-core instruction's
    M side (64 rows a warp group, operand from registers on Hopper) and the rows of x its N side (8 to 256): a
    batch of 16-128 rows fills the instruction without padding to 64.
  - ``GPS`` tiles of k (groups, for grouped codes) a loop step: independent loads, more weight bytes in flight.
  - where the output tiles alone give too few programs for the SMs, K is split; the float32 partials are summed
    by the last program of each output tile (``gemm_parts._split_gather``: deterministic, CUDA-graph safe).

The kernel reads the stored layout (int4: (n, k // 2) uint8, low nibble = even column): the x columns matching
the low / high nibbles are the even / odd columns (``X_SPLIT``, as ``qgemm_a8``'s: 0 the weight tile's halves
interleaved back into k order, 1 two strided loads of x, 2 a contiguous x tile split in registers;
``gemm_parts._w4_dot``).

Launch settings per row range are ``configs/qgemm_mid.json``'s ROWS_W4 / ROWS_W8 (the first entry whose max_rows holds);
which row ranges run here is its ROUTE less its EXCEPT entries (weight shapes that measured faster on quant_gemm at
some rows; ``dispatch.quant_linear_mid_rows``), from measurements in its why.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ssmq.kernels import configs
from ssmq.kernels._common import (along_n, cdiv, gdc_enter, pdl_args, pow2, rows_entry, sm_count, tile_zeros,
                                  whole_loop_steps)
from ssmq.kernels.dispatch import quant_linear_mid_rows, select
from ssmq.kernels.gemm_parts import (_code_tiles, _i8_to_f16, _out_offsets, _split_gather, _w4_dot, _w_dot,
                                     split_buffers)
from ssmq.ops.quant_linear import code_type, weight_format

CFG = configs.load("qgemm_mid")  # launch settings and routes (configs/qgemm_mid.json)

# int4 nibble n (two's complement) -> 16-bit float 1024 + (n ^ 8) = 1032 + q (bf16: 128 + 8 + q), by one LOP3:
# bits in the mask 0x000F000F take u ^ 0x...8, the others the constant's exponent bits (LUT 0x6A:
# (b & (a ^ c)) | (~b & c)).
_LO_F16 = """{
    .reg .b32 u, t, c, one, nz;
    mov.b32 c, 0x64086408;
    mov.b32 one, 0x3F803F80;
    mov.b32 nz, 0x80008000;
    prmt.b32 u, $2, 0, 0x3120;
    lop3.b32 $0, u, 0x000F000F, 0x64086408, 0x6A;
    shr.b32 t, u, 8;
    lop3.b32 $1, t, 0x000F000F, 0x64086408, 0x6A;
    SUB
}"""
_HI_F16 = """{
    .reg .b32 u, t, c, one, nz;
    mov.b32 c, 0x64086408;
    mov.b32 one, 0x3F803F80;
    mov.b32 nz, 0x80008000;
    prmt.b32 u, $2, 0, 0x3120;
    shr.b32 t, u, 4;
    lop3.b32 $0, t, 0x000F000F, 0x64086408, 0x6A;
    shr.b32 t, u, 12;
    lop3.b32 $1, t, 0x000F000F, 0x64086408, 0x6A;
    SUB
}"""
_SUB_F16 = "sub.f16x2 $0, $0, c; sub.f16x2 $1, $1, c;"
_SUB_SCALE_F16 = _SUB_F16 + " mul.f16x2 $0, $0, $3; mul.f16x2 $1, $1, $4;"
_SUB_BF16 = "xor.b32 c, c, 0x80008000; fma.rn.bf16x2 $0, $0, one, c; fma.rn.bf16x2 $1, $1, one, c;"  # - 136
_SUB_SCALE_BF16 = _SUB_BF16 + " fma.rn.bf16x2 $0, $0, $3, nz; fma.rn.bf16x2 $1, $1, $4, nz;"


def _asm(hi: bool, bf16: bool, scaled: bool) -> str:
    src = _HI_F16 if hi else _LO_F16
    if bf16:
        src = src.replace("0x64086408", "0x43084308")
    sub = (_SUB_SCALE_BF16 if scaled else _SUB_BF16) if bf16 else (_SUB_SCALE_F16 if scaled else _SUB_F16)
    return src.replace("SUB", sub)



@triton.jit
def _i4_half(wb, s, ASM: tl.constexpr, HI: tl.constexpr, BF16: tl.constexpr, SCALED: tl.constexpr):
    """The low (HI: high) nibbles of int4 bytes wb (int8, any shape) as exact codes in fp16 / bf16, times s (same
    shape, 16-bit) when SCALED. ASM (``_asm``): bit assembly four bytes a register; empty (the interpreter):
    shifts and a conversion."""
    if ASM != "":
        if SCALED:
            r = tl.inline_asm_elementwise(asm=ASM, constraints="=r,=r,r,r,r", args=[wb, s],
                                          dtype=tl.bfloat16 if BF16 else tl.float16, is_pure=True, pack=4)
        else:
            r = tl.inline_asm_elementwise(asm=ASM, constraints="=r,=r,r", args=[wb],
                                          dtype=tl.bfloat16 if BF16 else tl.float16, is_pure=True, pack=4)
    else:
        r = (wb >> 4).to(s.dtype) if HI else ((wb << 4) >> 4).to(s.dtype)
        if SCALED:
            r = r * s
    return r


@triton.jit
def _mid_qmm(
    x_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, part_ptr, cnt_ptr,
    M, N, K, k_split, n_groups, s_xm, s_wn, s_om,
    W4: tl.constexpr, WS_MODE: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, NSP: tl.constexpr,
    BF16: tl.constexpr, ASM_LO: tl.constexpr, ASM_HI: tl.constexpr, FAST_I8: tl.constexpr,
    POST_SCALE: tl.constexpr, SWAP: tl.constexpr, X_SPLIT: tl.constexpr, GPS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr = False,
):
    # Program (tile, pid_k): an output tile over a k range (``gemm_parts._code_tiles``; k_split and K multiples of
    # GPS * BLOCK_K; per-group scales: BLOCK_K == GROUP). WS_MODE: 0 per tensor, 1 per channel, 2 per group. acc is
    # (BLOCK_N, BLOCK_M) with SWAP (out.T), else (BLOCK_M, BLOCK_N).
    gdc_enter(USE_GDC)  # PDL: see ssmq.kernels._common
    tile, pid_k, offs_m, offs_n, mm, mn, rows, cols, k_len, w_ptrs, x_ptrs, s_ptrs = _code_tiles(
        x_ptr, w_ptr, ws_ptr, M, N, K, k_split, n_groups, s_xm, s_wn, W4, X_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K)
    DT: tl.constexpr = tl.bfloat16 if BF16 else tl.float16
    WK: tl.constexpr = BLOCK_K // 2 if W4 else BLOCK_K  # code bytes a weight row a step
    SCALED: tl.constexpr = WS_MODE == 2 and not POST_SCALE
    acc = tile_zeros(BLOCK_M, BLOCK_N, tl.float32, SWAP)
    for k in range(0, k_len, BLOCK_K * GPS):
        for g in tl.static_range(GPS):  # GPS independent tiles a step: more weight bytes in flight a program
            w = tl.load(w_ptrs + g * WK, mask=mn[:, None], other=0).to(tl.int8, bitcast=True)
            if WS_MODE == 2:
                s = tl.load(s_ptrs + g, mask=mn, other=0.0)
                s16 = tl.broadcast_to(s.to(DT)[:, None], (BLOCK_N, WK))
            else:
                s = tl.zeros((BLOCK_N,), dtype=tl.float32)
                s16 = tl.zeros((BLOCK_N, WK), dtype=DT)
            if POST_SCALE and WS_MODE == 2:
                part = tl.zeros(acc.shape, dtype=tl.float32)
            else:
                part = acc
            if W4:
                lo = _i4_half(w, s16, ASM_LO, False, BF16, SCALED)
                hi = _i4_half(w, s16, ASM_HI, True, BF16, SCALED)
                part = _w4_dot(lo, hi, x_ptrs + g * BLOCK_K, mm, part, SWAP, X_SPLIT, tl.float32, BLOCK_M, BLOCK_N,
                               BLOCK_K)
            else:
                if FAST_I8:
                    wf = _i8_to_f16(w)
                else:
                    wf = w.to(DT)
                if SCALED:
                    wf = wf * s16
                part = _w_dot(wf, tl.load(x_ptrs + g * BLOCK_K, mask=mm[:, None], other=0.0), part, SWAP, tl.float32)
            if POST_SCALE and WS_MODE == 2:
                acc += part * along_n(s, SWAP)
            else:
                acc = part
        w_ptrs += WK * GPS
        x_ptrs += BLOCK_K * GPS
        s_ptrs += GPS
    if WS_MODE != 2:  # per channel / per tensor: once, at the end
        if WS_MODE == 1:
            sc = tl.load(ws_ptr + offs_n, mask=mn, other=0.0)
        else:
            sc = tl.load(ws_ptr + offs_n * 0)
        acc = acc * along_n(sc, SWAP)
    p_off, o_off, mo, first = _out_offsets(offs_m, offs_n, rows, cols, mm, mn, N, s_om, SWAP)
    if SPLIT:
        tl.store(part_ptr + pid_k * M * N + p_off, acc, mask=mo)
        acc, last = _split_gather(part_ptr, cnt_ptr, tile, tl.num_programs(1), M * N, p_off, mo, first, NSP)
        mo = mo & last[:, None]
    if HAS_BIAS:
        b = tl.load(b_ptr + offs_n, mask=mn, other=0.0).to(tl.float32)
        acc += along_n(b, SWAP)
    tl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty), mask=mo)


def _step_k(K: int, f: dict, e: dict) -> int | None:
    """The k a step (the group size for grouped codes), None when K or the group does not fit the kernel (K not a
    multiple of it, no power of two of at least a tensor-core step's bytes, at most 512)."""
    g = f["group_size"]
    BK = g if g is not None else e["BK"]
    if K % BK or BK & (BK - 1) or BK < (32 if f["bits"] == 4 else 16) or BK > 512:
        return None
    return BK


def _plan(M: int, N: int, K: int, f: dict, sms: int, cfg: dict) -> dict:
    """Tiles, K split and grid for M x (N, K) in format f (a layout ``_step_k`` accepts)."""
    e = rows_entry(M, f["bits"], cfg)
    BK = _step_k(K, f, e)
    BM = min(e["BM"], pow2(M, 16))
    BN = e["BN"]
    tiles = cdiv(M, BM) * cdiv(N, BN)
    steps = K // BK
    split = max(1, min(cfg["MAX_SPLIT"], cdiv(int(e["waves"] * sms), tiles), K // cfg["MIN_SPLIT_K"], steps))
    gps, per, split = whole_loop_steps(steps, e.get("GPS", 1), split)
    return dict(BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GPS=gps, split=split, k_split=per * BK, tiles=tiles,
                grid=(tiles, split), num_warps=e["warps"], num_stages=e["stages"], SWAP=e["SWAP"],
                X_SPLIT=e["X_SPLIT"], POST_SCALE=e["POST_SCALE"])


def launch(x: torch.Tensor, w_q: torch.Tensor, f: dict, w_zero=None, x_scale=None, cfg=None) -> dict:
    """The fields ``dispatch.quant_linear_mid_rows`` selects on: code type, x's dtype, rows, the weight's (n, k), zero
    points, and whether the layout fits (``fits``: float x of k features with unit column stride, stored codes with
    unit column stride, a tiling ``_plan`` accepts)."""
    cfg = CFG if cfg is None else cfg
    M = math.prod(x.shape[:-1])
    K = f["k"]
    fits = (not f["fp8"] and x_scale is None and x.shape[-1] == K and x.stride(-1) == 1 and w_q.stride(-1) == 1
            and M > 0 and _step_k(K, f, rows_entry(M, f["bits"], cfg)) is not None)
    return dict(code=code_type(f), x=str(x.dtype).removeprefix("torch."), rows=M,
                n=f["n"], k=K, zero=w_zero is not None, fits=fits)


def serves(x: torch.Tensor, w_q, w_scale, w_zero=None, x_scale=None, cfg=None) -> dict | None:
    """``weight_format(w_q, w_scale, w_zero)`` when the selection table (``dispatch.quant_linear_mid_rows`` of CFG)
    sends this call here, else None."""
    cfg = CFG if cfg is None else cfg
    f = weight_format(w_q, w_scale, w_zero)
    return f if select(quant_linear_mid_rows(cfg), launch(x, w_q, f, w_zero, x_scale, cfg)) == "qgemm_mid" else None


def quant_linear_mid(x, w_q, w_scale, f: dict | None = None, bias=None, out_dtype=None, cfg=None):
    """``ops.quant_linear_ref(x, w_q, w_scale, None, None, bias, out_dtype)`` for float16 / bfloat16 x (..., k) and
    symmetric integer codes of format f (``weight_format``; a layout ``launch`` says fits): (..., n)."""
    cfg = CFG if cfg is None else {**CFG, **cfg}
    f = f or weight_format(w_q, w_scale)
    M, K, N = math.prod(x.shape[:-1]), f["k"], f["n"]
    x2 = x.reshape(M, K)
    out = torch.empty((*x.shape[:-1], N), device=x.device, dtype=out_dtype or x.dtype)
    if M == 0 or N == 0:
        return out
    c = _plan(M, N, K, f, sm_count(x.device), cfg)
    split = c["split"]
    part, cnt = split_buffers(split, M, N, c["tiles"], x.device, torch.float32, out)
    bf16 = x.dtype == torch.bfloat16
    ptx = x.is_cuda
    W4 = f["bits"] == 4
    ws_mode = 2 if w_scale.dim() == 2 else int(w_scale.dim() == 1)
    scaled = ws_mode == 2 and not c["POST_SCALE"]
    _mid_qmm[c["grid"]](
        x2, w_q, w_scale, bias if bias is not None else w_scale, out.view(M, N), part, cnt,
        M, N, K, c["k_split"], w_scale.shape[1] if ws_mode == 2 else 1, x2.stride(0), w_q.stride(0), N,
        W4=W4, WS_MODE=ws_mode, HAS_BIAS=bias is not None, SPLIT=split > 1, NSP=pow2(split), BF16=bf16,
        ASM_LO=_asm(False, bf16, scaled) if ptx and W4 else "", ASM_HI=_asm(True, bf16, scaled) if ptx and W4 else "",
        FAST_I8=ptx and not bf16 and not W4, POST_SCALE=c["POST_SCALE"], SWAP=c["SWAP"], X_SPLIT=c["X_SPLIT"],
        GPS=c["GPS"],
        BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], num_warps=c["num_warps"],
        num_stages=c["num_stages"], **pdl_args(x2))
    return out
