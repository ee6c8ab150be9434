"""Quantize-and-append for a quantized KV cache: one Triton program a token writes its codes (packed), per-token
scales, outlier slots and sink entry, exactly as ``QuantSide.write`` does with the reference ops
(``ssmq.ops.kv_quant.quantize_kv_ref`` + ``pack_codes`` + the scatters), in one launch a side.

Why: the reference write is dozens of small torch kernels a layer and a step (top-k, where, amax / amin, bucketize,
packing, scatters); end to end on the H100 they cost more than the quantized cache saves in attention (Llama-3.1-8B
config, batch 1, 32K tokens: ~6 ms a step for nuq4, ~11 ms for nuq4-1%, against 3.5 ms of float16 attention;
profiled on the H100).

Glossary: n tokens written (b rows × l), hkv kv heads, e head dim (HP, EP padded to powers of two), k outlier slots
a token (KP padded), C codebook entries (LEVELS), S sink positions, NB packed bytes of a head's row.
Per token (x (hkv, e) float32):
    outliers  per-channel sides: score = max(x - hi, lo - x) / max(hi - lo, 1e-8) (offline thresholds), per-token
              sides: |x| + 1; the k largest scores, those > 0: all of them when there are k or fewer (one pass),
              else taken one at a time (a max over (score bits, inverted index) keys: the first index of a tie,
              where torch.topk leaves the choice open); stored in increasing index order, empties -1 last
              (``order_slots``): slot j holds the selected entry of rank j
    scales    per-token: mid, half over each head's entries that are not outliers, rounded to float16 (what is
              stored is what quantizes); per-channel: from the offline lo / hi
    codes     the number of codebook midpoints below u = clamp((x - mid) / half, -1, 1) (``torch.bucketize``), IEEE
              division as torch's; under an outlier the codebook's end on its value's side (``outlier_codes``)
    packing   ``pack_codes``' layout: 4 / 2 bits a little-endian bit string, 3 bits a 2-bit and a 1-bit plane
Formats served: 2-4 bit codebooks, per-token or per-channel sides, symmetric or not, no rotation; the rest (8-bit
codes, rotated TurboQuant-style sides, per-tensor scales) keeps the reference write.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ssmq.kernels._common import next_pow2
from ssmq.kernels.dispatch import QUANT_KV_APPEND, append_launch, serves
from ssmq.ops.kv_quant import KVParams

# One program a token is latency-bound (its selection is a chain of reductions): more warps shorten each step.
# H100, Llama-8B sides (8 x 128), 1% outliers: 4 warps 8.2 us a launch, 8 warps 7.6 (2 warps 15.6, 1 warp 31).
NUM_WARPS = 8


@triton.jit
def _mid_half(lo, hi, SYMMETRIC: tl.constexpr):
    """``ssmq.ops.kv_quant._mid_half``: the centre and half-width of [lo, hi] (symmetric: 0 and max |lo|, |hi|)."""
    if SYMMETRIC:
        return tl.zeros_like(hi), tl.maximum(tl.abs(lo), tl.abs(hi))
    return (hi + lo) / 2, (hi - lo) / 2


@triton.jit
def _append_kernel(x, slots, positions, table, s_tab, codes, mid, half, oidx, oval, sink, book, lo, hi,
                   s_xt, s_xh, l, s_pb, c_s, c_t, c_h, m_s, m_t, o_s, o_t, k_s, k_t, k_h,
                   HKV: tl.constexpr, E: tl.constexpr, HP: tl.constexpr, EP: tl.constexpr, NB: tl.constexpr,
                   LEVELS: tl.constexpr, BITS: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                   PER_TOKEN: tl.constexpr, SYMMETRIC: tl.constexpr, S: tl.constexpr, BS: tl.constexpr):
    """BS > 0: the per-token buffers are block pools, the token's block table[slot, pos // BS] (the sink is not)."""
    pid = tl.program_id(0)
    r = pid // l
    slot = tl.load(slots + r)
    pos = tl.load(positions + r * s_pb + pid % l)
    if BS > 0:  # (row, position) of the token in the per-token buffers
        at_row, at_pos = tl.load(table + slot * s_tab + pos // BS), pos % BS
    else:
        at_row, at_pos = slot, pos
    h = tl.arange(0, HP)[:, None]
    c = tl.arange(0, EP)[None, :]
    m = (h < HKV) & (c < E)
    flat = h * E + c  # the entry's index in the token (hkv · e), as the outlier slots store it
    xv = tl.load(x + pid * s_xt + h * s_xh + c, mask=m, other=0.0).to(tl.float32)
    if not PER_TOKEN:
        lo_ = tl.load(lo + flat, mask=m, other=0.0)
        hi_ = tl.load(hi + flat, mask=m, other=0.0)

    sel = flat < 0  # all False
    if K > 0:
        if PER_TOKEN:
            score = tl.abs(xv) + 1.0
        else:
            score = tl.math.div_rn(tl.maximum(xv - hi_, lo_ - xv), tl.maximum(hi_ - lo_, 1e-8))
        # one int64 key an entry: a positive score's bits (ordered as the floats) above the inverted index, so that
        # one max finds the best score and, among equal ones, the first index; 0 for scores <= 0 (never kept)
        key = tl.where(m & (score > 0), (score.to(tl.int32, bitcast=True).to(tl.int64) << 32)
                       | (HKV * E - 1 - flat).to(tl.int64), 0)
        # selection over the token as one vector: one reduction a step, where the (hkv, e) tile needs two
        key1 = tl.reshape(key, (HP * EP,))
        sel1 = key1 > 0
        if tl.sum(sel1.to(tl.int32), 0) > K:  # more candidates than slots: the K largest, one at a time
            sel1 = key1 < 0  # (per-channel keys mostly have fewer: one pass; per-token values always more)
            for _ in tl.static_range(K):
                best = tl.max(key1, 0)
                hit = (key1 == best) & (key1 > 0)
                sel1 = sel1 | hit
                key1 = tl.where(hit, 0, key1)
        # the selected entry of rank j goes to slot j (index order; padded entries are never selected), by a
        # scatter: at most K are selected, the slots past them get the empty marks
        rank = tl.cumsum(sel1.to(tl.int32), 0) - 1
        kept = tl.sum(sel1.to(tl.int32), 0)
        at = at_row * o_s + at_pos * o_t
        tl.store(oidx + at + rank, tl.reshape(flat, (HP * EP,)).to(tl.int16), mask=sel1)
        tl.store(oval + at + rank, tl.reshape(xv, (HP * EP,)).to(tl.float16), mask=sel1)
        jj = tl.arange(0, KP)
        tl.store(oidx + at + jj, tl.full((KP,), -1, tl.int16), mask=(jj < K) & (jj >= kept))
        tl.store(oval + at + jj, tl.zeros((KP,), tl.float16), mask=(jj < K) & (jj >= kept))
        sel = tl.reshape(sel1, (HP, EP))

    if PER_TOKEN:  # over each head's entries that are not outliers; stored float16, used as stored
        mid_t, half_t = _mid_half(tl.min(tl.where(sel | ~m, float("inf"), xv), 1),
                                  tl.max(tl.where(sel | ~m, float("-inf"), xv), 1), SYMMETRIC)
        mid16 = mid_t.to(tl.float16)
        half16 = tl.maximum(half_t, 1e-4).to(tl.float16)
        hh = tl.arange(0, HP)
        tl.store(mid + at_row * m_s + at_pos * m_t + hh, mid16, mask=hh < HKV)
        tl.store(half + at_row * m_s + at_pos * m_t + hh, half16, mask=hh < HKV)
        midv = mid16.to(tl.float32)[:, None]
        halfv = half16.to(tl.float32)[:, None]
    else:
        midv, halfv = _mid_half(lo_, hi_, SYMMETRIC)
        halfv = tl.maximum(halfv, 1e-8)

    u = tl.minimum(tl.maximum(tl.math.div_rn(xv - midv, halfv), -1.0), 1.0)
    code = tl.zeros((HP, EP), tl.int32)
    for i in tl.static_range(LEVELS - 1):
        code += ((tl.load(book + i + 1) + tl.load(book + i)) / 2 < u).to(tl.int32)
    code = tl.where(sel, tl.where(xv.to(tl.float16).to(tl.float32) >= midv, LEVELS - 1, 0), code)

    code = tl.where(m, code, 0)  # the padding of a row's last byte: zero bits, as pack_codes
    row = codes + at_row * c_s + at_pos * c_t + h * c_h
    if BITS == 3:  # two planes: the low 2 bits four a byte, then bit 2 eight a byte
        g = tl.arange(0, EP // 4)[None, :]
        w = tl.sum(tl.reshape(code & 3, (HP, EP // 4, 4)) << (2 * tl.arange(0, 4))[None, None, :], 2)
        tl.store(row + g, w.to(tl.uint8), mask=(h < HKV) & (g < (E + 3) // 4))
        g8 = tl.arange(0, EP // 8)[None, :]
        w8 = tl.sum(tl.reshape(code >> 2, (HP, EP // 8, 8)) << tl.arange(0, 8)[None, None, :], 2)
        tl.store(row + (E + 3) // 4 + g8, w8.to(tl.uint8), mask=(h < HKV) & (g8 < (E + 7) // 8))
    else:  # 8 / BITS codes a byte
        CB: tl.constexpr = 8 // BITS
        g = tl.arange(0, EP // CB)[None, :]
        w = tl.sum(tl.reshape(code, (HP, EP // CB, CB)) << (BITS * tl.arange(0, CB))[None, None, :], 2)
        tl.store(row + g, w.to(tl.uint8), mask=(h < HKV) & (g < NB))
    if S > 0:
        tl.store(sink + slot * k_s + pos * k_t + h * k_h + c, xv.to(sink.dtype.element_ty),
                 mask=m & (c * 0 + pos < S))  # (a tensor: the interpreter refuses a scalar mask operand)


def eligible(p: KVParams, bits: int) -> bool:
    """The formats the kernel writes exactly (module docstring): its row of ``dispatch.QUANT_KV_APPEND``."""
    return serves(QUANT_KV_APPEND, "kv_append", append_launch(p, bits))


def quant_kv_append(x: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, p: KVParams, bits: int,
                    codes: torch.Tensor, mid: torch.Tensor | None, half: torch.Tensor | None, out_idx: torch.Tensor,
                    out_val: torch.Tensor, sink: torch.Tensor, block_table: torch.Tensor | None = None) -> None:
    """Quantize x (b, l, hkv, e) and write it at ``positions`` (b, l) of the rows ``slots`` (b,) into a
    ``QuantSide``'s buffers: codes (s, L, hkv, NB) uint8, mid / half (s, L, hkv) float16 (per-token sides, else
    None), out_idx / out_val (s, L, k), sink (s, S, hkv, e); with ``block_table`` (s, M) the per-token buffers are
    block pools (N, B, ...) (``ssmq.models.quant_kv``). Same bytes as the reference write (tested)."""
    assert eligible(p, bits), "format not served by the fused append"
    b, l, hkv, e = x.shape
    xf = x.reshape(b * l, hkv, e)
    if xf.stride(-1) != 1:
        xf = xf.contiguous()
    positions = positions.contiguous()
    per_token = p.granularity == "per_token"
    k = out_idx.shape[-1]
    book = p.codebook.to(x.device, torch.float32).contiguous()
    lo = book if per_token else p.lo.to(x.device, torch.float32).contiguous()
    hi = book if per_token else p.hi.to(x.device, torch.float32).contiguous()
    ms = mid if per_token else codes  # unused pointers when per-channel
    hs = half if per_token else codes
    pages = (block_table, block_table.stride(0)) if block_table is not None else (slots, 0)
    _append_kernel[(b * l,)](
        xf, slots, positions, *pages, codes, ms, hs, out_idx, out_val, sink, book, lo, hi,
        xf.stride(0), xf.stride(1), l, positions.stride(0), codes.stride(0), codes.stride(1), codes.stride(2),
        ms.stride(0), ms.stride(1), out_idx.stride(0), out_idx.stride(1), sink.stride(0), sink.stride(1),
        sink.stride(2), HKV=hkv, E=e, HP=next_pow2(hkv), EP=max(8, next_pow2(e)),
        NB=codes.shape[-1], LEVELS=book.numel(), BITS=bits, K=k, KP=max(2, next_pow2(k)),
        PER_TOKEN=per_token, SYMMETRIC=p.symmetric, S=sink.shape[1],
        BS=codes.shape[1] if block_table is not None else 0, num_warps=NUM_WARPS)
