"""Triton twins of ``ssmq.ops.quant_linear``: low-bit GEMV / GEMM that dequantize in registers.

``quant_linear(x, w_q, w_scale, w_zero, x_scale, bias, out_dtype)`` and ``quantize_act(x, x_scale,
per_token, dtype)`` have the references' signatures and formats (see ``ssmq.ops.quant_linear``).

Weight layout: the kernels read the STORED checkpoint layout as is (no pre-shuffled copy):
int8 / fp8 codes row-major (n, k); int4 packed (n, k // 2) uint8, low nibble = even column;
float32 scales () / (n,) / (n, k // g); int32 zero points beside them. An int4 byte is
sign-extended in registers by two shifts (low nibble ``(b << 4) >> 4``, high ``b >> 4``) and the
matching x columns are taken apart the same way (even / odd), so that each half is one tensor-core
product: x_even @ lo.T + x_odd @ hi.T.

Decode at batch 1-2 (CFG's WORD_MAX_ROWS; 8-bit codes on underfilled tilings only) runs ``_qgemv_words``: int8 / int4 codes loaded as 32-bit words, 16
bytes a load, for float x turned into exact float32 values by bit assembly (one LOP3 and one FADD a code, then one
FFMA a code and row; no I2F), for int8 x multiplied by dp4a on whole words (int4 nibbles shifted into the high
half of each byte); K split over many programs, the partial sums added by the last program of each output tile
(an acq_rel counter that resets itself: no second kernel, CUDA-graph safe); int8 x with per-group scales (W4A8)
splits too, each program storing its groups' scaled products for the last one to add in group order
(``GROUP_PARTS``: ``int_matmul_ref``'s sum, bit for bit); under PDL its first tile of words is requested before
the wait on the previous kernel (weights are never written by a decode step). It serves int8 and int4 codes whose
rows are whole words (k a multiple of 8 for int4, 4 for int8), float or int8 x, and fp8 e4m3 codes (per channel /
tensor) with float or fp8 x, each code converted exactly by the hardware e4m3 -> f16 conversion; the rest goes
below.
Two kernels do every other case, with the same arguments:
``_qgemv`` (1-2 rows, decode at batch 1-2, when FMA_MAX_ROWS asks for it): CUDA-core multiply-adds, products kept
  elementwise across the K loop and reduced once; small register tiles, so many programs per SM keep loads in
  flight. Weight-only groups are dequantized in registers ((q - z) * s, one group per tile); int8 x: int32 products,
  per group reduced and scaled (``int_matmul_ref``'s order).
``_qmm`` (more rows): tensor cores (rows padded to 16 up to 16 rows, one weight pass for all):
  weight-only (x float): acc += (x @ q.T - zero * sum(x)) * scale per group of k (BLOCK_K = g),
      or once at the end per channel: the codes enter the product unscaled (integers, exact in
      fp16 / bf16), so a weight element costs a load and a conversion, never a multiply by its scale;
      for prefill tiles the group's tile is dequantized to x's dtype instead (``DEQ_W``: no second accumulator);
  int8 x (W8A8 / W4A8): int8 x int8 -> int32 products, then ``int_matmul_ref``'s float32 epilogue
      in its order, compiled without FMA contraction, so the result is bit-exact;
  fp8 x: e4m3 operands widened to fp16 (exact), float32 accumulation, scale epilogue.
fp8 codes travel as raw int8 bytes and are reinterpreted in the kernels (masked loads need an integer fill).
Decode: when the output blocks alone give too few programs for the SMs, K is split (where the result is
not bit-exact anyway; float32 partials summed by the last program of each output tile, ``_split_gather``, or
by a second kernel with SPLIT_IN_KERNEL off).

Which path serves a call (M rows; every threshold an entry of configs/quant_gemm.json, the measurements in its why):

    rows                 weight-only (float x)                    W8A8 per channel / tensor      fp8 x
    1-2                  _qgemv_words (8-bit codes: underfilled   _qgemv_words (underfilled      _qgemv_words
                         tilings only, else _qmm)                 tilings only, else _qmm)       (underfilled only)
    3-16                 _qmm, K split                            _qmm                           _qmm (16: _scaled_mm)
    17-64                _qmm: one row tile, K split in 2         torch._int_mm + _int_epilogue  torch._scaled_mm
    65-511               underfilled -> dequantize + cuBLAS,      torch._int_mm + _int_epilogue  torch._scaled_mm
                         else _qmm (int4 up to 128 rows: 4 warps)
    512+                 dequantize + cuBLAS                      _qmm (int8 tensor cores, K 128) torch._scaled_mm

("underfilled": fewer column tiles than MID_FILL x SMs, e.g. Mamba2-2.7B's out_proj.)
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ssmq.kernels import configs
from ssmq.errors import SSMQError
from ssmq.kernels._common import cdiv, dot_precision, gdc_enter, pdl_args, pow2, sm_count
from ssmq.kernels.gemm_parts import (_code_f32, _code_halves, _finish_words, _fp8_f32, _i8_to_f16,
                                     _rows_tile, _scale_bias_store, _split_gather, _x_f32,
                                     split_buffers)
from ssmq.kernels.gemv import _sum_splits  # the K-split partial sums + bias, shared with the float GEMV
from ssmq.kernels.launch import fast_launch
from ssmq.ops.quant_linear import EPS, FP8_MAX, absmax_scale, given_act_scale, quant_linear_ref, weight_format

DECODE_ROWS = 16  # one tl.dot row tile: up to this many rows read the weight once
CFG = configs.load("quant_gemm")  # launch settings (configs/quant_gemm.json, keys in docs/kernels.md)


@triton.jit
def _prep_x(xv, xs, QUANT_X: tl.constexpr, A_MODE: tl.constexpr, QMAX: tl.constexpr, OP: tl.constexpr):
    """An x tile as the product takes it: quantized here when QUANT_X (quantize_act_ref's codes), fp8 bytes
    reinterpreted, widened to the operand type OP."""
    if QUANT_X:
        y = tl.math.div_rn(xv.to(tl.float32), xs[:, None])
        if A_MODE == 2:
            xv = tl.minimum(tl.maximum(y, -QMAX), QMAX).to(tl.float8e4nv)
        else:  # round half to even as _quantize_rows does it
            y = tl.minimum(tl.maximum(y, -129.0), 128.0)
            xv = tl.minimum(tl.maximum((y + 12582912.0) - 12582912.0, -128.0), 127.0).to(tl.int8)
    elif A_MODE == 2:  # fp8 codes travel as raw bytes (masked loads need an integer fill value)
        xv = xv.to(tl.float8e4nv, bitcast=True)
    return xv.to(OP)


@fast_launch
@triton.jit
def _qmm(
    x_ptr, xs_ptr, w_ptr, ws_ptr, wz_ptr, b_ptr, out_ptr, fin_ptr, cnt_ptr,
    M, N, K, k_split, n_groups, s_xm, s_wn, s_om, s_os,
    A_MODE: tl.constexpr, XS_ROWS: tl.constexpr, W4: tl.constexpr, W_FP8: tl.constexpr, WS_MODE: tl.constexpr,
    HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr, GROUP: tl.constexpr, EVEN_K: tl.constexpr,
    DEQ_W: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FAST_CVT: tl.constexpr = False, QUANT_X: tl.constexpr = 0, QMAX: tl.constexpr = 127.0, EPS_: tl.constexpr = 1e-8,
    X_STRIDED: tl.constexpr = False, SPLIT_IN: tl.constexpr = False, FIN_BIAS: tl.constexpr = False,
    NSP: tl.constexpr = 1, USE_GDC: tl.constexpr = False,
):
    # A_MODE: 0 float x, 1 int8 x, 2 fp8 x. WS_MODE: 0 per-tensor, 1 per-channel, 2 per-group (BLOCK_K == GROUP).
    # FAST_CVT: fp16 x, codes widened by _i8_to_f16. QUANT_X (A_MODE 1 / 2 with float x): each program quantizes
    # x itself as quantize_act_ref does, 1 per token (absmax of the whole row first: a max is exact in any
    # order, so every program finds the same scale), 2 with the static scale at xs_ptr. X_STRIDED (int4, not
    # DEQ_W): the even and odd x columns are loaded apart instead of reshaping and splitting the x tile.
    # SPLIT_IN: a K split's partials (at out_ptr[pid_k]) are summed in this kernel by the last program of each
    # output tile (_split_gather; the count at cnt_ptr), plus the bias (FIN_BIAS), into fin_ptr.
    gdc_enter(USE_GDC)  # PDL: see ssmq.kernels._common
    n_blocks = tl.cdiv(N, BLOCK_N)
    pid_n, pid_m, pid_k = tl.program_id(0) % n_blocks, tl.program_id(0) // n_blocks, tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mm, mn = offs_m < M, offs_n < N
    WK: tl.constexpr = BLOCK_K // 2 if W4 else BLOCK_K  # weight bytes per row and tile
    offs_kw = tl.arange(0, WK)
    offs_kx = tl.arange(0, BLOCK_K)
    k0 = pid_k * k_split
    k_len = tl.minimum(k_split, K - k0)
    rows = offs_m.to(tl.int64)
    cols = offs_n.to(tl.int64)
    w_ptrs = w_ptr + cols[:, None] * s_wn + ((k0 // 2) if W4 else k0) + offs_kw[None, :]
    x_ptrs = x_ptr + rows[:, None] * s_xm + k0 + offs_kx[None, :]
    xe_ptrs = x_ptr + rows[:, None] * s_xm + k0 + 2 * offs_kw[None, :]
    if A_MODE == 0:
        OP = x_ptr.dtype.element_ty
        ACC = tl.float32
    elif A_MODE == 1:
        OP = tl.int8
        ACC = tl.int32
    else:
        OP = tl.float16
        ACC = tl.float32
    if QUANT_X == 1:
        amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for kk in range(0, K, BLOCK_K):
            xa = tl.load(x_ptr + rows[:, None] * s_xm + kk + offs_kx[None, :],
                         mask=mm[:, None] & (kk + offs_kx < K)[None, :], other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(xa.to(tl.float32)), axis=1))
        xs = tl.maximum(tl.math.div_rn(amax, QMAX), EPS_)
    elif A_MODE != 0:
        if XS_ROWS:
            xs = tl.load(xs_ptr + offs_m, mask=mm, other=0.0)
        else:
            xs = tl.load(xs_ptr + offs_m * 0)
    else:
        xs = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if A_MODE == 1:
        acc_i = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    xsum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k in range(0, k_len, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, mask=mn[:, None], other=0)
            mx = mm[:, None]
            mxe = mm[:, None]
        else:
            w = tl.load(w_ptrs, mask=mn[:, None] & (offs_kw < (k_len - k) // (2 if W4 else 1))[None, :], other=0)
            mx = mm[:, None] & (offs_kx < k_len - k)[None, :]
            mxe = mm[:, None] & (2 * offs_kw < k_len - k)[None, :]
        if X_STRIDED:
            xe = _prep_x(tl.load(xe_ptrs, mask=mxe, other=0), xs, QUANT_X, A_MODE, QMAX, OP)
            xo = _prep_x(tl.load(xe_ptrs + 1, mask=mxe, other=0), xs, QUANT_X, A_MODE, QMAX, OP)
            if HAS_ZERO:
                xsum_k = tl.sum(xe.to(tl.float32), axis=1) + tl.sum(xo.to(tl.float32), axis=1)
        else:
            xv = _prep_x(tl.load(x_ptrs, mask=mx, other=0), xs, QUANT_X, A_MODE, QMAX, OP)
            if HAS_ZERO:
                xsum_k = tl.sum(xv.to(tl.float32), axis=1)
        if W_FP8:
            w = w.to(tl.float8e4nv, bitcast=True)
        if DEQ_W:
            # prefill, weight-only, groups: the tile is dequantized to x's dtype in registers ((q - z) * s in
            # float32, rounded once, the reference's weight) and accumulated by one product: no per-group
            # partial accumulator to hold beside a large acc tile
            t = (k0 + k) // GROUP
            s = tl.load(ws_ptr + cols * n_groups + t, mask=mn, other=0.0)
            if HAS_ZERO:
                z = tl.load(wz_ptr + cols * n_groups + t, mask=mn, other=0).to(tl.float32)
            else:
                z = tl.zeros((BLOCK_N,), dtype=tl.float32)
            if W4:
                wb = w.to(tl.int8, bitcast=True)
                lo = ((((wb << 4) >> 4).to(tl.float32) - z[:, None]) * s[:, None]).to(OP)
                hi = (((wb >> 4).to(tl.float32) - z[:, None]) * s[:, None]).to(OP)
                xe, xo = tl.split(tl.reshape(xv, (BLOCK_M, BLOCK_K // 2, 2)))
                acc = tl.dot(xe, tl.trans(lo), acc, input_precision=PRECISION)
                acc = tl.dot(xo, tl.trans(hi), acc, input_precision=PRECISION)
            else:
                wf = ((w.to(tl.float32) - z[:, None]) * s[:, None]).to(OP)
                acc = tl.dot(xv, tl.trans(wf), acc, input_precision=PRECISION)
        else:
            # per group: a fresh partial product for the group's scale; else straight into the accumulator
            if WS_MODE == 2:
                if A_MODE == 1:
                    part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
                else:
                    part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            elif A_MODE == 1:
                part = acc_i
            else:
                part = acc
            if W4:
                wb = w.to(tl.int8, bitcast=True)
                if FAST_CVT:
                    lo = _i8_to_f16((wb << 4) >> 4)
                    hi = _i8_to_f16(wb >> 4)
                else:
                    lo = ((wb << 4) >> 4).to(OP)
                    hi = (wb >> 4).to(OP)
                if not X_STRIDED:
                    xe, xo = tl.split(tl.reshape(xv, (BLOCK_M, BLOCK_K // 2, 2)))
                part = tl.dot(xe, tl.trans(lo), part, input_precision=PRECISION, out_dtype=ACC)
                part = tl.dot(xo, tl.trans(hi), part, input_precision=PRECISION, out_dtype=ACC)
            else:
                wo = _i8_to_f16(w) if FAST_CVT else w.to(OP)
                part = tl.dot(xv, tl.trans(wo), part, input_precision=PRECISION, out_dtype=ACC)
            if WS_MODE == 2:
                t = (k0 + k) // GROUP
                s = tl.load(ws_ptr + cols * n_groups + t, mask=mn, other=0.0)
                if A_MODE == 0:
                    if HAS_ZERO:
                        z = tl.load(wz_ptr + cols * n_groups + t, mask=mn, other=0).to(tl.float32)
                        part -= z[None, :] * xsum_k[:, None]
                    acc += part * s[None, :]
                else:
                    # int_matmul_ref's order: s_t = a_scale * w_scale[:, t]; out += float(acc_t) * s_t
                    acc += part.to(tl.float32) * (xs[:, None] * s[None, :])
            elif A_MODE == 1:
                acc_i = part
            else:
                acc = part
                if HAS_ZERO:
                    xsum += xsum_k
        w_ptrs += WK
        x_ptrs += BLOCK_K
        xe_ptrs += BLOCK_K
    scale = WS_MODE != 2 and not DEQ_W
    if A_MODE == 1 and scale:
        acc = acc_i.to(tl.float32)
    _scale_bias_store(acc, xs, xsum, ws_ptr, wz_ptr, b_ptr, out_ptr, offs_n, mn, rows, mm, pid_k, s_om, s_os,
                      scale, A_MODE, WS_MODE, HAS_ZERO, HAS_BIAS)
    if SPLIT_IN:
        p_off = rows[:, None] * s_om + offs_n[None, :]
        mo = mm[:, None] & mn[None, :]
        tot, last = _split_gather(out_ptr, cnt_ptr, tl.program_id(0), tl.num_programs(1), s_os, p_off, mo, offs_m,
                                  NSP)
        if FIN_BIAS:
            tot += tl.load(b_ptr + offs_n, mask=mn, other=0.0).to(tl.float32)[None, :]
        tl.store(fin_ptr + p_off, tot.to(fin_ptr.dtype.element_ty), mask=mo & last[:, None])


@triton.jit
def _qgemv(
    x_ptr, xs_ptr, w_ptr, ws_ptr, wz_ptr, b_ptr, out_ptr, fin_ptr, cnt_ptr,  # fin_ptr, cnt_ptr: _qmm's SPLIT_IN
    M, N, K, k_split, n_groups, s_xm, s_wn, s_om, s_os,
    A_MODE: tl.constexpr, XS_ROWS: tl.constexpr, W4: tl.constexpr, W_FP8: tl.constexpr, WS_MODE: tl.constexpr,
    HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr, GROUP: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # One or two rows: multiply-adds on CUDA cores (a tensor-core tile would pad the rows to 16 and hold
    # registers that cost occupancy, i.e. loads in flight). Products are kept elementwise across the K
    # loop and reduced once at the end, except per group of int8 x (exact int32 per group, then its scale).
    # Weight-only groups: each tile is one group (BLOCK_K == GROUP), dequantized in registers by its
    # (BLOCK_N,) scales and zeros. A_MODE / WS_MODE as in _qmm.
    n_blocks = tl.cdiv(N, BLOCK_N)
    pid_n, pid_m, pid_k = tl.program_id(0) % n_blocks, tl.program_id(0) // n_blocks, tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mm, mn = offs_m < M, offs_n < N
    WK: tl.constexpr = BLOCK_K // 2 if W4 else BLOCK_K
    offs_w = tl.arange(0, WK)
    k0 = pid_k * k_split
    k_len = tl.minimum(k_split, K - k0)
    rows = offs_m.to(tl.int64)
    cols = offs_n.to(tl.int64)
    w_ptrs = w_ptr + cols[:, None] * s_wn + ((k0 // 2) if W4 else k0) + offs_w[None, :]
    # x columns matching the weight columns: even / odd ones for packed int4
    x_ptrs = x_ptr + rows[:, None] * s_xm + k0 + (offs_w * 2 if W4 else offs_w)[None, :]
    if A_MODE == 1:
        ACC = tl.int32
    else:
        ACC = tl.float32
    acc3 = tl.zeros((BLOCK_M, BLOCK_N, WK), dtype=ACC)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    xsum = tl.zeros((BLOCK_M, 1, WK), dtype=tl.float32)
    if A_MODE != 0:
        if XS_ROWS:
            xs = tl.load(xs_ptr + offs_m, mask=mm, other=0.0)
        else:
            xs = tl.load(xs_ptr + offs_m * 0)
    else:
        xs = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k in range(0, k_len, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, mask=mn[:, None], other=0)
            xa = tl.load(x_ptrs, mask=mm[:, None], other=0)
            if W4:
                xb = tl.load(x_ptrs + 1, mask=mm[:, None], other=0)
        else:
            mk = offs_w < (k_len - k) // (2 if W4 else 1)
            w = tl.load(w_ptrs, mask=mn[:, None] & mk[None, :], other=0)
            xa = tl.load(x_ptrs, mask=mm[:, None] & mk[None, :], other=0)
            if W4:
                xb = tl.load(x_ptrs + 1, mask=mm[:, None] & mk[None, :], other=0)
        if A_MODE == 2:
            xa = xa.to(tl.float8e4nv, bitcast=True)
        if W_FP8:
            w = w.to(tl.float8e4nv, bitcast=True)
        if W4:
            wb = w.to(tl.int8, bitcast=True)
            qa = ((wb << 4) >> 4).to(ACC)
            qb = (wb >> 4).to(ACC)
        else:
            qa = w.to(ACC)
        if WS_MODE == 2 and A_MODE == 0:
            t = (k0 + k) // GROUP
            s = tl.load(ws_ptr + cols * n_groups + t, mask=mn, other=0.0)[:, None]
            if HAS_ZERO:
                z = tl.load(wz_ptr + cols * n_groups + t, mask=mn, other=0).to(tl.float32)[:, None]
                qa = (qa - z) * s
                if W4:
                    qb = (qb - z) * s
            else:
                qa = qa * s
                if W4:
                    qb = qb * s
        prod = xa.to(ACC)[:, None, :] * qa[None, :, :]
        if W4:
            prod += xb.to(ACC)[:, None, :] * qb[None, :, :]
        if WS_MODE == 2 and A_MODE == 1:
            t = (k0 + k) // GROUP
            s = tl.load(ws_ptr + cols * n_groups + t, mask=mn, other=0.0)
            acc += tl.sum(prod, axis=2).to(tl.float32) * (xs[:, None] * s[None, :])
        else:
            acc3 += prod
            if HAS_ZERO and WS_MODE != 2:
                xsum += xa.to(tl.float32)[:, None, :]
                if W4:
                    xsum += xb.to(tl.float32)[:, None, :]
        w_ptrs += WK
        x_ptrs += BLOCK_K
    if not (WS_MODE == 2 and A_MODE == 1):
        acc = tl.sum(acc3, axis=2).to(tl.float32)
    _scale_bias_store(acc, xs, tl.reshape(tl.sum(xsum, axis=2), (BLOCK_M,)), ws_ptr, wz_ptr, b_ptr, out_ptr, offs_n,
                      mn, rows, mm, pid_k, s_om, s_os, WS_MODE != 2, A_MODE, WS_MODE, HAS_ZERO, HAS_BIAS)


# ------------------------------------------------------------------------------------------ decode GEMV on words
# _qgemv_words: the decode GEMV (a few rows) on the codes read as 32-bit words (8 int4 or 4 int8 codes each).
# Glossary: WPW codes a word, KW words a tile row, p a code's bit offset within the word (or its upper half).


@triton.jit
def _dp4a(a, b, c, PTX: tl.constexpr):
    """c + the dot product of the four signed bytes of a and b (int32 words): one IDP.4A instruction, or its
    pure-Triton twin for the interpreter."""
    if PTX:
        r = tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                      is_pure=True, pack=1)
    else:
        r = c
        for i in tl.static_range(4):
            r += ((a << (24 - 8 * i)) >> 24) * ((b << (24 - 8 * i)) >> 24)
    return r


@triton.jit
def _pick_bytes(a, b, ODD: tl.constexpr, PTX: tl.constexpr):
    """The even (ODD: odd) bytes of the 8-byte run a, b (int32 words) as one word: the int8 x codes that meet
    the low (high) nibbles of an int4 word. One PRMT, or shifts and masks in the interpreter."""
    if PTX:
        if ODD:
            r = tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x7531;", "=r,r,r", [a, b], dtype=tl.int32,
                                          is_pure=True, pack=1)
        else:
            r = tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x6420;", "=r,r,r", [a, b], dtype=tl.int32,
                                          is_pure=True, pack=1)
    else:
        TOP: tl.constexpr = -16777216  # 0xFF000000
        if ODD:
            r = ((a >> 8) & 0xFF) | ((a >> 16) & 0xFF00) | ((b << 8) & 0xFF0000) | (b & TOP)
        else:
            r = (a & 0xFF) | ((a >> 8) & 0xFF00) | ((b & 0xFF) << 16) | ((b << 8) & TOP)
    return r


@triton.jit
def _row_step(p, xk, w, lo, hi, x_row, mx, A_MODE: tl.constexpr, W4: tl.constexpr, HAS_ZERO: tl.constexpr,
              X16: tl.constexpr, XBF16: tl.constexpr, PTX: tl.constexpr, W_FP8: tl.constexpr = False):
    """One decode row times a (BLOCK_N, KW) tile of code words w (lo, hi: _code_halves(w)), added elementwise into
    p; x_row (KW,) points at the row's x for each word: float x at its first code's column (16-bit x: as int32
    pairs), int8 / fp8 x at its first int32 word of codes; xk (KW,) gathers the row's x for zero points. The codes
    are converted once for all rows (the compiler shares _code_f32's values between the rows' calls).
    W_FP8: e4m3 weight codes, with float x (A_MODE 0) or e4m3 x codes (A_MODE 2), float32 products."""
    if A_MODE == 2:  # e4m3 x codes (one word: 4) times e4m3 weight codes
        xv = tl.load(x_row, mask=mx, other=0)
        for j in tl.static_range(4):
            p += _fp8_f32(xv, j)[None, :] * _fp8_f32(w, j)
    elif A_MODE == 0:
        BITS: tl.constexpr = 4 if W4 else 8
        H: tl.constexpr = 16 // BITS
        for i in tl.static_range(4 if W4 else 2):  # code pairs 2i, 2i + 1
            if X16:
                xv = tl.load(x_row + i, mask=mx, other=0)
                xa = _x_f32(xv, False, X16, XBF16)
                xb = _x_f32(xv, True, X16, XBF16)
            else:
                xa = tl.load(x_row + 2 * i, mask=mx, other=0.0).to(tl.float32)
                xb = tl.load(x_row + 2 * i + 1, mask=mx, other=0.0).to(tl.float32)
            if W_FP8:
                p += xa[None, :] * _fp8_f32(w, 2 * i) + xb[None, :] * _fp8_f32(w, 2 * i + 1)
            else:
                p += (xa * (1.0 / (1 << (BITS * ((2 * i) % H)))))[None, :] * _code_f32(lo, hi, 2 * i, W4)
                p += (xb * (1.0 / (1 << (BITS * ((2 * i + 1) % H)))))[None, :] * _code_f32(lo, hi, 2 * i + 1, W4)
            if HAS_ZERO:
                xk += xa + xb
    else:
        xa = tl.load(x_row, mask=mx, other=0)
        if W4:
            xb = tl.load(x_row + 1, mask=mx, other=0)
            NIB: tl.constexpr = -252645136  # 0xF0F0F0F0: each byte's high nibble, i.e. 16 q
            p = _dp4a(tl.broadcast_to(_pick_bytes(xa, xb, False, PTX)[None, :], p.shape), (w << 4) & NIB, p, PTX)
            p = _dp4a(tl.broadcast_to(_pick_bytes(xa, xb, True, PTX)[None, :], p.shape), w & NIB, p, PTX)
        else:
            p = _dp4a(tl.broadcast_to(xa[None, :], p.shape), w, p, PTX)
    return p, xk


@triton.jit
def _row_group(acc, p, xk, s, z, xs_r, A_MODE: tl.constexpr, W4: tl.constexpr, HAS_ZERO: tl.constexpr):
    """A group's products of one row (p (BLOCK_N, KW), xk its x) into its output sums acc (BLOCK_N,): scaled by
    the group's scales s (and zeros z), in int_matmul_ref's order for int8 x (out += float(acc_t) * s_t)."""
    part = tl.sum(p, axis=1)
    if A_MODE == 0:
        if HAS_ZERO:
            part -= z * tl.sum(xk, axis=0)
        acc += part * s
    else:
        if W4:
            part = part >> 4
        acc += part.to(tl.float32) * (xs_r * s)
    return acc


@triton.jit
def _row_total(p, xsum, z, A_MODE: tl.constexpr, W4: tl.constexpr, HAS_ZERO: tl.constexpr):
    """A row's products over all of its k (per-channel / per-tensor scales) as (BLOCK_N,) sums, zeros applied."""
    tot = tl.sum(p, axis=1)
    if A_MODE == 1 and W4:
        tot = tot >> 4
    if A_MODE == 0 and HAS_ZERO:
        tot -= z * tl.sum(xsum, axis=0)
    return tot


@triton.jit
def _group_gather(part_ptr, cnt_ptr, tile, n_split, n_groups, MN, p_off, mo, offs_m, NSP: tl.constexpr):
    """As _split_gather for GROUP_PARTS: the last program adds the n_groups (<= NSP) stored group products in group
    order, starting from 0 (int_matmul_ref's out = 0; out += ... order; the loads are independent and issued
    together, the adds run in order)."""
    tl.debug_barrier()
    done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
    last = (offs_m * 0 + done) == n_split - 1
    ml = mo & last[:, None]
    tot = tl.zeros(p_off.shape, dtype=tl.float32)
    for t in tl.static_range(NSP):
        tot += tl.load(part_ptr + t * MN + p_off, mask=ml & (t < n_groups), other=0.0, cache_modifier=".cg")
    tl.store(cnt_ptr + tile + offs_m * 0, offs_m * 0, mask=last)
    return tot, last


@triton.jit
def _qgemv_words(
    x_ptr, xs_ptr, w_ptr, ws_ptr, wz_ptr, b_ptr, out_ptr, part_ptr, cnt_ptr,
    M, N, K, kw_split, n_split, n_groups, s_xm, s_wn, s_om,
    A_MODE: tl.constexpr, XS_ROWS: tl.constexpr, W4: tl.constexpr, WS_MODE: tl.constexpr,
    HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr, GROUP: tl.constexpr, EVEN_K: tl.constexpr,
    SPLIT: tl.constexpr, X16: tl.constexpr, XBF16: tl.constexpr, PTX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr = False,
    NSP: tl.constexpr = 1, USE_GDC: tl.constexpr = False, GROUP_PARTS: tl.constexpr = False,
    W_FP8: tl.constexpr = False,
):
    # Up to 4 decode rows (BLOCK_M) x a (BLOCK_N, BLOCK_K) weight tile a step, the codes loaded as int32 words
    # (w_ptr: the stored rows viewed as int32, s_wn in words), 16 bytes a load. Float x (A_MODE 0): each code
    # becomes an exact float32 by _code_f32 (LOP3 + FADD) and meets its x element (column WPW * word + J, loaded
    # per code position J) in one FFMA. int8 x (A_MODE 1; x_ptr: int32 words of codes, s_xm in words): dp4a on
    # whole words (int4: nibbles moved to the high half of each byte, i.e. 16 q, the sums shifted back by 4:
    # exact while |sum| < 2^31, k < 2^17). Each row has its own 2-D accumulator in the weight tile's layout
    # (a 3-D rows x tile product made Triton move the codes through shared memory every step); products stay
    # elementwise over words across the loop and are reduced once, per group (BLOCK_K == GROUP) when the scales
    # are per group.
    # SPLIT: program (tile, pid_k) sums k in [pid_k * kw_split * WPW, +kw_split * WPW) and stores its partial
    # (float32, or exact int32 for int8 x per channel / tensor) to part_ptr; the last of the tile's n_split programs
    # adds them up (_split_gather), applies the scales and the bias. GROUP_PARTS (int8 x, per-group scales, split):
    # each program stores every group's scaled product float(acc_t) * s_t at part_ptr[t] instead, and the last one
    # adds all n_groups of them in group order from 0 (_group_gather): int_matmul_ref's sum, bit for bit, with
    # the K split that a single program per tile lacked (W4A8 at batch 1: 20 dependent K steps, no split).
    WPW: tl.constexpr = 8 if W4 else 4
    KW: tl.constexpr = BLOCK_K // WPW
    n_blocks = tl.cdiv(N, BLOCK_N)
    tile = tl.program_id(0)
    pid_n, pid_m, pid_k = tile % n_blocks, tile // n_blocks, tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, KW)
    mm, mn = offs_m < M, offs_n < N
    rows = offs_m.to(tl.int64)
    cols = offs_n.to(tl.int64)
    # the split in words (kw_split): a multiple of 16 words whose divisibility the compiler sees (16-byte loads)
    k0 = pid_k * kw_split * WPW
    k_len = tl.minimum(kw_split * WPW, K - k0)
    w_ptrs = w_ptr + cols[:, None] * s_wn + pid_k * kw_split + offs_c[None, :]
    if PREFETCH:  # (EVEN_K) the next step's words are loaded before this step's arithmetic: two tiles in flight
        # the weight is never written by a decode step: its first tile is requested before waiting on the kernel
        # before (PDL), so that the stream starts during that kernel's tail
        w_next = tl.load(w_ptrs, mask=mn[:, None], other=0)
    gdc_enter(USE_GDC)  # PDL (ssmq.kernels._common): x, its scales, the counters and partials only after it
    r0 = pid_m * BLOCK_M
    # x's pointer unit: XE columns (int8 x: int32 words of 4 codes; 16-bit float x: int32 pairs)
    XE: tl.constexpr = 4 if A_MODE != 0 else 2 if X16 else 1
    x_ptrs = x_ptr + r0.to(tl.int64) * s_xm + pid_k * kw_split * (WPW // XE) + offs_c * (WPW // XE)
    XSTEP: tl.constexpr = BLOCK_K // XE
    ACC = tl.int32 if A_MODE == 1 else tl.float32
    if A_MODE != 0:
        if XS_ROWS:
            xs = tl.load(xs_ptr + offs_m, mask=mm, other=0.0)
            xs0 = tl.load(xs_ptr + r0)
            xs1 = tl.load(xs_ptr + tl.minimum(r0 + 1, M - 1))
            xs2 = tl.load(xs_ptr + tl.minimum(r0 + 2, M - 1))
            xs3 = tl.load(xs_ptr + tl.minimum(r0 + 3, M - 1))
        else:
            xs = tl.load(xs_ptr + offs_m * 0)
            xs0 = tl.load(xs_ptr)
            xs1, xs2, xs3 = xs0, xs0, xs0
    else:
        xs = tl.zeros((BLOCK_M,), dtype=tl.float32)
        xs0, xs1, xs2, xs3 = 0.0, 0.0, 0.0, 0.0
    # per row r < BLOCK_M: products p_r, x sums x_r (zero points), group-scaled sums a_r (per-group scales)
    p0 = tl.zeros((BLOCK_N, KW), dtype=ACC)
    p1, p2, p3 = p0, p0, p0
    x0 = tl.zeros((KW,), dtype=tl.float32)
    x1, x2, x3 = x0, x0, x0
    a0 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    a1, a2, a3 = a0, a0, a0
    for k in range(0, k_len, BLOCK_K):
        if EVEN_K:
            mw = mn[:, None]
            mc = offs_c >= 0
        else:
            mc = offs_c < (k_len - k) // WPW
            mw = mn[:, None] & mc[None, :]
        if PREFETCH:
            w = w_next
            w_next = tl.load(w_ptrs + KW, mask=mn[:, None] & (offs_c * 0 + k + BLOCK_K < k_len)[None, :], other=0)
        else:
            w = tl.load(w_ptrs, mask=mw, other=0)
        lo, hi = _code_halves(w, W4)  # unused (dead code) for fp8 weights and int8 x
        if WS_MODE == 2:
            q0 = tl.zeros((BLOCK_N, KW), dtype=ACC)
            q1, q2, q3 = q0, q0, q0
            y0 = tl.zeros((KW,), dtype=tl.float32)
            y1, y2, y3 = y0, y0, y0
        else:
            q0, q1, q2, q3, y0, y1, y2, y3 = p0, p1, p2, p3, x0, x1, x2, x3
        q0, y0 = _row_step(q0, y0, w, lo, hi, x_ptrs, mc & (r0 < M), A_MODE, W4, HAS_ZERO, X16, XBF16, PTX,
                           W_FP8)
        if BLOCK_M > 1:
            q1, y1 = _row_step(q1, y1, w, lo, hi, x_ptrs + s_xm, mc & (r0 + 1 < M), A_MODE, W4,
                               HAS_ZERO, X16, XBF16, PTX, W_FP8)
        if BLOCK_M > 2:
            q2, y2 = _row_step(q2, y2, w, lo, hi, x_ptrs + 2 * s_xm, mc & (r0 + 2 < M), A_MODE, W4,
                               HAS_ZERO, X16, XBF16, PTX, W_FP8)
            q3, y3 = _row_step(q3, y3, w, lo, hi, x_ptrs + 3 * s_xm, mc & (r0 + 3 < M), A_MODE, W4,
                               HAS_ZERO, X16, XBF16, PTX, W_FP8)
        if WS_MODE == 2:
            t = (k0 + k) // GROUP
            s = tl.load(ws_ptr + cols * n_groups + t, mask=mn, other=0.0)
            if HAS_ZERO:
                z = tl.load(wz_ptr + cols * n_groups + t, mask=mn, other=0).to(tl.float32)
            else:
                z = s
            if GROUP_PARTS:  # this group's products alone (0 + x = x), stored at part_ptr[t]
                zero = tl.zeros((BLOCK_N,), dtype=tl.float32)
                g0 = _row_group(zero, q0, y0, s, z, xs0, A_MODE, W4, HAS_ZERO)
                g1, g2, g3 = g0, g0, g0
                if BLOCK_M > 1:
                    g1 = _row_group(zero, q1, y1, s, z, xs1, A_MODE, W4, HAS_ZERO)
                if BLOCK_M > 2:
                    g2 = _row_group(zero, q2, y2, s, z, xs2, A_MODE, W4, HAS_ZERO)
                    g3 = _row_group(zero, q3, y3, s, z, xs3, A_MODE, W4, HAS_ZERO)
                tl.store(part_ptr + t * M * N + rows[:, None] * N + offs_n[None, :],
                         _rows_tile(g0, g1, g2, g3, offs_m), mask=mm[:, None] & mn[None, :])
            else:
                a0 = _row_group(a0, q0, y0, s, z, xs0, A_MODE, W4, HAS_ZERO)
                if BLOCK_M > 1:
                    a1 = _row_group(a1, q1, y1, s, z, xs1, A_MODE, W4, HAS_ZERO)
                if BLOCK_M > 2:
                    a2 = _row_group(a2, q2, y2, s, z, xs2, A_MODE, W4, HAS_ZERO)
                    a3 = _row_group(a3, q3, y3, s, z, xs3, A_MODE, W4, HAS_ZERO)
        else:
            p0, p1, p2, p3, x0, x1, x2, x3 = q0, q1, q2, q3, y0, y1, y2, y3
        w_ptrs += KW
        x_ptrs += XSTEP
    if WS_MODE == 2:
        tot = _rows_tile(a0, a1, a2, a3, offs_m)
    else:
        if HAS_ZERO:
            z = tl.load(wz_ptr + (offs_n if WS_MODE == 1 else offs_n * 0), mask=mn, other=0).to(tl.float32)
        else:
            z = a0
        tot = _rows_tile(_row_total(p0, x0, z, A_MODE, W4, HAS_ZERO), _row_total(p1, x1, z, A_MODE, W4, HAS_ZERO),
                         _row_total(p2, x2, z, A_MODE, W4, HAS_ZERO), _row_total(p3, x3, z, A_MODE, W4, HAS_ZERO),
                         offs_m)
    if GROUP_PARTS:
        p_off = rows[:, None] * N + offs_n[None, :]
        tot, last = _group_gather(part_ptr, cnt_ptr, tile, n_split, n_groups, M * N, p_off,
                                  mm[:, None] & mn[None, :], offs_m, NSP)
        mm = mm & last
    elif SPLIT:
        p_off = rows[:, None] * N + offs_n[None, :]
        mo = mm[:, None] & mn[None, :]
        tl.store(part_ptr + pid_k * M * N + p_off, tot, mask=mo)
        tot, last = _split_gather(part_ptr, cnt_ptr, tile, n_split, M * N, p_off, mo, offs_m, NSP)
        mm = mm & last  # only the last program of the tile stores the output
    _finish_words(tot, xs, ws_ptr, wz_ptr, b_ptr, out_ptr, offs_n, mn, rows, mm, s_om, A_MODE, WS_MODE, HAS_BIAS)


@triton.jit
def _int_epilogue(acc_ptr, xs_ptr, ws_ptr, b_ptr, out_ptr, M, N, XS_ROWS: tl.constexpr, WS_COLS: tl.constexpr,
                  HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # int_matmul_ref's epilogue over torch._int_mm's int32 result in one pass: float(acc) * (xs * ws) + bias
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mm, mn = offs_m < M, offs_n < N
    idx = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    acc = tl.load(acc_ptr + idx, mask=mm[:, None] & mn[None, :], other=0).to(tl.float32)
    xs = tl.load(xs_ptr + (offs_m if XS_ROWS else offs_m * 0), mask=mm, other=0.0)
    ws = tl.load(ws_ptr + (offs_n if WS_COLS else offs_n * 0), mask=mn, other=0.0)
    out = acc * (xs[:, None] * ws[None, :])
    if HAS_BIAS:
        out += tl.load(b_ptr + offs_n, mask=mn, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + idx, out.to(out_ptr.dtype.element_ty), mask=mm[:, None] & mn[None, :])


@fast_launch
@triton.jit
def _quantize_rows(x_ptr, s_ptr, q_ptr, xs_ptr, K, s_xm, QMAX: tl.constexpr, EPS_: tl.constexpr,
                   STATIC: tl.constexpr, ROW_SCALE: tl.constexpr, FP8: tl.constexpr, BLOCK: tl.constexpr):
    # one program per row: absmax -> scale -> codes, with the reference's IEEE division and rounding; a given
    # scale: one (STATIC) or one a row (ROW_SCALE)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < K
    x = tl.load(x_ptr + row * s_xm + offs, mask=m, other=0.0).to(tl.float32)
    if ROW_SCALE:
        scale = tl.load(s_ptr + row)
    elif STATIC:
        scale = tl.load(s_ptr)
    else:
        scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=0), QMAX), EPS_)
        tl.store(xs_ptr + row, scale)
    y = tl.math.div_rn(x, scale)
    if FP8:
        q = tl.minimum(tl.maximum(y, -QMAX), QMAX).to(q_ptr.dtype.element_ty)
    else:
        # round half to even as torch.round: adding and subtracting 1.5 * 2^23 leaves the float32 sum
        # rounded to an integer by the hardware's round-to-nearest-even (exact for |y| < 2^22; y is
        # clamped first, which changes no code)
        y = tl.minimum(tl.maximum(y, -129.0), 128.0)
        q = tl.minimum(tl.maximum((y + 12582912.0) - 12582912.0, -128.0), 127.0).to(tl.int8)
    tl.store(q_ptr + row * K + offs, q, mask=m)


