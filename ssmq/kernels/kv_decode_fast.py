"""The fast KVQuant decode kernel, which ``ssmq.kernels.dispatch.QUANT_KV_DECODE`` selects for the formats it
serves that ``kv_decode_warp`` does not: 2-4 bit codes,
head dims that are multiples of 32, rotary dims that are multiples of 16, with or without sparse outliers. Its
products are never narrower than 32 (32-token tiles, ``MIN_DIM``-padded rotary halves and pass-through tiles):
16-wide tensor-core products fed by the PRMT lookups came out wrong on the H100 with Triton 3.6 (16-channel
rotary halves, 16-token tiles; ``decode_any`` isolates such failures on a GPU). Other formats keep the
general kernel (``ssmq.kernels.kv_decode``, every format), whose host helpers this one shares.

Triton flash-decoding attention over a quantized KV cache (KVQuant: LUT low-bit K and V), or a float one.

Glossary: b rows, hq query heads, hkv kv heads, g = hq / hkv query heads a kv head serves, e head dim, T tokens,
r rotary dim, S sink tokens, k outlier slots, n a row's length, P splits of a row's tokens, B codebook values
c[code] of a tile (float16), GS codes a packed byte (2 for 4 bits, 4 for 2 bits and for the 2-bit plane of 3
bits, whose 1-bit plane holds 8 a byte).
Same contract as ``ssmq.ops.kv_quant.quant_kv_decode_ref`` (its docstring has the storage layout).

One program per (row, kv head, split): the split's tokens in (BLOCK_T, e) tiles, each tile read once for the
kv head's g query heads (the M rows of float16 tensor-core products, padded to GP_MIN), with an online softmax
(running max m, sum l, unnormalized output acc):
    codes    a tile's packed bytes, loaded as bytes (vectorized), turned into float16 codebook values B with
             byte-permute lookups (``_LUT4`` / ``_LUT3`` / ``_LUT2``: the 16 / 8 / 4 fp16 entries live in 8 / 4 /
             2 registers, PRMT selects bytes by the codes; ~2.6 / 3 / 1.5 instructions a code, no memory
             gather), on the GPU; the interpreter takes ``_codes`` + a gathered LUT
    keys     x = mid + half · B in float32 (per-channel or per-token scales), rotated by their position (RoPE on
             the fly: keys are cached before it; a rotation per token cannot move to the query, as R_t differs per
             token), then float16; scores (g, BLOCK_T) = q · kᵀ, q pre-scaled and float16, three products (the
             rotary halves and the pass-through channels). The rotation splits exactly: q · R((t0 + j) θ) k =
             (R(t0 θ)ᵀ q) · (R(j θ) k), so the keys turn by the within-tile angles (a per-program table of cos /
             sin of j θ, no trig a tile) and the query, (g, r/2) entries, by the tile's t0 θ
    values   per-token scales fold into the probabilities: Σ_t p_t (m_t + h_t B_t) = Σ_t p_t m_t + (p ⊙ h) · B,
             so the tile is B itself (no arithmetic a value); per-channel scales scale the tile
    outliers the sparse slots take their own passes, so that the decode loop carries none of their work (in the loop, a
             slot cost a pass over the tile or a scatter through memory, for each of the hkv programs that read the
             token): ``_key_outlier_kernel`` first turns every key slot, once, into its score terms (val - x̂) · w_h(c,
             t) for the query heads of its kv head (sc (b, hkv, L, g), paged (N, hkv, BS, g): ``_sc_token``; summed by
             relaxed vector atomics); the decode adds sc's (g, BLOCK_T) tile to its scores and, when there are value
             slots, stores the scores there in its place; before the combine, ``_value_outlier_kernel`` adds 2^(s_h(t) -
             m) (val - x̂) at each value slot's channel of its split's unnormalized output (m: the split's max; two
             splits at least), which the combine then normalizes with the rest. x̂, the value the codes give under a
             slot, is the codebook's end on val's side (``ssmq.ops.kv_quant.outlier_codes``): no gather of the code
    sink     split 0 first folds in the S float sink tokens (same rotation), before its quantized tiles
Each split writes (m, l, acc); ``_combine_kernel`` rescales and adds them (one split: the output directly).
The split count fills the GPU (WAVES programs an SM) without reading the lengths on the host: a row's tokens are
divided among the P splits in the kernel, so there is no host sync, and no torch op between the kernels.
Per-channel scales (keys with the split rotation or none, values) are applied in float16, folded into the
rotation's tables for keys (FOLD, ``_fold_tables``): fewer instructions and registers, so that a register cap fits
more programs an SM (``CFG``'s note: the loop is bound by latency).
``float_kv_decode`` is the same kernel over a float16 / bfloat16 cache (FLOAT: keys post-RoPE, no LUT, outliers or
sink; products in the cache's dtype), the models' float KV decode.
Codes must be packed at 2, 3 or 4 bits (codebooks of <= 16 entries; the bits a side's constexpr) and unrotated;
other formats take the reference.

Accuracy (float16 products; the reference is float32; the outliers' passes are float32): q (rotated a tile), the
rotated keys (three times with FOLD: ``_fold_tables``), B, p ⊙ h and the sink are rounded to float16 (relative
error u = 2^-11 at most each), products accumulate in float32; the angles are fl(t0 θ) + fl(j θ) where the
reference rounds fl(t θ) (about an ulp of t θ apart: 5e-4 rad at 4K tokens, 8e-3 at 128K for θ = 1, as far as
the reference's own rounding is from t θ). A score then moves by about u·scale·sqrt(Σ_c (q_c k_c)²) (random
rounding), the output by that times the spread of v: ~1e-3 of |v| for unit-variance data; tests compare at rtol =
atol = 3e-3 (the former 3xTF32 kernel: 1e-4), far below what 2-4 bit codes change (KVQuant nuq4: ~1e-1 relative
error a value). A float16 cache: q and p rounded to float16 (as flash attention rounds them), within 3e-3 of the
reference; a bfloat16 cache: to bfloat16 (u = 2^-8), 2e-2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ssmq.kernels import configs
from ssmq.kernels._common import cdiv, next_pow2
from ssmq.errors import SSMQError
from ssmq.kernels.dispatch import FLOAT_KV_DECODE, QUANT_KV_DECODE, float_kv_launch, quant_kv_view_launch, serves
from ssmq.kernels.kv_decode import (FAST_TRIG, _codes, _cos_sin, _inv_freq, _launch, _page, _rope_terms,
                                    _slot_residual, _sm_count, _split_chunk, _split_range, _store_split, float_args,
                                    paging, quant_args)
from ssmq.ops.kv_quant import KVSideView

CFG = configs.load("kv_decode_fast")  # launch settings (configs/kv_decode_fast.json, keys in docs/kernels.md)
MIN_DIM = 32
# The outlier formats' decode takes the same warps and stages, uncapped: H200 (`time_kv_outlier_parts.py
# --kernels`, 128K tokens, 4-bit + 1%), the 8 warps / 1 stage / 128 registers kept from the in-loop slots took the
# decode kernel 0.416 ms, 4 / 3 uncapped 0.345 (keys only: 0.381 -> 0.268; no outliers 0.254).
# SPARSE_SLOTS: slot positions an iteration of an outlier pass's program takes, whole tokens' slots flattened (the
# last SPARSE_SLOTS % slots positions idle). H200 (`time_kv_outlier_parts.py --kernels`, 128K tokens,
# 4-bit, 20 key / 10 value slots a token): as (tokens, slots padded to a power of two) tiles, 16 tokens (512 and 256
# positions, 37.5% of them padding) took the key pass 0.045 ms and the value pass 0.025, 32 tokens 0.059 / 0.022,
# 8 tokens 0.052 / 0.030; flattened, 512 positions 0.045
# / 0.021 (25 and 51 tokens), 256 0.044 / 0.022, 1024 0.058 / 0.027: the value pass gained, the
# key pass is not bound by its idle lanes.
# `bench_kvquant.py --sweep` (H100, 16K / 128K tokens; kernels_b1_s17_sweep.json): 3 stages took 4-bit
# from 0.326 to 0.289 ms at 128K (0.055 -> 0.049 at 16K); for 1% outliers (then ranked passes) no setting beat these.
# GP_MIN: rows of the query-group tiles at least (GROUP padded to a power of two; Triton pads the tensor-core
# products' M itself). H200 (`time_kv_outlier_parts.py`, 128K tokens, 4-bit): 16 -> 4 took the
# no-outlier kernel from 0.292 to 0.258 ms (255 -> 236 registers) and the 1% one from 1.007 to 0.979.
# FOLD: per-channel scales applied in float16 (``_fold_tables``). MAXNREG, MAXNREG_OUTLIERS: the quantized decode's
# register caps; the programs an SM holds follow (4 at 128 registers, 3 at 168: ``kv_decode.resident_programs``) and
# the split count fills whole rounds of them (``kv_decode.whole_rounds``). The loop is bound by latency, not by its
# instructions: H200 (4-bit, 128K tokens, batch 1 / 8), FOLD took the loop from 689 to 544 SASS instructions a
# tile and the registers from 236 to 188 (Triton 3.6), the time not at all (0.262 -> 0.261 ms); it let a cap fit more programs
# with few spills: 168 registers (3 programs; 12 bytes spilled) 0.217 / 1.615 ms, 128 (4; ncu counts 2.2 M
# local-memory requests a call, s31_ncu_decode_4bit.log) 0.208 / 1.533, 96 (5) 0.243 / 1.770; 1% outliers (190
# registers uncapped): 168 0.295 / 2.225, 128 0.307 / 2.330. FOLD off, capped at 168: 0.251. RESIDENT: programs an
# SM of an uncapped launch (per-token keys, ``launch_cfg``: 2 at 236 registers). Float caches keep
# their registers (64) and WAVES alone (bound by bytes: twice the splits at batch 8 did not help them, H200)
# FAST_TRIG (the first kernel's): cos.approx / sin.approx and the PRMT lookups on the GPU; the interpreter runs no
# PTX: numpy's trig and a gathered LUT there

# 4-bit lookup, 4 packed bytes (8 codes; pack=4) → the float16 values of their low nibbles ($0, $1) and high
# nibbles ($2, $3). Tables: $5, $9, $13, $17 the low bytes of entries 0-3, 4-7, 8-11, 12-15; $21 .. $33 their
# high bytes (each table argument comes 4 times a pack). PRMT picks byte (s & 7) of 8 for each of 4 selector
# nibbles (bit 3 would replicate a sign: masked off); the codes' bit 3 then picks the 0-7 or the 8-15 lookup
# (selector i | 4·bit3 per byte, as llama.cpp's IQ4_NL lookup), and the last PRMTs interleave low and high bytes.
_LUT4 = tl.constexpr(
    "{\n.reg .b32 s, h, s2, h2, a, b, l0, l1, g0, g1;\nand.b32 s, $4, 0x77777777;\nshr.u32 h, $4, 1;\n"
    "lop3.b32 h, h, 0x44444444, 0x32103210, 0xEA;\nshr.u32 s2, s, 16;\nshr.u32 h2, h, 16;\n"
    + "".join(f"prmt.b32 a, ${t0}, ${t0 + 4}, {sel};\nprmt.b32 b, ${t0 + 8}, ${t0 + 12}, {sel};\n"
              f"prmt.b32 {dst}, a, b, {hs};\n"
              for sel, hs, half in (("s", "h", "0"), ("s2", "h2", "1"))
              for t0, dst in ((5, "l" + half), (21, "g" + half)))
    + "prmt.b32 $0, l0, g0, 0x6240;\nprmt.b32 $1, l1, g1, 0x6240;\nprmt.b32 $2, l0, g0, 0x7351;\n"
    "prmt.b32 $3, l1, g1, 0x7351;\n}")
_LUT4_CONSTRAINTS = tl.constexpr("=r,=r,=r,=r,r" + ",r" * 32)
# 2-bit lookup, 4 packed bytes (16 codes) → the float16 values of bits 0-1, 2-3, 4-5, 6-7 of each byte
# ($0 .. $7, two registers an output). Tables $9, $13: entries (0, 1), (2, 3) as float16 pairs; a byte's code c
# becomes the selector nibbles (2c, 2c + 1) by one multiply-add (c·0x22 + 0x10: no carry between bytes).
_LUT2 = tl.constexpr("{\n.reg .b32 t, u;\n" + "".join(
    f"shr.u32 t, $8, {2 * i};\nand.b32 t, t, 0x03030303;\nmad.lo.u32 u, t, 0x22, 0x10101010;\n"
    f"prmt.b32 ${2 * i}, $9, $13, u;\nshr.u32 u, u, 16;\nprmt.b32 ${2 * i + 1}, $9, $13, u;\n" for i in range(4))
    + "}")
_LUT2_CONSTRAINTS = tl.constexpr("=r,=r,=r,=r,=r,=r,=r,=r,r" + ",r" * 32)

# 3-bit lookup, 4 bytes of the 2-bit plane ($8: 16 codes' low bits, as ``_LUT2`` reads them) and 4 bytes of their
# bit 2 ($9: bit i of byte k the high bit of code i of byte k, a nibble a byte) → the float16 values of codes
# i = 0..3 of each byte ($0 .. $7, two registers an output). For code i: the 3-bit codes of the 4 bytes, one a
# byte (t), packed into the 4 selector nibbles of s by one shift-or and one PRMT (bytes 0 and 2 of t | t >> 4);
# then as ``_LUT4``: PRMT selects the low bytes of entries 0-7 ($10, $14) and their high bytes ($18, $22), two more
# interleave them into float16 pairs. 12 instructions for 4 codes. (Each table operand comes 4 times a pack.)
_LUT3 = tl.constexpr("{\n.reg .b32 t, h, s, l, g;\n" + "".join(
    f"shr.u32 t, $8, {2 * i};\nand.b32 t, t, 0x03030303;\n"
    + (f"shl.b32 h, $9, {2 - i};\n" if i < 3 else "shr.u32 h, $9, 1;\n")  # bit i of each nibble to bit 2
    + "lop3.b32 t, t, h, 0x04040404, 0xF8;\nshr.u32 s, t, 4;\nor.b32 s, s, t;\nprmt.b32 s, s, s, 0x0020;\n"
    f"prmt.b32 l, $10, $14, s;\nprmt.b32 g, $18, $22, s;\nprmt.b32 ${2 * i}, l, g, 0x5140;\n"
    f"prmt.b32 ${2 * i + 1}, l, g, 0x7362;\n" for i in range(4))
    + "}")
_LUT3_CONSTRAINTS = tl.constexpr("=r,=r,=r,=r,=r,=r,=r,=r,r,r" + ",r" * 16)


# A predicated 32-bit store from each thread's own registers ($1 address, $2 value, $3 mask; $0 a dummy output).
_ST32 = tl.constexpr("{\n.reg .pred p;\nsetp.ne.b32 p, $3, 0;\n@p st.global.b32 [$1], $2;\nmov.b32 $0, 0;\n}")


@triton.jit
def _store_as_is(ptrs, x, mask, ASM: tl.constexpr):
    """tl.store(ptrs, x, mask) of float32 x in x's own layout. tl.store first converts a tensor-core accumulator to a
    coalesced layout, through shared memory and barriers in the decode loop (the scores' store: 1% formats' decode
    0.292 ms with it, 0.263 with this, at 128K tokens, H100, ``time_kv_outlier_parts.py --kernels``);
    this asm store leaves each thread's entries where they are: 4-byte stores, uncoalesced (merged in L2), an
    entry that several threads hold (a 4-row tile in a 16-row layout) stored by each, the same value."""
    if ASM:
        tl.inline_asm_elementwise(_ST32, "=r,l,r,r", [ptrs, x.to(tl.int32, bitcast=True), mask.to(tl.int32)],
                                  dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.store(ptrs, x, mask=mask)


@triton.jit
def _word(x, grp, k):
    """The bits of x's entries of group k, or-ed into one int32 (they do not overlap)."""
    return tl.sum(tl.where(grp == k, x, 0), 0)


