"""Triton decode attention over a quantized KV cache (KVQuant): LUT-based low-bit K and V matrix-vector products.

Glossary: b rows, hq query heads, hkv kv heads, e head dim, T tokens, r rotary dim, S sink tokens, k outlier slots.
Same contract as ``ssmq.ops.kv_quant.quant_kv_decode_ref`` (its docstring has the storage layout).

    scores   one program per (row, kv head, split of T): each (BLOCK_T, e) tile of key codes is unpacked from
             nibbles, looked up in the codebook (LUT, float32), scaled (per-channel or per-token mid / half), the
             token's sparse outliers written over it, and dotted with the query rotated by -t (RoPE on the fly:
             q · R_t k = (R_{-t} q) · k, so keys stay as stored, before RoPE), for each query head of the group
    softmax  in torch over (b, hq, T), float32 (the sink tokens' scores replaced by their float keys' first)
    values   the same tile dequantization for value codes, weighted by the probabilities; each split writes a
             float32 partial (b, hq, splits, e) that torch adds up
Codes must be packed nibbles (codebooks of <= 16 entries) and unrotated; other formats take the reference.
A tile is dequantized once for the hq / hkv query heads that share its kv head (GQA).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ssmq.ops.attention import apply_rotary_ref, rotary_cos_sin
from ssmq.ops.kv_quant import KVSideView

BLOCK_T = 64
TILES_PER_SPLIT = 16  # tokens per program = BLOCK_T * TILES_PER_SPLIT (more splits for short contexts: none)


@triton.jit
def _tile(codes, mid, half, lut, oidx, oval, slot, hk, t, tmask, offs_e,
          s_cs, s_ct, s_ch, s_ms, s_mt, s_os, s_ot,
          E: tl.constexpr, PER_TOKEN: tl.constexpr, KSLOTS: tl.constexpr):
    """(BLOCK_T, E) float32 dequantized tile of tokens t of kv head hk in slot ``slot``."""
    byte = tl.load(codes + slot * s_cs + t[:, None] * s_ct + hk * s_ch + (offs_e // 2)[None, :],
                   mask=tmask[:, None], other=0).to(tl.int32)
    code = (byte >> ((offs_e % 2) * 4)[None, :]) & 15
    c = tl.load(lut + code)
    if PER_TOKEN:
        m = tl.load(mid + slot * s_ms + t * s_mt + hk, mask=tmask, other=0.0).to(tl.float32)
        h = tl.load(half + slot * s_ms + t * s_mt + hk, mask=tmask, other=0.0).to(tl.float32)
        x = m[:, None] + h[:, None] * c
    else:
        m = tl.load(mid + hk * E + offs_e)
        h = tl.load(half + hk * E + offs_e)
        x = m[None, :] + h[None, :] * c
    for j in tl.static_range(KSLOTS):  # sparse outliers: flat index in hkv·e, -1 for an empty slot
        idx = tl.load(oidx + slot * s_os + t * s_ot + j, mask=tmask, other=-1).to(tl.int32)
        val = tl.load(oval + slot * s_os + t * s_ot + j, mask=tmask, other=0.0).to(tl.float32)
        x = tl.where(idx[:, None] == (hk * E + offs_e)[None, :], val[:, None], x)
    return x


@triton.jit
def _scores_kernel(q, codes, mid, half, lut, oidx, oval, slots, lens, inv_freq, out,
                   s_qb, s_cs, s_ct, s_ch, s_ms, s_mt, s_os, s_ot, s_ob, s_oh, scale,
                   GROUP: tl.constexpr, E: tl.constexpr, R: tl.constexpr, PER_TOKEN: tl.constexpr,
                   KSLOTS: tl.constexpr, BLOCK_T: tl.constexpr, TILES: tl.constexpr):
    i, hk, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(slots + i)
    n = tl.load(lens + i)
    offs_e = tl.arange(0, E)
    if R > 0:  # rotate_half(q) takes channel partner[j] with sign[j]; cos 1, sin 0 beyond the first R channels
        partner = tl.where(offs_e < R // 2, offs_e + R // 2, offs_e - R // 2)
        sign = tl.where(offs_e < R // 2, -1.0, 1.0)
        freq = tl.load(inv_freq + offs_e % (R // 2), mask=offs_e < R, other=0.0)
    for tile in range(TILES):
        t = (sp * TILES + tile) * BLOCK_T + tl.arange(0, BLOCK_T)
        tmask = t < n
        # one dequantized tile of the kv head serves its GROUP query heads
        x = _tile(codes, mid, half, lut, oidx, oval, slot, hk, t, tmask, offs_e,
                  s_cs, s_ct, s_ch, s_ms, s_mt, s_os, s_ot, E, PER_TOKEN, KSLOTS)
        if R > 0:
            ang = t.to(tl.float32)[:, None] * freq[None, :]
            cos = tl.where(offs_e[None, :] < R, tl.cos(ang), 1.0)
            sin = tl.sin(ang)
        for g in tl.static_range(GROUP):
            h = hk * GROUP + g
            qv = tl.load(q + i * s_qb + h * E + offs_e)
            if R > 0:
                rq = sign * tl.load(q + i * s_qb + h * E + partner, mask=offs_e < R, other=0.0)
                qt = qv[None, :] * cos - rq[None, :] * sin  # R_{-t} q
            else:
                qt = qv[None, :] + tl.zeros_like(x)
            s = tl.sum(qt * x, axis=1) * scale
            tl.store(out + i * s_ob + h * s_oh + t, s, mask=tmask)


@triton.jit
def _values_kernel(p, codes, mid, half, lut, oidx, oval, slots, lens, out,
                   s_pb, s_ph, s_cs, s_ct, s_ch, s_ms, s_mt, s_os, s_ot, s_ob, s_oh, s_osp,
                   GROUP: tl.constexpr, GP: tl.constexpr, E: tl.constexpr, PER_TOKEN: tl.constexpr,
                   KSLOTS: tl.constexpr, BLOCK_T: tl.constexpr, TILES: tl.constexpr):
    i, hk, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(slots + i)
    n = tl.load(lens + i)
    offs_e = tl.arange(0, E)
    rows = tl.arange(0, GP)  # the group's query heads, padded to a power of two
    acc = tl.zeros((GP, E), dtype=tl.float32)
    for tile in range(TILES):
        t = (sp * TILES + tile) * BLOCK_T + tl.arange(0, BLOCK_T)
        tmask = t < n
        x = _tile(codes, mid, half, lut, oidx, oval, slot, hk, t, tmask, offs_e,
                  s_cs, s_ct, s_ch, s_ms, s_mt, s_os, s_ot, E, PER_TOKEN, KSLOTS)
        for g in tl.static_range(GROUP):
            w = tl.load(p + i * s_pb + (hk * GROUP + g) * s_ph + t, mask=tmask, other=0.0)
            acc = tl.where(rows[:, None] == g, acc + tl.sum(w[:, None] * x, axis=0)[None, :], acc)
    dst = out + i * s_ob + (hk * GROUP + rows)[:, None] * s_oh + sp * s_osp + offs_e[None, :]
    tl.store(dst, acc, mask=(rows < GROUP)[:, None])


def _side_args(v: KVSideView):
    c, m, o = v.codes, v.mid, v.out_idx
    ms = (m.stride(0), m.stride(1)) if v.per_token else (0, 0)
    return (c, m, v.half, v.codebook.float().contiguous(), o, v.out_val), (
        c.stride(0), c.stride(1), c.stride(2), *ms, o.stride(0), o.stride(1))


def quant_kv_decode(q: torch.Tensor, slots: torch.Tensor, kv_lens: torch.Tensor, k: KVSideView, v: KVSideView,
                    rotary_dim: int = 0, theta: float = 10000.0, softmax_scale: float | None = None,
                    return_scores: bool = False):
    """``quant_kv_decode_ref`` on the GPU: q (b, hq, e) → (b, hq, e) float32 (and the scores (b, hq, T))."""
    b, hq, e = q.shape
    hkv = k.codes.shape[2]
    end = int(kv_lens.max())
    scale = e ** -0.5 if softmax_scale is None else softmax_scale
    q = q.float().contiguous()
    slots, lens = slots.to(torch.int64).contiguous(), kv_lens.to(torch.int32).contiguous()
    tiles = min(TILES_PER_SPLIT, triton.cdiv(end, BLOCK_T))
    splits = triton.cdiv(end, BLOCK_T * tiles)
    inv_freq = (1.0 / (theta ** (torch.arange(0, max(rotary_dim, 2), 2, dtype=torch.float32, device=q.device)
                                 / max(rotary_dim, 1))))
    scores = torch.full((b, hq, end), -math.inf, dtype=torch.float32, device=q.device)
    kt, ks = _side_args(k)
    _scores_kernel[(b, hkv, splits)](q, *kt, slots, lens, inv_freq, scores, q.stride(0), *ks, scores.stride(0),
                                     scores.stride(1), scale, GROUP=hq // hkv, E=e, R=rotary_dim,
                                    PER_TOKEN=k.per_token, KSLOTS=k.out_idx.shape[-1], BLOCK_T=BLOCK_T, TILES=tiles)
    sink = min(k.sink.shape[1], end)
    if sink:  # the sink tokens' keys are kept in float: their scores from them
        ks_ = k.sink[slots, :sink].float()
        if rotary_dim:
            pos = torch.arange(sink, device=q.device).expand(b, sink)
            ks_ = apply_rotary_ref(ks_, *rotary_cos_sin(pos, rotary_dim, theta))
        ks_ = ks_.repeat_interleave(hq // hkv, dim=2)  # (b, S, hq, e)
        scores[:, :, :sink] = torch.einsum("bhe,bshe->bhs", q, ks_) * scale
    p = scores.softmax(-1)  # positions >= kv_lens hold -inf: probability 0
    p_sink = p[:, :, :sink].clone()
    p[:, :, :sink] = 0
    part = torch.empty(b, hq, splits, e, dtype=torch.float32, device=q.device)
    vt, vs = _side_args(v)
    _values_kernel[(b, hkv, splits)](p, *vt, slots, lens, part, p.stride(0), p.stride(1), *vs, part.stride(0),
                                     part.stride(1), part.stride(2), GROUP=hq // hkv,
                                     GP=triton.next_power_of_2(hq // hkv), E=e, PER_TOKEN=v.per_token,
                                    KSLOTS=v.out_idx.shape[-1], BLOCK_T=BLOCK_T, TILES=tiles)
    out = part.sum(2)
    if sink:
        out += torch.einsum("bhs,bshe->bhe", p_sink, v.sink[slots, :sink].float().repeat_interleave(hq // hkv, 2))
    return (out, scores) if return_scores else out
