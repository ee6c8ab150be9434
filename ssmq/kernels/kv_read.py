"""A quantized KV cache's rows as float keys or values: the prefix a (chunked) prefill attends to, dequantized on
the GPU in one pass, keys rotated by their positions on the way out. The Triton twin of
``ssmq.ops.kv_quant.quant_kv_read_ref``; ``ssmq.kernels.attention_prefill`` then attends over its output.

Glossary: b rows, T tokens read a row, hkv kv heads, e head dim, r rotary dim, S sink tokens, BS tokens a block
of a paged cache.

One program per (BT tokens, row, kv head): codes unpacked and looked up in the codebook (``kv_decode._tile``), the
scales (per-channel or per-token) and the sparse outliers applied there, the sink tokens taken from the sink, then
the rotary halves (NeoX: channels c and c + r/2) turned by t θ_c. Pages as the decode kernels (``_page``). It
reads the codes and writes e float16 a token and head once, where the reference chains whole-prefix float32 tensors
(unpacked codes, gathered codebook values, scatter, rotation); on the H200 it takes 3-11x a copy of the bytes it
writes (CFG below), not profiled further.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ssmq.kernels.kv_decode import FAST_TRIG, _cos_sin, _inv_freq, _page, _tile, paging
from ssmq.ops.kv_quant import KVSideView

# BT tokens a program (BT_OUTLIERS with sparse outliers), SLOT_GROUP outlier slots a load. H200, 2026-11-28, one
# Llama-3.1-8B layer at 32K tokens, K + V ms (its first version: benchmarks/results/prefill_h200/s25_read_sweep.jsonl;
# ``bench_prefill.py --parts sweep --prompt 32768``): no outliers BT 16 0.199, 32 0.335, 64 0.342; nuq4-1% BT 32
# 0.438, 64 0.483, 16 1.35, 8 warps 1.53; slot groups of 8 0.507. A copy of the 134 MB written: 0.067
CFG = {"BT": 16, "BT_OUTLIERS": 32, "SLOT_GROUP": 4, "WARPS": 4}


@triton.jit
def _read_kernel(out, codes, mid, half, lut, oidx, oval, sink, slots, lens, table, s_tab, inv_freq, end,
                 s_c0, s_c1, s_ch, s_ms, s_mt, s_os, s_ot, s_s0, s_s1, s_sh, s_o0, s_o1, s_oh,
                 E: tl.constexpr, R: tl.constexpr, HP: tl.constexpr, PP: tl.constexpr, S: tl.constexpr,
                 PER_TOKEN: tl.constexpr, SLOTS: tl.constexpr, BITS: tl.constexpr, BT: tl.constexpr,
                 BS: tl.constexpr, FAST: tl.constexpr, GROUP: tl.constexpr, HAS_LENS: tl.constexpr):
    i, hk = tl.program_id(1), tl.program_id(2)
    slot = tl.load(slots + i).to(tl.int64)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tmask = t < end
    if HAS_LENS:  # tokens past the row's length are left unwritten (a read of a cache's whole capacity: prefill graphs)
        n = tl.load(lens + i).to(tl.int32)
        if tl.program_id(0) * BT >= n:
            return
        tmask = tmask & (t < n)
    pb, pt = _page(table, s_tab, slot, t, tmask, BS)
    rowoff = pb * s_c0 + pt * s_c1
    ch = tl.arange(0, HP)
    hmask = ch < R // 2
    cp = tl.arange(0, PP)
    pmask = cp < E - R
    # (BT, r/2) both rotary halves and (BT, e - r) the pass-through channels, dequantized (codes and scales)
    xa = _tile(codes, mid, half, lut, oidx, oval, pb, hk, pt, tmask, ch, hmask, rowoff, s_ch, s_ms, s_mt, s_os,
               s_ot, E, False, PER_TOKEN, 0, BITS)
    xb = _tile(codes, mid, half, lut, oidx, oval, pb, hk, pt, tmask, R // 2 + ch, hmask, rowoff, s_ch, s_ms, s_mt,
               s_os, s_ot, E, False, PER_TOKEN, 0, BITS)
    xp = _tile(codes, mid, half, lut, oidx, oval, pb, hk, pt, tmask, R + cp, pmask, rowoff, s_ch, s_ms, s_mt, s_os,
               s_ot, E, False, PER_TOKEN, 0, BITS)
    # the sparse outliers replace their channels: GROUP slots a load (one vector of a token's GROUP indices and one
    # of values), so that a program waits on SLOTS / GROUP loads, not on one a slot and tile (H200, 32K tokens,
    # nuq4-1%: 0.47 ms for K + V with ``_tile``'s loop of one slot a load in each of the three tiles)
    g = tl.arange(0, GROUP)
    orow = (pb * s_os + pt * s_ot)[:, None]
    for j0 in range(0, SLOTS, GROUP):
        om = tmask[:, None] & (j0 + g < SLOTS)[None, :]
        idx4 = tl.load(oidx + orow + j0 + g[None, :], mask=om, other=-1).to(tl.int32) - hk * E
        val4 = tl.load(oval + orow + j0 + g[None, :], mask=om, other=0.0).to(tl.float32)
        for jj in tl.static_range(GROUP):
            idx = tl.sum(tl.where(g[None, :] == jj, idx4, 0), 1)  # (BT,): slot j0 + jj of each token
            val = tl.sum(tl.where(g[None, :] == jj, val4, 0.0), 1)
            xa = tl.where(idx[:, None] == ch[None, :], val[:, None], xa)
            xb = tl.where(idx[:, None] == R // 2 + ch[None, :], val[:, None], xb)
            xp = tl.where(idx[:, None] == R + cp[None, :], val[:, None], xp)
    if S > 0:  # the sink tokens are kept in float (before RoPE, as the codes)
        sm = tmask & (t < S)
        srow = sink + slot * s_s0 + t[:, None] * s_s1 + hk * s_sh
        xa = tl.where(sm[:, None], tl.load(srow + ch[None, :], mask=sm[:, None] & hmask[None, :], other=0.0)
                      .to(tl.float32), xa)
        xb = tl.where(sm[:, None], tl.load(srow + R // 2 + ch[None, :], mask=sm[:, None] & hmask[None, :],
                                           other=0.0).to(tl.float32), xb)
        xp = tl.where(sm[:, None], tl.load(srow + R + cp[None, :], mask=sm[:, None] & pmask[None, :], other=0.0)
                      .to(tl.float32), xp)
    if R > 0:
        freq = tl.load(inv_freq + ch, mask=hmask, other=0.0)
        cos, sin = _cos_sin(t.to(tl.float32)[:, None] * freq[None, :], FAST)
        xa, xb = xa * cos - xb * sin, xb * cos + xa * sin
    orow = out + i.to(tl.int64) * s_o0 + t[:, None].to(tl.int64) * s_o1 + hk * s_oh
    ty = out.dtype.element_ty
    tl.store(orow + ch[None, :], xa.to(ty), mask=tmask[:, None] & hmask[None, :])
    tl.store(orow + R // 2 + ch[None, :], xb.to(ty), mask=tmask[:, None] & hmask[None, :])
    tl.store(orow + R + cp[None, :], xp.to(ty), mask=tmask[:, None] & pmask[None, :])


def eligible(side: KVSideView, rotary_dim: int) -> bool:
    """2-4 bit codes (``_tile``'s unpacking) and an even rotary dim."""
    return side.bits in (2, 3, 4) and rotary_dim % 2 == 0


def quant_kv_read(side: KVSideView, slots: torch.Tensor, end: int, rotary_dim: int = 0, theta: float = 10000.0,
                  dtype=torch.float16, block_table: torch.Tensor | None = None,
                  kv_lens: torch.Tensor | None = None) -> torch.Tensor:
    """``quant_kv_read_ref`` on the GPU: the rows ``slots`` (b,) of one side up to ``end`` as (b, end, hkv, e) in
    ``dtype``, the first ``rotary_dim`` channels rotated by their positions (keys cached before RoPE; 0: as
    stored). ``block_table`` (s, M): the per-token buffers are block pools, read in place. ``kv_lens`` (b,): a row's
    tokens from its length on are not written (left as allocated), for a reader that stops there too."""
    e = side.sink.shape[-1]
    b, hkv = len(slots), side.codes.shape[2]
    out = torch.empty(b, end, hkv, e, dtype=dtype, device=side.codes.device)
    if end == 0 or b == 0:
        return out
    pages, bs, _ = paging(block_table, slots, side.codes)
    c, m, o, s = side.codes, side.mid, side.out_idx, side.sink
    ms = (m.stride(0), m.stride(1)) if side.per_token else (0, 0)
    book = side.codebook.float().contiguous()
    inv_freq = _inv_freq(max(rotary_dim, 2), theta, c.device)
    bt = CFG["BT_OUTLIERS"] if o.shape[-1] else CFG["BT"]
    _read_kernel[(triton.cdiv(end, bt), b, hkv)](
        out, c, m, side.half, book, o, side.out_val, s, slots, slots if kv_lens is None else kv_lens, *pages,
        inv_freq, end,
        c.stride(0), c.stride(1), c.stride(2), *ms, o.stride(0), o.stride(1), s.stride(0), s.stride(1), s.stride(2),
        *out.stride()[:3], E=e, R=rotary_dim, HP=max(16, triton.next_power_of_2(max(rotary_dim // 2, 1))),
        PP=max(16, triton.next_power_of_2(max(e - rotary_dim, 1))), S=s.shape[1], PER_TOKEN=side.per_token,
        SLOTS=o.shape[-1], BITS=side.bits, BT=bt, BS=bs, FAST=FAST_TRIG, GROUP=CFG["SLOT_GROUP"],
        HAS_LENS=kv_lens is not None, num_warps=CFG["WARPS"])
    return out