@triton.jit
def _lut_words(lut, LEVELS: tl.constexpr, BITS: tl.constexpr):
    """The codebook's float16 entries as the PRMT tables of ``_LUT4`` (8 words: low bytes of entries 4k .. 4k + 3,
    then their high bytes) or ``_LUT2`` (entries (0, 1), (2, 3) as float16 pairs; the other words 0)."""
    i = tl.arange(0, 16)
    e = tl.load(lut + i, mask=i < LEVELS, other=0.0).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    if BITS >= 3:
        grp = i // 4
        lo = (e & 0xFF) << ((i % 4) * 8)
        hi = (e >> 8) << ((i % 4) * 8)
    else:
        grp = i // 2
        lo = e << ((i % 2) * 16)
        hi = lo * 0
    w0, w1, w2, w3 = _word(lo, grp, 0), _word(lo, grp, 1), _word(lo, grp, 2), _word(lo, grp, 3)
    w4, w5, w6, w7 = _word(hi, grp, 0), _word(hi, grp, 1), _word(hi, grp, 2), _word(hi, grp, 3)
    return w0, w1, w2, w3, w4, w5, w6, w7


@triton.jit
def _interleave4(b0, b1, b2, b3):
    """(T, G) pieces → (T, 4G), column 4g + i from piece i. join adds its axis last, so the outer join picks the
    lowest bit of i: join(join(b0, b2), join(b1, b3))[.., y, x] = b_(2y + x)."""
    return tl.reshape(tl.join(tl.join(b0, b2), tl.join(b1, b3)), (b0.shape[0], 4 * b0.shape[1]))