@fast_launch
@triton.jit
def _dequant(w_ptr, ws_ptr, wz_ptr, out_ptr, N, K, n_groups, s_wn,
             W4: tl.constexpr, W_FP8: tl.constexpr, WS_MODE: tl.constexpr, HAS_ZERO: tl.constexpr,
             GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TILE_GROUP: tl.constexpr):
    # (BLOCK_N, BLOCK_K) tile of the dequantized weight, written in out's dtype (the cuBLAS prefill path).
    # int4: the tile's packed bytes are loaded once, as one contiguous (BLOCK_N, BLOCK_K / 2) run per row, and
    # their nibbles interleaved in registers (low nibble = even k); TILE_GROUP (BLOCK_K divides GROUP): the tile
    # lies in one scale group, so its scales are one (BLOCK_N,) load, not a gather per element. (The first
    # version gathered each byte twice and each scale per element: 105 us a Mamba2-2.7B layer on the H100,
    # against ~20 us of bytes.)
    pid_k = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mn = (offs_n < N)[:, None]
    m = mn & (offs_k < K)[None, :]
    cols = offs_n.to(tl.int64)[:, None]
    if W4:
        offs_b = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
        b = tl.load(w_ptr + cols * s_wn + offs_b[None, :], mask=mn & (offs_b < (K + 1) // 2)[None, :],
                    other=0).to(tl.int8, bitcast=True)
        q = tl.reshape(tl.join((b << 4) >> 4, b >> 4), (BLOCK_N, BLOCK_K)).to(tl.float32)
    else:
        q = tl.load(w_ptr + cols * s_wn + offs_k[None, :], mask=m, other=0)
        if W_FP8:
            q = q.to(tl.float8e4nv, bitcast=True)
        q = q.to(tl.float32)
    if WS_MODE == 2 and TILE_GROUP:
        p_off = cols * n_groups + (pid_k * BLOCK_K) // GROUP
        pm = mn
    elif WS_MODE == 2:
        p_off = cols * n_groups + (offs_k // GROUP)[None, :]
        pm = m
    elif WS_MODE == 1:
        p_off = cols
        pm = mn
    else:
        p_off = cols * 0
        pm = mn
    if HAS_ZERO:
        q -= tl.load(wz_ptr + p_off, mask=pm, other=0).to(tl.float32)
    w = q * tl.load(ws_ptr + p_off, mask=pm, other=0.0)
    tl.store(out_ptr + cols * K + offs_k[None, :], w.to(out_ptr.dtype.element_ty), mask=m)


def _underfilled(N: int, f: dict, device: torch.device, cfg: dict) -> bool:
    """Whether the weight-only prefill tiling has fewer than MID_FILL x SMs column tiles (e.g. out_proj)."""
    bn = cfg["BN_PRE_GROUP"] if f["group_size"] is not None else cfg["BN_PRE"]
    return cdiv(N, bn) < cfg["MID_FILL"] * sm_count(device)


def _ws_mode(w_scale) -> int:
    return 2 if w_scale.dim() == 2 else int(w_scale.dim() == 1)


def _supported(f: dict, x_dtype: torch.dtype) -> bool:
    g = f["group_size"]
    # BLOCK_K = g must be a power of two whose (int4: half) width fills a tensor-core K step (16; int8: 32)
    if g is not None and (g & (g - 1) or g < (16 if x_dtype != torch.int8 else 32) * (2 if f["bits"] == 4 else 1)):
        return False
    return x_dtype in (torch.float16, torch.bfloat16, torch.float32, torch.int8, torch.float8_e4m3fn)


def _plan(M: int, N: int, K: int, f: dict, a_mode: int, sms: int, cfg: dict) -> dict:
    g = f["group_size"]
    fma = M <= cfg["FMA_MAX_ROWS"]
    decode = M <= DECODE_ROWS
    # weight-only batches of 17 .. MID_MAX_ROWS rows: one row tile, a short K split
    mid = not decode and M <= cfg["MID_MAX_ROWS"] and a_mode == 0
    if fma:
        BM = pow2(M)
        BK = g if g is not None else min(max(32, cfg["BK_FMA"] // BM), pow2(K, 32))
        BN = min(max(1, cfg["TILE_FMA"] // (BK * BM)), pow2(N))  # TILE_FMA weight elements a tile
        nw, ns = cfg["warps_fma"], cfg["stages_fma"]
    elif decode:
        BM, BN, BK, nw, ns = 16, cfg["BN_DEC"], cfg["BK_DEC"], cfg["warps_dec"], cfg["stages_dec"]
    elif mid:
        BM, BN, BK, nw, ns = pow2(M, 16), cfg["BN_MID"], cfg["BK_PRE"], cfg["warps_mid"], cfg["stages_mid"]
    else:
        BM, BN, BK, nw, ns = cfg["BM_PRE"], cfg["BN_PRE"], cfg["BK_PRE_A8" if a_mode == 1 else "BK_PRE"], \
            cfg["warps_pre"], cfg["stages_pre"]
        if a_mode == 0 and f["bits"] == 4 and M <= cfg["W4_WARPS_MAX_ROWS"]:
            nw = cfg["warps_pre_w4"]
        if g is not None:
            BN = min(BN, cfg["BN_PRE_GROUP"])
        BM = min(BM, pow2(M, 16))
    if not fma:
        BN = min(BN, pow2(N, 16))
        BK = g if g is not None else min(BK, pow2(K, 32))
    m_blocks, n_blocks = cdiv(M, BM), cdiv(N, BN)
    split = 1
    # split K over programs (float32 partial sums) only where the result is not bit-exact anyway
    if mid:
        split = max(1, min(cfg["MID_SPLIT"], K // cfg["MIN_SPLIT_K"]))
    elif decode and (a_mode == 0 or (a_mode == 2 and fma)):
        want = cdiv(cfg["WAVES"] * sms, n_blocks * m_blocks)
        split = max(1, min(cfg["MAX_SPLIT"], want, K // cfg["MIN_SPLIT_K"]))
    k_split = cdiv(cdiv(K, split), BK) * BK
    split = cdiv(K, k_split)
    return dict(FMA=fma, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, num_warps=nw, num_stages=ns, split=split,
                DEQ_W=not decode and a_mode == 0 and g is not None,
                k_split=k_split, EVEN_K=K % BK == 0 and k_split % BK == 0, grid=(n_blocks * m_blocks, split))


def _words_ok(x2, w_q, f: dict, a_mode: int, cfg: dict) -> bool:
    """Whether _qgemv_words serves this call: int8 / int4 codes with float or int8 x, or fp8 codes (per channel /
    tensor) with float or fp8 x, up to WORD_MAX_ROWS rows, rows of whole 32-bit words (k a multiple of 8 for int4,
    4 for 8-bit codes; 8-bit x rows too)."""
    M, K = x2.shape
    wpw = 8 if f["bits"] == 4 else 4
    g = f["group_size"]
    fmt_ok = (a_mode in (0, 2) and g is None and cfg["WORD_FP8"]) if f["fp8"] else a_mode in (0, 1)
    return (0 < M <= min(cfg["WORD_MAX_ROWS"], 4) and fmt_ok and K % wpw == 0
            and w_q.stride(0) % 4 == 0 and w_q.data_ptr() % 4 == 0 and (g is None or g % wpw == 0)
            and (x2.dtype == torch.float32
                 or (x2.stride(0) % (4 // x2.element_size()) == 0 and x2.data_ptr() % 4 == 0))
            # 8-bit codes: only where the tensor-core _qmm's tiling would leave SMs idle (out_proj-like shapes;
            # see WORD_8BIT_UNDERFILLED); checked last, after the cheap conditions
            and not (f["bits"] == 8 and cfg["WORD_8BIT_UNDERFILLED"] and not _underfilled(f["n"], f, x2.device, cfg)))


def _plan_words(M: int, N: int, K: int, f: dict, a_mode: int, sms: int, cfg: dict) -> dict:
    g = f["group_size"]
    wpw = 8 if f["bits"] == 4 else 4
    BM = pow2(M)
    BK = g if g is not None else wpw * min(cfg["KW_W"], pow2(K // wpw))
    BN = min(max(64, cfg["TILE_W"] // BM), pow2(N))  # 64+: each thread's x serves 2+ weight rows
    m_blocks, n_blocks = cdiv(M, BM), cdiv(N, BN)
    split = 1
    # int8 x per group: int_matmul_ref sums the groups' scaled products in order: a split stores them per group
    # (GROUP_PARTS) for the last program to add in that order, up to MAX_GROUP_PARTS groups (its unrolled loads)
    if not (a_mode == 1 and g is not None and K // g > cfg["MAX_GROUP_PARTS"]):
        # enough programs for WAVES_W an SM, and at most ITERS_W K steps a program: each step is a dependent
        # round trip to memory, so a long K loop is latency-bound (first H100 run: 4 rows unsplit,
        # 20 steps, 46 us at in_proj; W8A8 10 steps 24 us)
        want = max(cdiv(cfg["WAVES_W"] * sms, n_blocks * m_blocks),
                   cdiv(cdiv(K, BK), cfg["ITERS_W"]))
        split = max(1, min(cfg["MAX_SPLIT_W"], want, K // cfg["MIN_SPLIT_K_W"]))
    k_split = cdiv(cdiv(K, split), BK) * BK
    split = cdiv(K, k_split)
    return dict(BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, split=split, k_split=k_split, tiles=n_blocks * m_blocks,
                EVEN_K=K % BK == 0 and k_split % BK == 0, grid=(n_blocks * m_blocks, split))


def _launch_words(x2, xs, w_q, w_scale, w_zero, bias, out, f, a_mode, cfg):
    M, K = x2.shape
    N = f["n"]
    c = _plan_words(M, N, K, f, a_mode, sm_count(x2.device), cfg)
    split = c["split"]
    n_groups = w_scale.shape[1] if w_scale.dim() == 2 else 1
    group_parts = split > 1 and a_mode == 1 and f["group_size"] is not None
    part, cnt = split_buffers(split, M, N, c["tiles"], x2.device,
                              torch.int32 if a_mode == 1 and f["group_size"] is None else torch.float32, out,
                              depth=n_groups if group_parts else split)
    x16 = a_mode == 0 and x2.dtype != torch.float32
    xw = (x2.view(torch.int8) if a_mode == 2 else x2).view(torch.int32) if a_mode != 0 or x16 else x2
    dummy = w_scale
    _qgemv_words[c["grid"]](
        xw, xs if xs is not None else dummy, (w_q.view(torch.int8) if f["fp8"] else w_q).view(torch.int32), w_scale, w_zero if w_zero is not None else dummy,
        bias if bias is not None else dummy, out, part, cnt,
        M, N, K, c["k_split"] // (8 if f["bits"] == 4 else 4), split, n_groups,
        xw.stride(0),
        w_q.stride(0) // 4, N,
        A_MODE=a_mode, XS_ROWS=xs is not None and xs.dim() == 1, W4=f["bits"] == 4, WS_MODE=_ws_mode(w_scale),
        HAS_ZERO=w_zero is not None, HAS_BIAS=bias is not None, GROUP=f["group_size"] or 1, EVEN_K=c["EVEN_K"],
        SPLIT=split > 1, NSP=pow2(n_groups if group_parts else split), GROUP_PARTS=group_parts, X16=x16, XBF16=x2.dtype == torch.bfloat16, PTX=x2.is_cuda,
        PREFETCH=cfg["PREFETCH_W"] and c["EVEN_K"], BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"],
        W_FP8=f["fp8"], num_warps=cfg["warps_w"], num_stages=cfg["stages_w"], **pdl_args(x2),
        # the integer paths reproduce int_matmul_ref's separately rounded products and sums
        enable_fp_fusion=a_mode != 1)
    return out


def _launch_qmm(x2, xs, w_q, w_scale, w_zero, bias, out, f, a_mode, cfg, quant_x=0):
    M, K = x2.shape
    if not quant_x and _words_ok(x2, w_q, f, a_mode, cfg):
        return _launch_words(x2, xs, w_q, w_scale, w_zero, bias, out, f, a_mode, cfg)
    N = f["n"]
    c = _plan(M, N, K, f, a_mode, sm_count(x2.device), cfg)
    split = c["split"]
    part, cnt = split_buffers(split, M, N, c["grid"][0], x2.device, torch.float32, out)
    dummy = w_scale
    if f["fp8"]:  # raw bytes: the kernel reinterprets them (see _qmm)
        w_q = w_q.view(torch.int8)
        x2 = x2.view(torch.int8) if a_mode == 2 and not quant_x else x2
    # the K split summed inside _qmm (SPLIT_IN_KERNEL), or by _sum_splits after it
    in_kernel = split > 1 and cfg["SPLIT_IN_KERNEL"] and not c["FMA"]
    args = (x2, xs if xs is not None else dummy, w_q, w_scale, w_zero if w_zero is not None else dummy,
            bias if bias is not None else dummy, part, out, cnt if in_kernel else part,
            M, N, K, c["k_split"], w_scale.shape[1] if w_scale.dim() == 2 else 1, x2.stride(0), w_q.stride(0),
            N, M * N)
    common = dict(A_MODE=a_mode, XS_ROWS=xs is not None and xs.dim() == 1, W4=f["bits"] == 4, W_FP8=f["fp8"],
                  WS_MODE=_ws_mode(w_scale), HAS_ZERO=w_zero is not None, HAS_BIAS=bias is not None and split == 1,
                  GROUP=f["group_size"] or 1, EVEN_K=c["EVEN_K"], BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"],
                  BLOCK_K=c["BLOCK_K"], num_warps=c["num_warps"], num_stages=c["num_stages"],
                  # the integer paths reproduce int_matmul_ref's separately rounded products and sums
                  enable_fp_fusion=a_mode == 0)
    if c["FMA"]:
        _qgemv[c["grid"]](*args, **common)
    else:
        # int8 codes only: for int4 the bit assembly measured slower than I2F (in_proj 22 vs 18.7 us)
        fast = (cfg["FAST_CVT"] and a_mode == 0 and x2.is_cuda and x2.dtype == torch.float16 and f["bits"] == 8
                and not f["fp8"] and not c["DEQ_W"])
        _qmm[c["grid"]](*args, DEQ_W=c["DEQ_W"], FAST_CVT=fast, QUANT_X=quant_x,
                        X_STRIDED=cfg["X_STRIDED"] and f["bits"] == 4 and not c["DEQ_W"],
                        QMAX=FP8_MAX if a_mode == 2 else 127.0, EPS_=EPS, SPLIT_IN=in_kernel, NSP=pow2(split),
                        FIN_BIAS=bias is not None, **pdl_args(x2),
                        PRECISION=dot_precision(x2.dtype) if a_mode == 0 else "tf32", **common)
    if split > 1 and not in_kernel:
        BLOCK = 1024
        _sum_splits[(cdiv(M * N, BLOCK),)](
            part, bias if bias is not None else part, out, M * N, N, split,
            HAS_BIAS=bias is not None, BLOCK=BLOCK, num_warps=4, **pdl_args(x2))
    return out


def dequantize_weight(w_q, w_scale, w_zero=None, dtype=torch.float16, f: dict | None = None) -> torch.Tensor:
    """(n, k) weight in ``dtype``: (q - zero) * scale in float32, rounded once (ops.dequantize_weight's values); f: the
    weight's ``weight_format`` when the caller has read it."""
    f = f or weight_format(w_q, w_scale, w_zero)
    N, K = f["n"], f["k"]
    out = torch.empty((N, K), device=w_q.device, dtype=dtype)
    g = f["group_size"]
    BN, BK = 32, min(128, g) if g and g & (g - 1) == 0 else 128
    _dequant[(cdiv(N, BN), cdiv(K, BK))](
        w_q.view(torch.int8) if f["fp8"] else w_q, w_scale,
        w_zero if w_zero is not None else w_scale, out, N, K,
        w_scale.shape[1] if w_scale.dim() == 2 else 1, w_q.stride(0),
        W4=f["bits"] == 4, W_FP8=f["fp8"], WS_MODE=_ws_mode(w_scale), HAS_ZERO=w_zero is not None,
        GROUP=g or 1, BLOCK_N=BN, BLOCK_K=BK, TILE_GROUP=g is not None and g % BK == 0, num_warps=4)
    return out


def quant_linear(x, w_q, w_scale, w_zero=None, x_scale=None, bias=None, out_dtype=None, cfg=None):
    """``ops.quant_linear_ref`` on the GPU (same signature and formats); ``cfg`` overrides CFG entries."""
    cfg = CFG if cfg is None else {**CFG, **cfg}
    f = weight_format(w_q, w_scale, w_zero)
    if not _supported(f, x.dtype):
        return quant_linear_ref(x, w_q, w_scale, w_zero, x_scale, bias, out_dtype)
    K, N = f["k"], f["n"]
    if x.shape[-1] != K:
        raise SSMQError(f"x has {x.shape[-1]} features, the quantized weight has {K}")
    lead = x.shape[:-1]
    M = math.prod(lead)
    x2 = x.reshape(M, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    a_mode = {torch.int8: 1, torch.float8_e4m3fn: 2}.get(x.dtype, 0)
    if a_mode:
        if x_scale is None:
            raise SSMQError(f"{x.dtype} activations need their x_scale")
        if (a_mode == 1 and (f["fp8"] or w_zero is not None)) or (a_mode == 2 and not f["fp8"]):
            return quant_linear_ref(x, w_q, w_scale, w_zero, x_scale, bias, out_dtype)  # raises the error
        xs = x_scale.reshape(-1) if x_scale.dim() else x_scale
        out_dtype = out_dtype or torch.float32
    else:
        xs = None
        out_dtype = out_dtype or x.dtype
    out_shape = (*lead, N)
    if M == 0 or N == 0:
        return torch.empty(out_shape, device=x.device, dtype=out_dtype)
    if M > DECODE_ROWS or (a_mode == 2 and M >= cfg["FP8_CUBLAS_ROWS"]):
        int_mm = cfg["PREFILL_A8"] == "int_mm" or (cfg["PREFILL_A8"] == "auto" and M < cfg["A8_TRITON_ROWS"])
        if a_mode == 1 and f["bits"] == 8 and f["group_size"] is None and int_mm \
                and K % 8 == 0 and N % 8 == 0:
            # cuBLASLt's int8 GEMM (TN layout: w_q.t() is the stored rows), then the reference's epilogue
            out = torch.empty(out_shape, device=x.device, dtype=out_dtype)
            out2 = out.view(M, N)
            acc = torch._int_mm(x2, w_q.t())
            BM, BN = 32, 128
            _int_epilogue[(cdiv(M, BM), cdiv(N, BN))](
                acc, xs, w_scale, bias if bias is not None else w_scale, out2, M, N, XS_ROWS=xs.dim() == 1,
                WS_COLS=w_scale.dim() == 1, HAS_BIAS=bias is not None, BLOCK_M=BM, BLOCK_N=BN, num_warps=4,
                enable_fp_fusion=False)
            return out
        # the cuBLAS paths return cuBLAS's own (M, N) output (no copy into ``out``: 128 copies of 7.6 us in a
        # Mamba2-2.7B prefill of 1024 tokens on the H100) unless the dtype differs
        if a_mode == 2 and K % 16 == 0 and N % 16 == 0 and _SCALED_MM_OK.get(out_dtype, True):
            try:
                return _as_out(_scaled_mm(x2, xs, w_q, w_scale, bias, out_dtype), out_shape, out_dtype)
            except RuntimeError:  # this torch's cuBLASLt path refuses the scale layout / output dtype
                _SCALED_MM_OK[out_dtype] = False
        cublas = cfg["PREFILL_A16"] == "cublas" or (cfg["PREFILL_A16"] == "auto" and (
            M >= cfg["CUBLAS_ROWS"] or (M > cfg["MID_MAX_ROWS"] and _underfilled(N, f, x.device, cfg))))
        if a_mode == 0 and cublas and x.dtype != torch.float32:
            w = dequantize_weight(w_q, w_scale, w_zero, x.dtype, f)
            return _as_out(torch.nn.functional.linear(x2, w, None if bias is None else bias.to(x.dtype)), out_shape,
                           out_dtype)
    out = torch.empty(out_shape, device=x.device, dtype=out_dtype)
    _launch_qmm(x2, xs, w_q, w_scale, w_zero, bias, out.view(M, N), f, a_mode, cfg)
    return out


_SCALED_MM_OK: dict = {}


def quant_linear_act(x, w_q, w_scale, x_scale=None, per_token=True, act_dtype=torch.int8, bias=None, out_dtype=None,
                     cfg=None):
    """``ops.quant_linear_act_ref`` on the GPU: quantize_act, then quant_linear; with CFG's FUSE_ACT_QUANT,
    decode rows (up to DECODE_ROWS, tensor-core path) with a per-token dynamic or a static scale are quantized
    inside ``_qmm`` instead. Off by default: exact, but measured far slower (H100, batch 1: a
    Mamba2-2.7B linear 100 us per token dynamic, 324 us static, vs about 17 us + the 4.4 us quantize kernel),
    and CUDA-graph decode of dynamic-activation models differed from eager in the same run (not resolved)."""
    cfg = CFG if cfg is None else {**CFG, **cfg}
    # off (the default), the weight's format is read once, by quant_linear
    f = weight_format(w_q, w_scale, None) if cfg["FUSE_ACT_QUANT"] else None
    M = math.prod(x.shape[:-1])
    a_mode = {torch.int8: 1, torch.float8_e4m3fn: 2}.get(act_dtype, 0)
    fused = (f is not None and cfg["FMA_MAX_ROWS"] < M <= DECODE_ROWS
             and x.dtype in (torch.float16, torch.bfloat16, torch.float32) and (per_token or x_scale is not None)
             and x.shape[-1] == f["k"] and a_mode != 0 and f["fp8"] == (a_mode == 2) and _supported(f, act_dtype))
    if not fused:
        x_q, xs = quantize_act(x, x_scale, per_token, act_dtype)
        return quant_linear(x_q, w_q, w_scale, None, xs, bias, out_dtype or x.dtype, cfg=cfg)
    x2 = x.reshape(M, f["k"])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((*x.shape[:-1], f["n"]), device=x.device, dtype=out_dtype or x.dtype)
    xs = None if x_scale is None else x_scale.float().reshape(())
    _launch_qmm(x2, xs, w_q, w_scale, None, bias, out.view(M, f["n"]), f, a_mode, cfg, quant_x=1 if xs is None else 2)
    return out


def _as_out(y2: torch.Tensor, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """cuBLAS's (M, N) result y2 in the caller's ``shape`` and ``dtype``: a view when it already has the dtype (the
    output is never allocated twice: at prefill it is the largest activation), else a converted copy."""
    if y2.dtype == dtype and y2.is_contiguous():
        return y2.view(shape)
    return y2.to(dtype).reshape(shape)


def _scaled_mm(x2, xs, w_q, w_scale, bias, out_dtype):
    """FP8 prefill on cuBLASLt: per-row x scales and per-channel (or per-tensor) weight scales; (M, N)."""
    M, N = x2.shape[0], w_q.shape[0]
    sa = (xs.reshape(-1, 1) if xs.dim() else xs.reshape(1, 1).expand(M, 1)).contiguous()
    sb = (w_scale.reshape(1, -1) if w_scale.dim() else w_scale.reshape(1, 1).expand(1, N)).contiguous()
    y = torch._scaled_mm(x2, w_q.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y


def quantize_act(x, x_scale=None, per_token=True, dtype=torch.int8):
    """``ops.quantize_act_ref`` on the GPU: one program per row; dynamic per-tensor takes its absmax first; a given
    scale is one, or with ``per_token`` one a row (x.shape[:-1])."""
    K = x.shape[-1]
    lead = x.shape[:-1]
    M = math.prod(lead)
    x2 = x.reshape(M, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    q = torch.empty((*lead, K), device=x.device, dtype=dtype)
    fp8 = dtype == torch.float8_e4m3fn
    qmax = FP8_MAX if fp8 else 127.0
    static = x_scale is not None or not per_token
    row_scale = False
    if x_scale is not None:
        x_scale, row_scale = given_act_scale(x_scale, lead, per_token)
    elif not per_token:
        # one scale for the tensor: the reference's (absmax / qmax) clamped, computed by torch
        x_scale = absmax_scale(x2.float().abs().amax(), qmax)
    xs = x_scale if static else torch.empty(lead, device=x.device, dtype=torch.float32)
    if M == 0:
        return q, xs
    _quantize_rows[(M,)](x2, x_scale.contiguous() if static else xs, q, xs, K, x2.stride(0), QMAX=qmax, EPS_=EPS,
                         STATIC=static, ROW_SCALE=row_scale, FP8=fp8, BLOCK=pow2(K, 16),
                         num_warps=4 if K <= 4096 else 8)
    return q, xs
