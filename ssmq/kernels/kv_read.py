"""A quantized KV cache's rows as float keys or values: the prefix a (chunked) prefill attends to, dequantized on
the GPU in one pass, keys rotated by their positions on the way out. The Triton twin of
``ssmq.ops.kv_quant.quant_kv_read_ref``; ``ssmq.kernels.attention_prefill`` then attends over its output.

Glossary: b rows, T tokens read a row, hkv kv heads, e head dim, r rotary dim, S sink tokens, BS tokens a block
of a paged cache.

One program per (BT tokens, row, kv head): codes unpacked and looked up in the codebook (``kv_decode._tile``), the
scales (per-channel or per-token) applied there, the sink tokens taken from the sink, then the rotary halves (NeoX:
channels c and c + r/2) turned by t θ_c. Pages as the decode kernels (``_page``). It reads the codes and writes e
float16 a token and head once, where the reference chains whole-prefix float32 tensors (unpacked codes, gathered
codebook values, scatter, rotation). The sparse outliers then come from a second kernel (``_outlier_kernel``), which
writes only the channels they hold (and their rotary partners): placed in the read's tiles, each slot cost a compare
and a select on every channel of the head, done by each kv head's program for all of a token's slots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ssmq.kernels import configs
from ssmq.kernels._common import cdiv, next_pow2
from ssmq.kernels.dispatch import QUANT_KV_READ, read_launch, serves
from ssmq.kernels.kv_decode import FAST_TRIG, _codes, _cos_sin, _inv_freq, _page, _slot_scales, _tile, paging
from ssmq.ops.kv_quant import KVSideView

CFG = configs.load("kv_read")  # launch settings (configs/kv_read.json, keys in docs/kernels.md)


@triton.jit
def _read_kernel(out, codes, mid, half, lut, oidx, oval, sink, slots, lens, table, s_tab, inv_freq, end,
                 s_c0, s_c1, s_ch, s_ms, s_mt, s_os, s_ot, s_s0, s_s1, s_sh, s_o0, s_o1, s_oh,
                 E: tl.constexpr, R: tl.constexpr, HP: tl.constexpr, PP: tl.constexpr, S: tl.constexpr,
                 PER_TOKEN: tl.constexpr, BITS: tl.constexpr, BT: tl.constexpr,
                 BS: tl.constexpr, FAST: tl.constexpr, HAS_LENS: tl.constexpr):
    """Every channel from its code (the outlier slots are ``_outlier_kernel``'s, after this one)."""
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


@triton.jit
def _outlier_kernel(out, codes, mid, half, lut, oidx, oval, slots, lens, table, s_tab, inv_freq, end,
                    s_c0, s_c1, s_ch, s_ms, s_mt, s_os, s_ot, s_o0, s_o1, s_oh,
                    E: tl.constexpr, R: tl.constexpr, S: tl.constexpr, PER_TOKEN: tl.constexpr, SLOTS: tl.constexpr,
                    P: tl.constexpr, BITS: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, FAST: tl.constexpr,
                    HAS_LENS: tl.constexpr):
    """Writes over ``_read_kernel``'s output where the sparse outliers are, one program per (row, BT tokens), all of
    a token's slots (BT, P) at once. A pass-through channel takes its slot's value; a rotary channel's pair (c, c +
    r/2) is recomputed as the read computes it (each side its slot's value, or what its code gives) and both
    rotated outputs are stored (a pair with two slots stores the same values twice). Each slot costs a few
    loads, where the read turning them into its tiles cost a compare and a select per channel of the head per slot."""
    i = tl.program_id(0)
    slot = tl.load(slots + i).to(tl.int64)
    t = tl.program_id(1) * BT + tl.arange(0, BT)
    live = (t < end) & (t >= S)  # the sink tokens are the read's, from the sink
    if HAS_LENS:
        live = live & (t < tl.load(lens + i).to(tl.int32))
    pb, pt = _page(table, s_tab, slot, t, live, BS)
    srow = pb * s_os + pt * s_ot  # (BT,)
    j = tl.arange(0, P)
    om = live[:, None] & (j < SLOTS)[None, :]
    f = tl.load(oidx + srow[:, None] + j[None, :], mask=om, other=-1).to(tl.int32)  # flat index in hkv·e
    hit = om & (f >= 0)
    f = tl.where(hit, f, 0)
    h = f // E
    c = f - h * E
    val = tl.load(oval + srow[:, None] + j[None, :], mask=hit, other=0.0).to(tl.float32)
    orow = out + i.to(tl.int64) * s_o0 + t[:, None].to(tl.int64) * s_o1 + h * s_oh  # (BT, P)
    ty = out.dtype.element_ty
    if R > 0:
        rot = hit & (c < R)
        low = c < R // 2
        a = tl.where(low, c, c - R // 2)
        partner = tl.where(low, c + R // 2, a)
        # the partner's value: its slot's if it has one, else what its code gives (as ``kv_decode._tile``)
        code = _codes(codes + (pb * s_c0 + pt * s_c1)[:, None] + h * s_ch, partner, rot, BITS, E)
        m, hf = _slot_scales(mid, half, pb[:, None], pt, h, partner, rot, s_ms, s_mt, E, PER_TOKEN)
        xp = m + hf * tl.load(lut + code, mask=rot, other=0.0)
        pf = h * E + partner
        for jj in range(SLOTS):
            fj = tl.load(oidx + srow + jj, mask=live, other=-1).to(tl.int32)
            vj = tl.load(oval + srow + jj, mask=live, other=0.0).to(tl.float32)
            xp = tl.where(fj[:, None] == pf, vj[:, None], xp)
        xa, xb = tl.where(low, val, xp), tl.where(low, xp, val)
        freq = tl.load(inv_freq + a, mask=rot, other=0.0)
        cos, sin = _cos_sin(t.to(tl.float32)[:, None] * freq, FAST)
        tl.store(orow + a, (xa * cos - xb * sin).to(ty), mask=rot)
        tl.store(orow + a + R // 2, (xb * cos + xa * sin).to(ty), mask=rot)
        hit = hit & (c >= R)
    tl.store(orow + c, val.to(ty), mask=hit)


def eligible(side: KVSideView, rotary_dim: int) -> bool:
    """The sides this kernel reads: its row of ``dispatch.QUANT_KV_READ``."""
    return serves(QUANT_KV_READ, "kv_read", read_launch(side, rotary_dim))


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
    bt, lens = CFG["BT"], slots if kv_lens is None else kv_lens
    _read_kernel[(cdiv(end, bt), b, hkv)](
        out, c, m, side.half, book, o, side.out_val, s, slots, lens, *pages,
        inv_freq, end,
        c.stride(0), c.stride(1), c.stride(2), *ms, o.stride(0), o.stride(1), s.stride(0), s.stride(1), s.stride(2),
        *out.stride()[:3], E=e, R=rotary_dim, HP=max(16, next_pow2(max(rotary_dim // 2, 1))),
        PP=max(16, next_pow2(max(e - rotary_dim, 1))), S=s.shape[1], PER_TOKEN=side.per_token,
        BITS=side.bits, BT=bt, BS=bs, FAST=FAST_TRIG, HAS_LENS=kv_lens is not None, num_warps=CFG["WARPS"])
    if o.shape[-1]:
        bt = CFG["BT_OUTLIERS"]
        _outlier_kernel[(b, cdiv(end, bt))](
            out, c, m, side.half, book, o, side.out_val, slots, lens, *pages, inv_freq, end,
            c.stride(0), c.stride(1), c.stride(2), *ms, o.stride(0), o.stride(1), *out.stride()[:3],
            E=e, R=rotary_dim, S=s.shape[1], PER_TOKEN=side.per_token, SLOTS=o.shape[-1],
            P=next_pow2(o.shape[-1]), BITS=side.bits, BT=bt, BS=bs, FAST=FAST_TRIG,
            HAS_LENS=kv_lens is not None, num_warps=CFG["OUTLIER_WARPS"])
    return out