@triton.jit
def _book(rows, c0: tl.constexpr, NC: tl.constexpr, CP: tl.constexpr, tmask, lut, w0, w1, w2, w3, w4, w5, w6, w7,
          BITS: tl.constexpr, ASM: tl.constexpr, E: tl.constexpr):
    """(len(tmask), CP) float16 codebook values B of channels [c0, c0 + CP) of the packed rows of E codes ``rows``
    (T, 1 pointers); channels from c0 + NC on are masked (code 0: a finite value, multiplied by a zero query /
    weight). c0 and NC are multiples of the codes a byte (GS; 3 bits: c0 a multiple of 8, the 1-bit plane's)."""
    T: tl.constexpr = tmask.shape[0]
    if ASM and BITS == 4:
        g = tl.arange(0, CP // 2)
        w = tl.load(rows + c0 // 2 + g[None, :], mask=tmask[:, None] & (g < NC // 2)[None, :], other=0)
        lo, hi = tl.inline_asm_elementwise(_LUT4, _LUT4_CONSTRAINTS, [w, w0, w1, w2, w3, w4, w5, w6, w7],
                                           dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
        x = tl.reshape(tl.join(lo, hi), (T, CP))
    elif ASM and BITS == 2:
        g = tl.arange(0, CP // 4)
        w = tl.load(rows + c0 // 4 + g[None, :], mask=tmask[:, None] & (g < NC // 4)[None, :], other=0)
        b0, b1, b2, b3 = tl.inline_asm_elementwise(_LUT2, _LUT2_CONSTRAINTS, [w, w0, w1, w2, w3, w4, w5, w6, w7],
                                                   dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                                                   is_pure=True, pack=4)
        x = _interleave4(b0, b1, b2, b3)
    elif ASM and BITS == 3:  # the 2-bit plane's bytes as for 2 bits, and each byte's 4 high bits from the 1-bit plane
        g = tl.arange(0, CP // 4)
        gm = tmask[:, None] & (g < NC // 4)[None, :]
        lo = tl.load(rows + c0 // 4 + g[None, :], mask=gm, other=0)
        # byte g's 4 high bits: nibble g % 2 of byte g // 2, the 1-bit plane read contiguously and its nibbles
        # joined (a byte gather hi[g // 2] instead made the 3-bit decode 1.46x slower than this, H100)
        g8 = tl.arange(0, CP // 8)
        hi = tl.load(rows + (E + 3) // 4 + c0 // 8 + g8[None, :], mask=tmask[:, None] & (g8 < NC // 8)[None, :],
                     other=0)
        hn = tl.reshape(tl.join(hi & 15, hi >> 4), (T, CP // 4))
        b0, b1, b2, b3 = tl.inline_asm_elementwise(_LUT3, _LUT3_CONSTRAINTS, [lo, hn, w0, w1, w4, w5],
                                                   dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                                                   is_pure=True, pack=4)
        x = _interleave4(b0, b1, b2, b3)
    else:
        c = tl.arange(0, CP)
        x = tl.load(lut + _codes(rows, c0 + c[None, :], tmask[:, None] & (c < NC)[None, :], BITS, E)).to(
            tl.float16)
    return x


@triton.jit
def _scales(mid, half, slot, hk, t, tmask, c, cmask, s_ms, s_mt, E: tl.constexpr, PER_TOKEN: tl.constexpr):
    """float32 (mid, half) broadcastable to a (T, C) tile: per-token scales (s, L, hkv) at tokens t as (T, 1), or
    per-channel ones (hkv, e) at channels c as (1, C). Per-channel scales are the same every tile: the decode loads
    them before its loop (a store in the loop, the scores' for the value outliers, keeps the compiler from hoisting
    loads; in the loop they cost the 1% formats ~0.06 ms at 128K tokens, H100)."""
    if PER_TOKEN:
        m = tl.load(mid + slot * s_ms + t * s_mt + hk, mask=tmask, other=0.0).to(tl.float32)[:, None]
        h = tl.load(half + slot * s_ms + t * s_mt + hk, mask=tmask, other=0.0).to(tl.float32)[:, None]
    else:
        m = tl.load(mid + hk * E + c, mask=cmask, other=0.0).to(tl.float32)[None, :]
        h = tl.load(half + hk * E + c, mask=cmask, other=0.0).to(tl.float32)[None, :]
    return m, h


@triton.jit
def _mma_operand(x):
    """x as a tensor-core operand: a bfloat16 tile (a bfloat16 float cache) stays, anything else becomes float16."""
    if x.dtype != tl.bfloat16:
        x = x.to(tl.float16)
    return x


@triton.jit
def _as_operand(x, cache):
    """x in the dtype ``_mma_operand`` gives the tiles read from pointer ``cache`` (bfloat16 for a bfloat16 cache)."""
    if cache.dtype.element_ty == tl.bfloat16:
        x = x.to(tl.bfloat16)
    else:
        x = x.to(tl.float16)
    return x


@triton.jit
def _qk(q, k, s):
    """s + q · kᵀ for q (GP, C), k (T, C): (GP, T) float32, a tensor-core product in ``_mma_operand(k)``'s dtype.
    (CUDA-core float32 multiply-adds instead measured 2-7x slower: H200, ``bench_kvquant.py --sweep``.)"""
    k = _mma_operand(k)
    return tl.dot(q.to(k.dtype), tl.trans(k), s)


@triton.jit
def _pv(p, v, acc):
    """acc + p · v for p (GP, T), v (T, E): (GP, E) float32, as ``_qk``."""
    v = _mma_operand(v)
    return tl.dot(p.to(v.dtype), v, acc)


@triton.jit
def _key_scores(qa, qb, qp, rows, ma, ha, mb, hb, mp, hp, lut, kw0, kw1, kw2, kw3, kw4, kw5, kw6, kw7, t, tmask, cos,
                sin, E: tl.constexpr, R: tl.constexpr, HP: tl.constexpr, PP: tl.constexpr, FLOAT: tl.constexpr,
                BITS: tl.constexpr, ASM: tl.constexpr, FOLD: tl.constexpr):
    """(GP, len(t)) scores of the (pre-scaled, float16) query rows qa, qb, qp (the rotary halves, the pass-through
    channels) against the keys at ``rows`` (T, 1 pointers) rotated by their positions: R_t k = (ka cos - kb sin,
    kb cos + ka sin, kp); without the sparse outliers (``_key_outlier_kernel`` adds their terms). (ma, ha), (mb,
    hb), (mp, hp): the three tiles' scales (``_scales``). FLOAT: a float tile (the scales unused). FOLD: the
    per-channel scales folded into the rotation, float16 tables (T, r/2) of ``_fold_tables``: ma, mb the rotated
    mids, ha, hb the halves times cos, cos and sin the halves a and b times sin; mp, hp float16 (1, PP)."""
    ch = tl.arange(0, HP)
    cp = tl.arange(0, PP)
    s = tl.zeros((qa.shape[0], t.shape[0]), tl.float32)
    if R > 0:
        hm = ch < R // 2
        if FLOAT:
            ka = tl.load(rows + ch[None, :], mask=tmask[:, None] & hm[None, :], other=0.0).to(tl.float32)
            kb = tl.load(rows + R // 2 + ch[None, :], mask=tmask[:, None] & hm[None, :], other=0.0).to(tl.float32)
        else:
            ka = _book(rows, 0, R // 2, HP, tmask, lut, kw0, kw1, kw2, kw3, kw4, kw5, kw6, kw7, BITS, ASM, E)
            kb = _book(rows, R // 2, R // 2, HP, tmask, lut, kw0, kw1, kw2, kw3, kw4, kw5, kw6, kw7, BITS, ASM, E)
            if not FOLD:
                ka = ma + ha * ka.to(tl.float32)
                kb = mb + hb * kb.to(tl.float32)
        if FOLD:  # float16 multiply-adds, two entries an instruction (HFMA2), no conversions
            s = _qk(qa, ma + ka * ha - kb * sin, s)
            s = _qk(qb, mb + kb * hb + ka * cos, s)
        else:
            s = _qk(qa, ka * cos - kb * sin, s)
            s = _qk(qb, kb * cos + ka * sin, s)
    if R < E:
        pm = cp < E - R
        if FLOAT:
            kp = tl.load(rows + R + cp[None, :], mask=tmask[:, None] & pm[None, :], other=0.0)
        else:
            kp = _book(rows, R, E - R, PP, tmask, lut, kw0, kw1, kw2, kw3, kw4, kw5, kw6, kw7, BITS, ASM, E)
            if FOLD:
                kp = mp + hp * kp
            else:
                kp = mp + hp * kp.to(tl.float32)
        s = _qk(qp, kp, s)
    return s


@triton.jit
def _fold_tables(ma, ha, mb, hb, cj, sj):
    """The per-channel key scales folded into the within-tile rotation, float16 (T, r/2) tables the same every tile:
    R(jθ)(mid + half ⊙ B) = (Ma + Ca ⊙ Ba - Sb ⊙ Bb, Mb + Cb ⊙ Bb + Sa ⊙ Ba) with Ma, Mb = R(jθ) mid, Ca = half_a
    cos jθ, Sa = half_a sin jθ (b alike). Returns (Ma, Ca, Mb, Cb, Sa, Sb), ``_key_scores``' FOLD arguments. A
    rotated key then costs two float16 multiply-adds a pair of entries (HFMA2) instead of a conversion, four float32
    operations and a rounding an entry (the 4-bit loop: 689 -> 544 SASS instructions a tile, sm_90 build); its
    entries are rounded three times instead of once (2^-11 relative each), far below what the codes change."""
    return ((ma * cj - mb * sj).to(tl.float16), (ha * cj).to(tl.float16), (mb * cj + ma * sj).to(tl.float16),
            (hb * cj).to(tl.float16), (ha * sj).to(tl.float16), (hb * sj).to(tl.float16))


@triton.jit
def _tile_page(table, s_tab, slot, start, hi, BS: tl.constexpr, BLOCK_T: tl.constexpr):
    """Where the tokens t = start + [0, BLOCK_T) of a decode tile (start a multiple of BLOCK_T) sit in a paged cache
    of blocks of whole tiles (BS a multiple of BLOCK_T; ``_page``): all in one block, one table entry (a scalar row:
    the tile's addresses as a contiguous cache's). A tile past the split's end hi (the one loaded ahead of the last)
    reads the row's entry at hi - 1, never past the row."""
    t = start + tl.arange(0, BLOCK_T)
    pb = tl.load(table + slot * s_tab + tl.maximum(tl.minimum(start, hi - 1), 0) // BS).to(tl.int64)
    return pb, t - (start // BS) * BS


@triton.jit
def _softmax_step(m, l, s):
    """Online softmax: fold scores s (GP, n) (log2 units, -inf masked) into the running (m, l); returns m, l, the
    probabilities p (GP, n) and alpha, the factor the running output takes."""
    m_new = tl.maximum(m, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # all masked so far: no NaN from -inf - -inf
    p = tl.exp2(s - m_ref[:, None])
    alpha = tl.exp2(m - m_ref)
    return m_new, l * alpha + tl.sum(p, 1), p, alpha


@triton.jit
def _sc_token(i, pb, pt, c_b, GROUP: tl.constexpr, BS: tl.constexpr):
    """Offsets in the outlier score buffer sc of tokens at (pb, pt) (``_page``) of row i: a contiguous cache's sc is
    (b, hkv, L, g), a row's tokens at (i, t); a paged one's is (N, hkv, BS, g), a token's terms in its own block, so
    that sc grows with the pool, not with b × a row's capacity (blocks are never shared by two rows)."""
    if BS > 0:
        return pb * c_b + pt * GROUP
    return i.to(tl.int64) * c_b + pt * GROUP


@triton.jit
def _decode_kernel(q, slots, lens, inv_freq, out, ws, table, s_tab, sc, c_b, c_k,
                   kc, kmid, khalf, klut, koi, kov, ksink, vc, vmid, vhalf, vlut, voi, vov, vsink,
                   s_qb, s_qh, k_s, k_t, k_h, k_ms, k_mt, k_os, k_ot, v_s, v_t, v_h, v_ms, v_mt, v_os, v_ot,
                   ks_s, ks_t, ks_h, vs_s, vs_t, vs_h, s_ob, s_oh, w_b, w_h, w_p, w_e, splits, scale,
                   GROUP: tl.constexpr, GP: tl.constexpr, E: tl.constexpr, R: tl.constexpr, HP: tl.constexpr,
                   PP: tl.constexpr, S: tl.constexpr, SP: tl.constexpr, FLOAT: tl.constexpr,
                   K_PER_TOKEN: tl.constexpr, V_PER_TOKEN: tl.constexpr, KSLOTS: tl.constexpr,
                   VSLOTS: tl.constexpr, BLOCK_T: tl.constexpr, ONE_SPLIT: tl.constexpr,
                   FAST: tl.constexpr,
                   KBITS: tl.constexpr, VBITS: tl.constexpr, KLEVELS: tl.constexpr, VLEVELS: tl.constexpr,
                   ROPE_SPLIT: tl.constexpr, ASM: tl.constexpr, FOLD: tl.constexpr, BS: tl.constexpr):
    """BS > 0: a paged cache, the per-token buffers block pools read through ``table`` (slots, M) (``_page``)."""
    i, hk, sp, slot, n, lo, hi = _split_range(slots, lens, splits, BLOCK_T)
    KASM: tl.constexpr = ASM and FAST and KBITS <= 4  # PRMT lookups (else ``_codes`` + a gathered LUT)
    STORE_ASM: tl.constexpr = ASM and FAST  # PTX stores on the GPU (``_store_as_is``), tl.store in the interpreter
    VASM: tl.constexpr = ASM and FAST and VBITS <= 4

    rows = tl.arange(0, GP)  # the kv head's query heads, padded to GP (CFG["GP_MIN"])
    rmask = rows < GROUP
    qg = q + i * s_qb + hk * GROUP * s_qh  # the group's first query head
    qscale = scale * 1.4426950408889634  # scores in log2 units: exp2 in the softmax
    qrow = qg + rows[:, None] * s_qh
    ch = tl.arange(0, HP)
    cp = tl.arange(0, PP)
    hm = rmask[:, None] & (ch < R // 2)[None, :]
    qa32 = tl.load(qrow + ch[None, :], mask=hm, other=0.0).to(tl.float32) * qscale
    qb32 = tl.load(qrow + R // 2 + ch[None, :], mask=hm, other=0.0).to(tl.float32) * qscale
    qa = _as_operand(qa32, kc)  # the products' dtype (``_mma_operand``), once
    qb = _as_operand(qb32, kc)
    qp = _as_operand(tl.load(qrow + R + cp[None, :], mask=rmask[:, None] & (cp < E - R)[None, :], other=0.0)
                     .to(tl.float32) * qscale, kc)
    freq = tl.load(inv_freq + ch, mask=ch < R // 2, other=0.0)
    j = tl.arange(0, BLOCK_T)
    if ROPE_SPLIT:  # R(t0 θ + j θ) = R(t0 θ) R(j θ): keys turn by j θ (this table, the same every tile), the
        cj, sj = _cos_sin(j.to(tl.float32)[:, None] * freq[None, :], FAST)  # query back by t0 θ (a tile)
    kw0, kw1, kw2, kw3, kw4, kw5, kw6, kw7 = _lut_words(klut, KLEVELS, KBITS)
    vw0, vw1, vw2, vw3, vw4, vw5, vw6, vw7 = _lut_words(vlut, VLEVELS, VBITS)

    m = tl.full((GP,), float("-inf"), tl.float32)
    l = tl.zeros((GP,), tl.float32)
    lm = tl.zeros((GP,), tl.float32)  # Σ p · mid of per-token values: added to every channel at the end
    acc = tl.zeros((GP, E), tl.float32)
    e = tl.arange(0, E)
    if S > 0:
        if sp == 0:  # the sink tokens' keys and values are kept in float: positions [0, S)
            t = tl.arange(0, SP)
            tmask = t < tl.minimum(n, S)
            cs, sn = _cos_sin(t.to(tl.float32)[:, None] * freq[None, :], FAST)
            s = _key_scores(qa, qb, qp, ksink + slot * ks_s + t[:, None] * ks_t + hk * ks_h, 0.0, 1.0, 0.0, 1.0,
                            0.0, 1.0, klut, kw0, kw1, kw2, kw3, kw4, kw5, kw6, kw7, t, tmask, cs, sn, E, R, HP, PP,
                            True, KBITS, KASM, False)
            m, l, p, alpha = _softmax_step(m, l, tl.where(tmask[None, :], s, float("-inf")))
            v = tl.load(vsink + slot * vs_s + t[:, None] * vs_t + hk * vs_h + e[None, :], mask=tmask[:, None],
                        other=0.0)
            acc = _pv(p, v, acc)
    # per-channel scales, the same every tile (``_scales``); per-token ones are loaded a tile
    kma, kha, kmb, khb, kmp, khp, vm, vh = 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0
    if not FLOAT and not K_PER_TOKEN:
        kma, kha = _scales(kmid, khalf, slot, hk, 0, True, ch, ch < R // 2, 0, 0, E, False)
        kmb, khb = _scales(kmid, khalf, slot, hk, 0, True, R // 2 + ch, ch < R // 2, 0, 0, E, False)
        kmp, khp = _scales(kmid, khalf, slot, hk, 0, True, R + cp, cp < E - R, 0, 0, E, False)
    if not FLOAT and not V_PER_TOKEN:
        vm, vh = _scales(vmid, vhalf, slot, hk, 0, True, e, e < E, 0, 0, E, False)
    # FOLD: per-channel scales applied in float16 (``_fold_tables``; keys with the split rotation or none)
    KFOLD: tl.constexpr = FOLD and not FLOAT and not K_PER_TOKEN and (ROPE_SPLIT or R == 0)
    VFOLD: tl.constexpr = FOLD and not FLOAT and not V_PER_TOKEN
    if KFOLD:
        kmp, khp = kmp.to(tl.float16), khp.to(tl.float16)
        if R > 0:
            kma, kha, kmb, khb, fsa, fsb = _fold_tables(kma, kha, kmb, khb, cj, sj)
    if VFOLD:
        vm, vh = vm.to(tl.float16), vh.to(tl.float16)
    # blocks of whole tiles: a tile's block is one table entry, loaded a tile ahead (its latency, in front of the
    # tile's loads, hidden behind the tile before); H100 (bench_paged_decode.py, 4-bit, 128K tokens):
    # loaded in the tile itself, 0.307 ms (contiguous cache 0.258); an entry a token (16-token blocks) 0.313
    AHEAD: tl.constexpr = BS > 0 and BS % BLOCK_T == 0
    if AHEAD:
        pb, pt = _tile_page(table, s_tab, slot, lo, hi, BS, BLOCK_T)
    for start in range(lo, hi, BLOCK_T):
        t = start + j
        tmask = (t < hi) & (t >= S)
        if AHEAD:
            nb, nt = _tile_page(table, s_tab, slot, start + BLOCK_T, hi, BS, BLOCK_T)
        else:  # (slot, t), or an entry a token
            pb, pt = _page(table, s_tab, slot, t, tmask, BS)
        if ROPE_SPLIT:  # q · R(t0 + j) k = (R(t0)ᵀ q) · (R(j) k), exact; R(t0)ᵀ q: (g, r/2) work a tile
            c0, s0 = _cos_sin((start * 1.0) * freq, FAST)
            ua = _as_operand(qa32 * c0[None, :] + qb32 * s0[None, :], kc)
            ub = _as_operand(qb32 * c0[None, :] - qa32 * s0[None, :], kc)
            cos, sin = cj, sj
            if KFOLD:
                cos, sin = fsa, fsb
        elif R > 0:
            ua, ub = qa, qb
            cos, sin = _cos_sin(t.to(tl.float32)[:, None] * freq[None, :], FAST)
        else:
            ua, ub = qa, qb
            cos, sin = 1.0, 0.0
        cs = sc + _sc_token(i, pb, pt, c_b, GROUP, BS)[None, :] + hk * c_k + rows[:, None]  # a token's g together
        krows = kc + (pb * k_s + pt * k_t)[:, None] + hk * k_h
        if K_PER_TOKEN and not FLOAT:
            tm, th = _scales(kmid, khalf, pb, hk, pt, tmask, 0, True, k_ms, k_mt, E, True)
            s = _key_scores(ua, ub, qp, krows, tm, th, tm, th, tm, th, klut, kw0, kw1, kw2, kw3, kw4, kw5, kw6, kw7,
                            t, tmask, cos, sin, E, R, HP, PP, FLOAT, KBITS, KASM, False)
        else:
            s = _key_scores(ua, ub, qp, krows, kma, kha, kmb, khb, kmp, khp, klut, kw0, kw1, kw2, kw3, kw4, kw5, kw6,
                            kw7, t, tmask, cos, sin, E, R, HP, PP, FLOAT, KBITS, KASM, KFOLD)
        if KSLOTS > 0:  # the key outliers' score terms (``_key_outlier_kernel``)
            s += tl.load(cs, mask=rmask[:, None] & tmask[None, :], other=0.0)
        if VSLOTS > 0:  # the scores, in place of those terms, for the value outliers' pass (``_value_outlier_kernel``)
            _store_as_is(cs, s, rmask[:, None] & tmask[None, :], STORE_ASM)
        m, l, p, alpha = _softmax_step(m, l, tl.where(tmask[None, :], s, float("-inf")))
        acc = acc * alpha[:, None]
        vrows = vc + (pb * v_s + pt * v_t)[:, None] + hk * v_h
        if FLOAT:
            acc = _pv(p, tl.load(vrows + e[None, :], mask=tmask[:, None], other=0.0), acc)
        else:
            B = _book(vrows, 0, E, E, tmask, vlut, vw0, vw1, vw2, vw3, vw4, vw5, vw6, vw7, VBITS, VASM, E)
            if V_PER_TOKEN:  # Σ_t p_t (m_t + h_t B_t): the scales go to p, the tile stays B
                mv = tl.load(vmid + pb * v_ms + pt * v_mt + hk, mask=tmask, other=0.0).to(tl.float32)
                hv = tl.load(vhalf + pb * v_ms + pt * v_mt + hk, mask=tmask, other=0.0).to(tl.float32)
                lm = lm * alpha + tl.sum(p * mv[None, :], 1)
                acc = _pv(p * hv[None, :], B, acc)
            else:
                lm = lm * alpha
                if VFOLD:
                    acc = _pv(p, vm + vh * B, acc)
                else:
                    acc = _pv(p, vm + vh * B.to(tl.float32), acc)
        if AHEAD:
            pb, pt = nb, nt

    _store_split(out, ws, i, hk, sp, rows, rmask, e, m, l, acc + lm[:, None], s_ob, s_oh, w_b, w_h, w_p, w_e, GROUP,
                 E, ONE_SPLIT)


@triton.jit
def _outlier_tile(slots, lens, table, s_tab, oidx, oval, mid, half, lut, s_ms, s_mt, s_os, s_ot, E: tl.constexpr,
                  S: tl.constexpr, PER_TOKEN: tl.constexpr, SLOTS: tl.constexpr, N: tl.constexpr,
                  LEVELS: tl.constexpr, BS: tl.constexpr, start):
    """The outlier slots of an iteration of an outlier pass's program (row i, the N // SLOTS tokens from ``start``),
    flattened: N positions, token-major, each a (token, slot) pair, so that no position is padding but the last
    N % SLOTS (a (tokens, slots) tile pads the slots to a power of two: 20 to 32). Returns the row, each position's
    token t and whether it is live (below the row's length, past the sink; the decode reads no others), and as (N, 1)
    its slot's kv head h and channel c, its correction d = val - x̂ (``kv_decode._slot_residual``) and whether it
    holds one (hit); and where the tokens sit (``_page``)."""
    i = tl.program_id(0)
    slot = tl.load(slots + i).to(tl.int64)
    j = tl.arange(0, N)
    k = j // SLOTS  # the position's token within the iteration's
    t = start + k
    live = (k < N // SLOTS) & (t < tl.load(lens + i).to(tl.int32)) & (t >= S)
    pb, pt = _page(table, s_tab, slot, t, live, BS)
    ob = (pb * s_os + pt * s_ot + (j - k * SLOTS))[:, None]
    om = live[:, None]
    f = tl.load(oidx + ob, mask=om, other=-1).to(tl.int32)
    hit = om & (f >= 0)
    f = tl.where(hit, f, 0)
    h = f // E
    c = f - h * E
    val = tl.load(oval + ob, mask=hit, other=0.0).to(tl.float32)
    d = _slot_residual(mid, half, lut, h, c, hit, val, pb[:, None], pt, s_ms, s_mt, E, PER_TOKEN, LEVELS)
    return i, t, live, h, c, d, hit, pb, pt


@triton.jit
def _key_outlier_kernel(q, slots, lens, table, s_tab, inv_freq, sc, kmid, khalf, klut, koi, kov, s_qb, s_qh, k_ms,
                        k_mt, k_os, k_ot, c_b, c_k, scale, HKV, GROUP: tl.constexpr, GP2: tl.constexpr,
                        HKVP: tl.constexpr, E: tl.constexpr, R: tl.constexpr, S: tl.constexpr,
                        PER_TOKEN: tl.constexpr, KSLOTS: tl.constexpr, N: tl.constexpr, TP: tl.constexpr,
                        LEVELS: tl.constexpr, FAST: tl.constexpr, BS: tl.constexpr):
    """sc (b, hkv, L, GROUP) float32 (paged: ``_sc_token``): what each token's key outliers add to the scores of each of
    its kv head's query heads (log2 units, as the decode kernel's), Σ_slots (val - x̂) · w_h(c, t), w_h(c, t) the
    coefficient of key channel c in q_h · R_t k. A program per row and share of its tokens, N // KSLOTS tokens an
    iteration (``_outlier_tile``; TP: that count rounded up to a power of two): it zeroes their terms, then adds each
    slot's terms for the GROUP query heads of the slot's kv head (atomics: a token's slots may share a head; they are
    ordered by index, ``ssmq.ops.kv_quant.order_slots``, so a head's follow each other), the GROUP terms of a slot
    contiguous (one vector atomic). Every slot once, not once per kv head. H100, 128K tokens, 20 slots a token, as
    (tokens, 32 slots) tiles: 0.044 ms (16 tokens; 0.047 at 32); summing each kv head's run of slots by a segmented
    scan and storing it once, without atomics, 0.068. H200: the query heads apart ((b, hq, L): an atomic each)
    0.102 ms; summing by kv head with a compare and select per slot and kv head 0.196 ms; (b, L, hq) 0.134 ms."""
    TOK: tl.constexpr = N // KSLOTS
    n = tl.load(lens + tl.program_id(0)).to(tl.int32)
    for blk in range(tl.program_id(1), tl.cdiv(n, TOK), tl.num_programs(1)):
        i, t, live, h, c, d, hit, pb, pt = _outlier_tile(slots, lens, table, s_tab, koi, kov, kmid, khalf, klut, k_ms,
                                                         k_mt, k_os, k_ot, E, S, PER_TOKEN, KSLOTS, N, LEVELS, BS,
                                                         blk * TOK)
        tok = _sc_token(i, pb, pt, c_b, GROUP, BS)
        g = tl.arange(0, GP2)[None, None, :]  # (1, 1, GP2): the query heads of a kv head
        # the iteration's tokens' terms zeroed, every kv head's (once a token, not once a slot position)
        tz = tl.arange(0, TP)
        zt = blk * TOK + tz
        zl = (tz < TOK) & (zt < n) & (zt >= S)
        zb, zp = _page(table, s_tab, tl.load(slots + i).to(tl.int64), zt, zl, BS)
        kv = tl.arange(0, HKVP)[:, None, None]
        tl.store(sc + _sc_token(i, zb, zp, c_b, GROUP, BS)[None, :, None] + kv * c_k + g,
                 tl.zeros((HKVP, TP, GP2), tl.float32), mask=(kv < HKV) & zl[None, :, None] & (g < GROUP))
        tl.debug_barrier()  # the zeros stored before any thread's atomics
        m3 = _group_mask(hit, g, GROUP, GP2)
        qrow = q + i * s_qb + (h[:, :, None] * GROUP + g) * s_qh  # (N, 1, GP2)
        qc = tl.load(qrow + c[:, :, None], mask=m3, other=0.0).to(tl.float32)
        if R > 0:
            a, b, partner, rot = _rope_terms(d, c, hit, t, inv_freq, R, FAST)
            w = qc * a[:, :, None] + tl.load(qrow + partner[:, :, None], mask=rot[:, :, None] & (g < GROUP),
                                             other=0.0).to(tl.float32) * b[:, :, None]
        else:
            w = qc * d[:, :, None]
        tl.atomic_add(sc + tok[:, None, None] + h[:, :, None] * c_k + g,
                      w * (scale * 1.4426950408889634), mask=m3, sem="relaxed")


@triton.jit
def _group_mask(hit, g, GROUP: tl.constexpr, GP2: tl.constexpr):
    """(N, K, GP2) mask of the slots' query heads: constant along g when GROUP is a power of two, so that loads
    and atomics over a kv head's GROUP contiguous heads vectorize."""
    if GROUP == GP2:
        return tl.broadcast_to(hit[:, :, None], (hit.shape[0], hit.shape[1], GP2))
    else:
        return hit[:, :, None] & (g < GROUP)


@triton.jit
def _value_outlier_kernel(ws, sc, slots, lens, table, s_tab, vmid, vhalf, vlut, voi, vov, w_b, w_h, w_p, w_e, v_ms,
                          v_mt, v_os, v_ot, c_b, c_k, splits, GROUP: tl.constexpr, GP2: tl.constexpr,
                          E: tl.constexpr, S: tl.constexpr, PER_TOKEN: tl.constexpr, VSLOTS: tl.constexpr,
                          N: tl.constexpr, BLOCK_T: tl.constexpr, LEVELS: tl.constexpr, BS: tl.constexpr):
    """The value outliers' correction of the attention output, between the decode and the combine: each value slot
    adds 2^(s_h(t) - m) (val - x̂) at its channel of the split workspace ws (b, hq, P, e + 2; heads innermost), for
    the query heads h of its kv head, m the running max that split p's unnormalized output is relative to
    (ws[.., p, e], stored by the decode kernel; scores sc (b, hkv, L, GROUP), log2 units); the combine then
    normalizes it with the rest. A program per row and share of its tokens, N // VSLOTS tokens an iteration
    (``_outlier_tile``), relaxed atomics: the splits spread them over
    hq · P · e addresses, a slot's GROUP heads contiguous in sc and ws (one vector load and one vector atomic a slot;
    added to the final output, 4K addresses took 0.17 ms at 128K tokens on the H200, stalled on their contention;
    a tensor-core product a tile, P (hq, slots) @ one-hot (slots, e), 0.44 ms)."""
    TOK: tl.constexpr = N // VSLOTS
    n = tl.load(lens + tl.program_id(0)).to(tl.int32)
    for blk in range(tl.program_id(1), tl.cdiv(n, TOK), tl.num_programs(1)):
        i, t, live, h, c, d, hit, pb, pt = _outlier_tile(slots, lens, table, s_tab, voi, vov, vmid, vhalf, vlut, v_ms,
                                                         v_mt, v_os, v_ot, E, S, PER_TOKEN, VSLOTS, N, LEVELS, BS,
                                                         blk * TOK)
        sp = t // _split_chunk(n, splits, BLOCK_T)  # the token's split
        g = tl.arange(0, GP2)[None, None, :]
        m3 = _group_mask(hit, g, GROUP, GP2)
        s = tl.load(sc + _sc_token(i, pb, pt, c_b, GROUP, BS)[:, None, None] + h[:, :, None] * c_k + g, mask=m3,
                    other=float("-inf"))
        dst = ws + i * w_b + (h[:, :, None] * GROUP + g) * w_h + sp[:, None, None] * w_p  # (N, 1, GP2)
        p = tl.exp2(s - tl.load(dst + E * w_e, mask=m3, other=0.0))
        tl.atomic_add(dst + c[:, :, None] * w_e, p * d[:, :, None], mask=m3, sem="relaxed")


def outlier_workspace_shape(codes: torch.Tensor, b: int, hq: int, paged: bool) -> tuple[int, int, int, int]:
    """The outlier passes' float32 score buffer sc for a decode of b rows over a cache whose codes are ``codes``
    ((s, L, hkv, ...) rows or (N, BS, hkv, ...) blocks): (b, hkv, L, g) contiguous, (N, hkv, BS, g) paged, g = hq /
    hkv. Paged, it is hq float32 a token of the pool (the engine counts it in its KV memory); a contiguous cache's
    is b × L × hq."""
    rows, length, hkv = codes.shape[:3]
    return (rows if paged else b, hkv, length, hq // hkv)


def constexprs(group: int, e: int, rotary_dim: int, sink: int, flags: dict, block_t: int, one_split: bool) -> dict:
    """_decode_kernel's constexprs for a launch (the compile tests build the same)."""
    return dict(GROUP=group, GP=max(CFG["GP_MIN"], next_pow2(group)), E=e, R=rotary_dim,
                HP=max(MIN_DIM, next_pow2(rotary_dim // 2)),
                PP=max(MIN_DIM, next_pow2(e - rotary_dim)), S=sink,
                SP=max(16, next_pow2(sink)),
                BLOCK_T=block_t, ONE_SPLIT=one_split,
                FAST=FAST_TRIG, ROPE_SPLIT=rotary_dim > 0 and CFG["ROPE"] == "split", ASM=CFG["ASM"],
                FOLD=bool(CFG["FOLD"]), **flags)


def pointer_types(float_dtype: str | None = None) -> dict:
    """_decode_kernel's pointer arguments' types as a launch passes them, over a quantized cache (None) or a float one
    ("fp16" / "bf16": every cache pointer of that type): for ``ssmq.kernels.build.compile_sm90`` (the compile tests,
    ``tests/sass_kv_decode.py``)."""
    index = {"q": "fp16", "slots": "i64", "lens": "i32", "inv_freq": "fp32", "out": "fp32", "ws": "fp32",
             "table": "i64"}
    if float_dtype:
        return {**{a: float_dtype for a in ("sc", "kc", "kmid", "khalf", "klut", "koi", "kov", "ksink", "vc", "vmid",
                                            "vhalf", "vlut", "voi", "vov", "vsink")}, **index, "q": float_dtype}
    return {**index, "sc": "fp32", "kc": "u8", "kmid": "fp32", "khalf": "fp32", "klut": "fp32", "koi": "i16",
            "kov": "fp16", "ksink": "fp16", "vc": "u8", "vmid": "fp16", "vhalf": "fp16", "vlut": "fp32", "voi": "i16",
            "vov": "fp16", "vsink": "fp16"}


def eligible(k: KVSideView, v: KVSideView, rotary_dim: int) -> bool:
    """Formats this kernel serves exactly: its row of ``dispatch.QUANT_KV_DECODE``."""
    return serves(QUANT_KV_DECODE, "kv_decode_fast", quant_kv_view_launch(k, v, rotary_dim, 1))


def quant_kv_decode(q: torch.Tensor, slots: torch.Tensor, kv_lens: torch.Tensor, k: KVSideView, v: KVSideView,
                    rotary_dim: int = 0, theta: float = 10000.0, softmax_scale: float | None = None,
                    splits: int | None = None, block_table: torch.Tensor | None = None) -> torch.Tensor:
    """``quant_kv_decode_ref`` on the GPU for ``eligible`` formats: q (b, hq, e) → (b, hq, e) float32. slots,
    kv_lens (b,) stay on the GPU (no host sync); ``splits`` overrides ``default_splits``; ``block_table`` (s, M):
    the sides' per-token buffers are block pools (N, B, ...) (``ssmq.models.quant_kv``), read in place."""
    if not eligible(k, v, rotary_dim):
        raise SSMQError("the fast KV decode kernel serves 2-4 bit codes, head dims that are multiples of 32 and rotary "
                        f"dims that are multiples of 16 (rotary dim {rotary_dim}); use ssmq.kernels.kv_decode")
    return decode_any(q, slots, kv_lens, k, v, rotary_dim, theta, softmax_scale, splits, block_table)


def decode_any(q, slots, kv_lens, k: KVSideView, v: KVSideView, rotary_dim: int = 0, theta: float = 10000.0,
               softmax_scale: float | None = None, splits: int | None = None,
               block_table: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel on any format, the ones it gets wrong included (outliers, 16-channel rotary halves), to isolate
    such failures on a GPU; the package calls ``quant_kv_decode``."""
    kt, ks, vt, vs, sinks, flags = quant_args(k, v)
    for bits in (k.bits, v.bits):  # the byte lookups read whole bytes of a rotary half
        assert bits not in (2, 4) or (rotary_dim // 2) % (8 // bits) == 0, "rotary half not whole bytes of codes"
    sc, c_strides, value_outliers = outlier_passes(q, slots, kv_lens, k, v, rotary_dim, theta, softmax_scale,
                                                   block_table)
    out = _launch(q, slots, kv_lens, kt, ks, vt, vs, sinks, flags, rotary_dim, theta, softmax_scale, splits,
                  _decode_kernel, launch_cfg(k.per_token), constexprs, extra=(sc, *c_strides),
                  before_combine=value_outliers, block_table=block_table)
    return out


def outlier_passes(q, slots, kv_lens, k: KVSideView, v: KVSideView, rotary_dim: int, theta: float,
                   softmax_scale: float | None, block_table: torch.Tensor | None):
    """The sparse outliers' own passes around a decode kernel (this module's and ``kv_decode_warp``'s): runs the key
    pass now and returns (sc, (sc's row-or-block and kv-head strides), the value pass to run between the decode and
    the combine as ``value_outliers(ws, splits)``, or None without value slots). sc is q (unused) without slots."""
    b, hq, e = q.shape
    ko, vo = k.out_idx.shape[-1], v.out_idx.shape[-1]
    if not (ko or vo):  # no passes and no score buffer: nothing to build on the decode's path
        return q, (0, 0), None
    group = hq // k.codes.shape[2]
    pages, bs, cap = paging(block_table, slots, k.codes)  # as ``_launch`` reads them for the decode
    # sparse outliers in their own passes: key score terms before the decode, value terms before the combine. One
    # buffer sc, a kv head's query heads contiguous: the key pass's terms, which the decode adds and overwrites with
    # the whole scores, which the value pass reads
    sc = torch.empty(outlier_workspace_shape(k.codes, b, hq, block_table is not None), dtype=torch.float32,
                     device=q.device)
    c_strides = (sc.stride(0), sc.stride(1))  # sc's (row or block, kv head)
    scale = e ** -0.5 if softmax_scale is None else softmax_scale

    def grid(slots_a_token):
        """(the positions an iteration takes, tokens an iteration) and the grid of a pass over ``slots_a_token``
        slots: programs a row, the iterations of its capacity at most, SPARSE_PROGRAMS an SM over the rows; each
        loops over the iterations below its row's length (read on the device), so a short row in a long cache (a
        serving slot) costs a few programs, not one an iteration of the capacity."""
        n = max(CFG["SPARSE_SLOTS"], next_pow2(slots_a_token))
        tok = n // slots_a_token
        return n, tok, (b, max(1, min(cdiv(cap, tok), CFG["SPARSE_PROGRAMS"] * _sm_count(q.device) // b)))

    gp2 = next_pow2(group)
    kt, ks, vt, vs, _, flags = quant_args(k, v)
    # the passes take a side's pointers and strides without the codes' (``kv_decode._side``'s first 1 and 3): they
    # read only scales, codebook ends and slots
    if ko:
        inv_freq = _inv_freq(max(rotary_dim, 2), theta, q.device)
        n, tok, kgrid = grid(ko)
        _key_outlier_kernel[kgrid](
            q, slots, kv_lens, *pages, inv_freq, sc, *kt[1:], q.stride(0), q.stride(1), *ks[3:], *c_strides, scale,
            hq // group, GROUP=group, GP2=gp2, HKVP=next_pow2(hq // group), E=e, R=rotary_dim,
            S=k.sink.shape[1], PER_TOKEN=k.per_token, KSLOTS=ko, N=n, TP=next_pow2(tok),
            LEVELS=flags["KLEVELS"], FAST=FAST_TRIG, BS=bs, num_warps=4)

    def value_outliers(ws, splits):
        n, _, vgrid = grid(vo)
        _value_outlier_kernel[vgrid](
            ws, sc, slots, kv_lens, *pages, *vt[1:], *ws.stride(), *vs[3:], *c_strides, splits, GROUP=group,
            GP2=gp2, E=e, S=v.sink.shape[1], PER_TOKEN=v.per_token, VSLOTS=vo, N=n,
            BLOCK_T=CFG["BLOCK_T_OUTLIERS"], LEVELS=flags["VLEVELS"], BS=bs, num_warps=4)

    return sc, c_strides, value_outliers if vo else None


def launch_cfg(keys_per_token: bool) -> dict:
    """The launch settings of a quantized cache: ``CFG``, whose register caps were measured on per-channel keys (the
    folded loop); per-token keys (the engine formats' int4 / int2 per token-head), whose loop the fold does not
    shorten, launch uncapped, RESIDENT programs an SM."""
    return {**CFG, "MAXNREG": None, "MAXNREG_OUTLIERS": None} if keys_per_token else CFG


def float_eligible(k_cache: torch.Tensor) -> bool:
    """Float caches this kernel serves: its row of ``dispatch.FLOAT_KV_DECODE``."""
    return serves(FLOAT_KV_DECODE, "kv_decode_fast", float_kv_launch(k_cache.dtype, k_cache.shape[-1]))


def float_kv_decode(q: torch.Tensor, slots: torch.Tensor, kv_lens: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, softmax_scale: float | None = None, splits: int | None = None,
                    block_table: torch.Tensor | None = None) -> torch.Tensor:
    """``kv_decode.float_kv_decode`` (same contract: keys post-RoPE, (s, L, hkv, e) caches or block pools) on this
    kernel: tensor-core products in the cache's dtype (float16 or bfloat16; p and q rounded to it, as flash
    attention does), 3x faster than that kernel's float32-exact 3xTF32 products at 128K tokens (H200)."""
    if not float_eligible(k_cache):
        raise SSMQError("the fast KV decode kernel serves float16 / bfloat16 caches of head dims 32, 64, 128, ... (not "
                        f"{k_cache.dtype} x {k_cache.shape[-1]}); use ssmq.kernels.kv_decode")
    kt, ks, vt, vs, sinks, flags = float_args(k_cache, v_cache)
    return _launch(q, slots, kv_lens, kt, ks, vt, vs, sinks, flags, 0, 10000.0, softmax_scale, splits,
                   _decode_kernel, CFG, constexprs, extra=(q, 0, 0), block_table=block_table)
