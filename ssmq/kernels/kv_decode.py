"""Triton flash-decoding attention over a quantized KV cache (KVQuant: LUT low-bit K and V), or a float one.

Glossary: b rows, hq query heads, hkv kv heads, g = hq / hkv query heads a kv head serves, e head dim, T tokens,
r rotary dim, S sink tokens, k outlier slots, n a row's length, P splits of a row's tokens.
Same contract as ``ssmq.ops.kv_quant.quant_kv_decode_ref`` (its docstring has the storage layout).

One program per (row, kv head, split): the split's tokens in (BLOCK_T, e) tiles, each tile read once for the
kv head's g query heads, with an online softmax (running max m, sum l, unnormalized output acc):
    keys     codes unpacked (2, 3 or 4 bits: ``_codes``), looked up in the codebook (LUT), scaled (per-channel or
             per-token mid / half), then rotated by their position (RoPE on the fly: keys are cached before it;
             angles in the kernel from the cached inv_freq); scores (g, BLOCK_T) = q · kᵀ as tensor-core products
             (3xTF32: float32 accuracy);
             the sparse outliers then add (val - x̂) · (their channel's coefficient in q · R_t k), gathered
    values   the same dequantization with the outliers written over the tile, acc += p · v as one product
    sink     split 0 first folds in the S float sink tokens (same rotation), before its quantized tiles
Each split writes (m, l, acc); ``_combine_kernel`` rescales and adds them (one split: the output directly).
The split count fills the GPU (WAVES programs an SM) without reading the lengths on the host: a row's tokens are
divided among the P splits in the kernel, so there is no host sync, and no torch op between the kernels.
``float_kv_decode`` is the same kernel over a float cache (FLOAT: keys post-RoPE, no LUT, outliers or sink).
Codes must be packed at 2, 3 or 4 bits (codebooks of <= 16 entries; the bits a side's constexpr) and unrotated;
other formats take the reference.
"""

from __future__ import annotations

import functools
from fractions import Fraction

import torch
import triton
import triton.language as tl
from triton import knobs

from ssmq.kernels import configs
from ssmq.kernels._common import cdiv, next_pow2
from ssmq.kernels.rotary import inv_freq_on as _inv_freq  # cached: no per-call table building
from ssmq.ops.kv_quant import KVSideView

CFG = configs.load("kv_decode")  # launch settings (configs/kv_decode.json, keys in docs/kernels.md)
# cos.approx / sin.approx on the GPU (tl.cos is libdevice's precise cosf, ~20 instructions with a slow path for
# large angles); the interpreter runs no PTX: numpy's there
FAST_TRIG = not knobs.runtime.interpret


@triton.jit
def _cos_sin(a, FAST: tl.constexpr):
    """cos, sin of float32 angles 0 <= a < 4e5: reduced to [-pi, pi] by Cody-Waite first (2 pi = P1 + P2 + P3, k·P1
    exact), so that the hardware's approximations (abs. error < 1e-6 there) stay accurate at long contexts."""
    k = tl.floor(a * 0.15915494309189535 + 0.5)
    r = tl.fma(k, -6.28125, a)
    r = tl.fma(k, -0.0019353071693331003, r)
    r = tl.fma(k, -1.0253131677018246e-11, r)
    if FAST:
        c = tl.inline_asm_elementwise("cos.approx.f32 $0, $1;", "=r,r", [r], dtype=tl.float32, is_pure=True, pack=1)
        s = tl.inline_asm_elementwise("sin.approx.f32 $0, $1;", "=r,r", [r], dtype=tl.float32, is_pure=True, pack=1)
    else:
        c, s = tl.cos(r), tl.sin(r)
    return c, s


@triton.jit
def _codes(row, c, mask, BITS: tl.constexpr, E: tl.constexpr):
    """The BITS-bit codes of channels c in the packed rows of E codes at ``row`` (broadcast with c; ``pack_codes``'
    layout). 2 and 4 bits: channel c at bit offset BITS·c, one byte load, a shift and a mask. 3 bits: its low 2 bits
    from the 2-bit plane, bit 2 from the 1-bit plane after it (ceil(E/4) bytes in)."""
    if BITS == 3:
        lo = tl.load(row + (c >> 2), mask=mask, other=0).to(tl.int32)
        hi = tl.load(row + (E + 3) // 4 + (c >> 3), mask=mask, other=0).to(tl.int32)
        return ((lo >> ((c & 3) * 2)) & 3) | (((hi >> (c & 7)) & 1) << 2)
    off = c * BITS
    word = tl.load(row + (off >> 3), mask=mask, other=0).to(tl.int32)
    return (word >> (off & 7)) & ((1 << BITS) - 1)


@triton.jit
def _tile(ptr, mid, half, lut, oidx, oval, slot, hk, t, tmask, cols, cmask, rowoff,
          s_h, s_ms, s_mt, s_os, s_ot,
          E: tl.constexpr, FLOAT: tl.constexpr, PER_TOKEN: tl.constexpr, KSLOTS: tl.constexpr, BITS: tl.constexpr):
    """(len(t), len(cols)) float32 tile of kv head hk of slot ``slot``: tokens t, channels cols (masked: 0); the
    tokens' rows at ``rowoff`` (len(t),) elements from ptr (``_row_offsets``)."""
    mask = tmask[:, None] & cmask[None, :]
    base = ptr + rowoff[:, None] + hk * s_h
    if FLOAT:
        x = tl.load(base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    else:
        c = tl.load(lut + _codes(base, cols[None, :], mask, BITS, E))
        if PER_TOKEN:
            m = tl.load(mid + slot * s_ms + t * s_mt + hk, mask=tmask, other=0.0).to(tl.float32)
            h = tl.load(half + slot * s_ms + t * s_mt + hk, mask=tmask, other=0.0).to(tl.float32)
            x = m[:, None] + h[:, None] * c
        else:
            m = tl.load(mid + hk * E + cols, mask=cmask, other=0.0)
            h = tl.load(half + hk * E + cols, mask=cmask, other=0.0)
            x = m[None, :] + h[None, :] * c
        for j in range(KSLOTS):  # sparse outliers: flat index in hkv·e, -1 for an empty slot (not unrolled: the
            # unrolled loop's hoisted loads spilled registers at 20 slots)
            idx = tl.load(oidx + slot * s_os + t * s_ot + j, mask=tmask, other=-1).to(tl.int32) - hk * E
            val = tl.load(oval + slot * s_os + t * s_ot + j, mask=tmask, other=0.0).to(tl.float32)
            x = tl.where(idx[:, None] == cols[None, :], val[:, None], x)
    return x


@triton.jit
def _group_scores(q, s_qh, qscale, ka, kb, kp, ch, cp, GROUP: tl.constexpr, GP: tl.constexpr, E: tl.constexpr,
                  R: tl.constexpr, DOT: tl.constexpr):
    """(GP, BLOCK_T) scores (times qscale) of the kv head's query heads (q: head 0's row) against the rotated key
    parts, as tensor-core products (3xTF32: float32 accuracy). The query rows are re-read here (L1) on every tile:
    held across the loop, the padded (16, e) queries would sit in every warp's registers, twice for 3xTF32."""
    rows = (tl.arange(0, GP) < GROUP)[:, None]
    qrow = q + tl.arange(0, GP)[:, None] * s_qh
    s = tl.zeros((GP, kp.shape[0]), tl.float32)
    if R < E:
        qp = tl.load(qrow + cp[None, :], mask=rows & (cp < E)[None, :], other=0.0).to(tl.float32) * qscale
        s = tl.dot(qp, tl.trans(kp), s, input_precision=DOT)
    if R > 0:
        hm = rows & (ch < R // 2)[None, :]
        qa = tl.load(qrow + ch[None, :], mask=hm, other=0.0).to(tl.float32) * qscale
        qb = tl.load(qrow + R // 2 + ch[None, :], mask=hm, other=0.0).to(tl.float32) * qscale
        s = tl.dot(qa, tl.trans(ka), s, input_precision=DOT)
        s = tl.dot(qb, tl.trans(kb), s, input_precision=DOT)
    return s


@triton.jit
def _outlier_scores(q, s_qh, qscale, mid, half, lut, oidx, oval, slot, hk, t, tmask, inv_freq, s_ms, s_mt, s_os, s_ot,
                    GROUP: tl.constexpr, GP: tl.constexpr, E: tl.constexpr, R: tl.constexpr,
                    PER_TOKEN: tl.constexpr, KSLOTS: tl.constexpr, KP: tl.constexpr, FAST: tl.constexpr,
                    LEVELS: tl.constexpr):
    """(GP, len(t)) what the keys' sparse outliers add to the scores: Σ_j (val_j - x̂[t, c_j]) · w(c_j), w(c) the
    coefficient of key channel c in q · R_t k, over the slots j whose channel c_j lies in kv head hk. A few gathers
    a slot, where writing the outliers into the tile costs a compare and a select on every entry a slot. Assumes
    distinct indices within a token (as quantization picks them; duplicates would count twice)."""
    j = tl.arange(0, KP)
    om = tmask[:, None] & (j < KSLOTS)[None, :]
    ob = slot * s_os + t[:, None] * s_ot + j[None, :]
    c = tl.load(oidx + ob, mask=om, other=-1).to(tl.int32) - hk * E  # (len(t), KP) channel in the head
    hit = om & (c >= 0) & (c < E)
    val = tl.load(oval + ob, mask=om, other=0.0).to(tl.float32)
    out = _slot_scores(q, s_qh, mid, half, lut, c, hit, val, slot, hk, t, tmask, inv_freq, s_ms, s_mt, GROUP, GP,
                       E, R, PER_TOKEN, FAST, LEVELS)
    return out * qscale


@triton.jit
def _slot_scales(mid, half, slot, t, h, c, mask, s_ms, s_mt, E: tl.constexpr, PER_TOKEN: tl.constexpr):
    """float32 (mid, half) at sparse slots' (token, kv head h, channel c), h and c (len(t), K): per-token scales
    (s, L, hkv) of rows ``slot`` ((len(t), 1) or one) at tokens t, or per-channel ones (hkv, e)."""
    if PER_TOKEN:
        m = tl.load(mid + slot * s_ms + t[:, None] * s_mt + h, mask=mask, other=0.0).to(tl.float32)
        hf = tl.load(half + slot * s_ms + t[:, None] * s_mt + h, mask=mask, other=0.0).to(tl.float32)
    else:
        m = tl.load(mid + h * E + c, mask=mask, other=0.0)
        hf = tl.load(half + h * E + c, mask=mask, other=0.0)
    return m, hf


@triton.jit
def _slot_residual(mid, half, lut, h, c, hit, val, slot, t, s_ms, s_mt, E: tl.constexpr, PER_TOKEN: tl.constexpr,
                   LEVELS: tl.constexpr):
    """(len(t), K) float32 val - x̂ at sparse-outlier slots (kv head h, channel c: (len(t), K), or h one head) where
    hit, else 0: x̂ = mid + half · codebook[code], what the codes give there; the correction a slot adds. The code
    under an outlier is the codebook's end on val's side (``ssmq.ops.kv_quant.outlier_codes``), so it comes from
    val >= mid, not from a gather of the packed code (a random byte load a slot, most of them DRAM sectors)."""
    c = tl.where(hit, c, 0)
    m, hf = _slot_scales(mid, half, slot, t, h, c, hit, s_ms, s_mt, E, PER_TOKEN)
    x = tl.where(val >= m, tl.load(lut + LEVELS - 1), tl.load(lut))
    return tl.where(hit, val - (m + hf * x), 0.0)


@triton.jit
def _rope_terms(d, c, hit, t, inv_freq, R: tl.constexpr, FAST: tl.constexpr):
    """A key slot's residual d (len(t), K) at channel c, split by the query channels it meets in q · R_t k:
    w = q[c] · a + q[partner] · b, with (a, b) = d (cos, sin) in the first rotary half, d (cos, -sin) in the
    second, (d, 0) on pass-through channels. Returns a, b, partner and the rotary mask."""
    rot = hit & (c < R)
    low = c < R // 2
    partner = tl.where(low, c + R // 2, c - R // 2)
    freq = tl.load(inv_freq + tl.where(low, c, c - R // 2), mask=rot, other=0.0)
    cos, sin = _cos_sin(t.to(tl.float32)[:, None] * freq, FAST)
    return d * tl.where(rot, cos, 1.0), d * tl.where(rot, tl.where(low, sin, -sin), 0.0), partner, rot


@triton.jit
def _slot_scores(q, s_qh, mid, half, lut, c, hit, val, slot, hk, t, tmask, inv_freq, s_ms, s_mt,
                 GROUP: tl.constexpr, GP: tl.constexpr, E: tl.constexpr, R: tl.constexpr, PER_TOKEN: tl.constexpr,
                 FAST: tl.constexpr, LEVELS: tl.constexpr):
    """(GP, len(t)) Σ over the columns k of (val - x̂[t, c]) · w(c) where hit, for channels c (len(t), K) of kv head
    hk (unscaled by qscale)."""
    d = _slot_residual(mid, half, lut, hk, c, hit, val, slot, t, s_ms, s_mt, E, PER_TOKEN, LEVELS)
    c = tl.where(hit, c, 0)
    if R > 0:
        a, b, partner, rot = _rope_terms(d, c, hit, t, inv_freq, R, FAST)
    rows = tl.arange(0, GP)
    out = tl.zeros((GP, t.shape[0]), tl.float32)
    for g in tl.static_range(GROUP):
        qc = tl.load(q + g * s_qh + c).to(tl.float32)
        if R > 0:
            qq = tl.load(q + g * s_qh + partner, mask=rot, other=0.0).to(tl.float32)
            sg = tl.sum(qc * a + qq * b, 1)
        else:
            sg = tl.sum(qc * d, 1)
        out = tl.where(rows[:, None] == g, sg[None, :], out)
    return out


@triton.jit
def _scores(q, s_qh, qscale, ptr, mid, half, lut, oidx, oval, slot, hk, t, tmask, inv_freq,
            rowoff, s_h, s_ms, s_mt, s_os, s_ot,
            GROUP: tl.constexpr, GP: tl.constexpr, E: tl.constexpr, R: tl.constexpr, HP: tl.constexpr,
            PP: tl.constexpr, FLOAT: tl.constexpr, PER_TOKEN: tl.constexpr, KSLOTS: tl.constexpr,
            KP: tl.constexpr, FAST: tl.constexpr, DOT: tl.constexpr, BITS: tl.constexpr, LEVELS: tl.constexpr):
    """(GP, len(t)) scores (log2 units; -inf where masked) of the query group against the keys t rotated by
    their positions: R_t k = (ka cos - kb sin, kb cos + ka sin, kp) over channels [0, r/2), [r/2, r), [r, e);
    the tiles without the outliers, which ``_outlier_scores`` adds."""
    ch = tl.arange(0, HP)
    cp = R + tl.arange(0, PP)
    if R < E:
        kp = _tile(ptr, mid, half, lut, oidx, oval, slot, hk, t, tmask, cp, cp < E, rowoff, s_h, s_ms, s_mt,
                   s_os, s_ot, E, FLOAT, PER_TOKEN, 0, BITS)
    if R > 0:
        hm = ch < R // 2
        ka = _tile(ptr, mid, half, lut, oidx, oval, slot, hk, t, tmask, ch, hm, rowoff, s_h, s_ms, s_mt,
                   s_os, s_ot, E, FLOAT, PER_TOKEN, 0, BITS)
        kb = _tile(ptr, mid, half, lut, oidx, oval, slot, hk, t, tmask, ch + R // 2, hm, rowoff, s_h, s_ms,
                   s_mt, s_os, s_ot, E, FLOAT, PER_TOKEN, 0, BITS)
        freq = tl.load(inv_freq + ch, mask=hm, other=0.0)
        cos, sin = _cos_sin(t.to(tl.float32)[:, None] * freq[None, :], FAST)  # the reference's float32 angles
        if R == E:
            kp = ka  # unused: no channels beyond the rotary ones
        s = _group_scores(q, s_qh, qscale, ka * cos - kb * sin, kb * cos + ka * sin, kp, ch, cp, GROUP, GP, E, R,
                          DOT)
    else:
        s = _group_scores(q, s_qh, qscale, kp, kp, kp, ch, cp, GROUP, GP, E, R, DOT)
    if KSLOTS > 0:
        s += _outlier_scores(q, s_qh, qscale, mid, half, lut, oidx, oval, slot, hk, t, tmask, inv_freq, s_ms, s_mt,
                             s_os, s_ot, GROUP, GP, E, R, PER_TOKEN, KSLOTS, KP, FAST, LEVELS)
    return tl.where(tmask[None, :], s, float("-inf"))


@triton.jit
def _softmax_step(m, l, acc, s, v, DOT: tl.constexpr):
    """Online softmax: fold scores s (GP, n) and values v (n, e) into the running (m, l, acc)."""
    m_new = tl.maximum(m, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # all masked so far: no NaN from -inf - -inf
    p = tl.exp2(s - m_ref[:, None])
    alpha = tl.exp2(m - m_ref)
    return m_new, l * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT)


@triton.jit
def _split_chunk(n, splits, BLOCK_T: tl.constexpr):
    """Tokens a split of a row of length n covers (whole tiles; the last split fewer): token t is in split t // it."""
    return tl.cdiv(tl.cdiv(n, splits), BLOCK_T) * BLOCK_T


@triton.jit
def _split_range(slots, lens, splits, BLOCK_T: tl.constexpr):
    """This program's (row i, kv head hk, split sp), the row's slot and length n, and the split's tokens [lo, hi):
    the row's tokens divided among the splits in whole tiles, on the GPU (no host read of the lengths)."""
    i, hk, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(slots + i).to(tl.int64)
    n = tl.load(lens + i).to(tl.int32)
    chunk = _split_chunk(n, splits, BLOCK_T)
    lo = sp * chunk
    return i, hk, sp, slot, n, lo, tl.minimum(lo + chunk, n)


@triton.jit
def _store_split(out, ws, i, hk, sp, rows, rmask, e, m, l, acc, s_ob, s_oh, w_b, w_h, w_p, w_e,
                 GROUP: tl.constexpr, E: tl.constexpr, ONE_SPLIT: tl.constexpr):
    """The output of the kv head's query heads: acc / l (one split), or this split's (m, l, acc) for
    ``_combine_kernel`` in ws (b, hq, P, e + 2) (strides w_*; ``_launch`` lays the heads innermost), m and l after
    acc."""
    heads = hk * GROUP + rows
    if ONE_SPLIT:
        tl.store(out + i * s_ob + heads[:, None] * s_oh + e[None, :], acc / l[:, None], mask=rmask[:, None])
    else:
        dst = ws + i * w_b + heads * w_h + sp * w_p
        tl.store(dst[:, None] + e[None, :] * w_e, acc, mask=rmask[:, None])
        tl.store(dst + E * w_e, m, mask=rmask)
        tl.store(dst + (E + 1) * w_e, l, mask=rmask)


@triton.jit
def _page(table, s_tab, slot, t, tmask, BS: tl.constexpr):
    """Where tokens t (T,) of cache row ``slot`` sit in a per-token buffer (s, L, ...): (slot, t) as (T,) vectors;
    or in a paged cache (BS > 0: a pool (blocks, BS, ...) and a block table (slots, M)) (block, t mod BS), block =
    table[slot, t // BS]. A buffer's offsets are then first·s_0 + second·s_1."""
    if BS > 0:
        return tl.load(table + slot * s_tab + t // BS, mask=tmask, other=0).to(tl.int64), t % BS
    return slot + t * 0, t


@triton.jit
def _row_offsets(table, s_tab, slot, t, tmask, s_s, s_t, BS: tl.constexpr):
    """(len(t),) int64 element offsets of tokens t of a row in cache slot ``slot`` (``_page``)."""
    pb, pt = _page(table, s_tab, slot, t, tmask, BS)
    return pb.to(tl.int64) * s_s + pt.to(tl.int64) * s_t


def paging(block_table: torch.Tensor | None, slots: torch.Tensor, pool: torch.Tensor) -> tuple[tuple, int, int]:
    """A launch's view of a cache whose per-token buffers look like ``pool`` ((s, L, ...) rows or (N, B, ...) block
    pools with ``block_table`` (s, M)): the kernels' (table, s_tab) arguments (the rows' slots and 0 in their place
    when not paged), BS (tokens a block; 0: not paged) and a row's capacity in tokens."""
    if block_table is None:
        return (slots, 0), 0, pool.shape[1]
    return (block_table, block_table.stride(0)), pool.shape[1], block_table.shape[1] * pool.shape[1]


@triton.jit
def _decode_kernel(q, slots, lens, inv_freq, out, ws, table, s_tab,
                   kc, kmid, khalf, klut, koi, kov, ksink, vc, vmid, vhalf, vlut, voi, vov, vsink,
                   s_qb, s_qh, k_s, k_t, k_h, k_ms, k_mt, k_os, k_ot, v_s, v_t, v_h, v_ms, v_mt, v_os, v_ot,
                   ks_s, ks_t, ks_h, vs_s, vs_t, vs_h, s_ob, s_oh, w_b, w_h, w_p, w_e, splits, scale,
                   GROUP: tl.constexpr, GP: tl.constexpr, E: tl.constexpr, R: tl.constexpr, HP: tl.constexpr,
                   PP: tl.constexpr, S: tl.constexpr, SP: tl.constexpr, FLOAT: tl.constexpr,
                   K_PER_TOKEN: tl.constexpr, V_PER_TOKEN: tl.constexpr, KSLOTS: tl.constexpr, KP: tl.constexpr,
                   VSLOTS: tl.constexpr, BLOCK_T: tl.constexpr, ONE_SPLIT: tl.constexpr, FAST: tl.constexpr,
                   DOT: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr, KLEVELS: tl.constexpr,
                   VLEVELS: tl.constexpr, BS: tl.constexpr):
    """BS > 0: a paged float cache, the slots' blocks in ``table`` (slots, M) (``_row_offsets``); else slots index
    the cache's rows. The sinks are never paged."""
    i, hk, sp, slot, n, lo, hi = _split_range(slots, lens, splits, BLOCK_T)

    rows = tl.arange(0, GP)  # the kv head's query heads, padded (the values' product needs >= 16 rows)
    rmask = rows < GROUP
    qg = q + i * s_qb + hk * GROUP * s_qh  # the group's first query head
    qscale = scale * 1.4426950408889634  # scores in log2 units: exp2 in the softmax

    m = tl.full((GP,), float("-inf"), tl.float32)
    l = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((GP, E), tl.float32)
    e = tl.arange(0, E)
    if S > 0:
        if sp == 0:  # the sink tokens' keys and values are kept in float: positions [0, S)
            t = tl.arange(0, SP)
            tmask = t < tl.minimum(n, S)
            s = _scores(qg, s_qh, qscale, ksink, kmid, khalf, klut, koi, kov, slot, hk, t, tmask, inv_freq,
                        _row_offsets(table, s_tab, slot, t, tmask, ks_s, ks_t, 0), ks_h, 0, 0, 0, 0, GROUP, GP, E,
                        R, HP, PP, True, K_PER_TOKEN, 0, KP, FAST, DOT, KBITS, KLEVELS)
            v = _tile(vsink, vmid, vhalf, vlut, voi, vov, slot, hk, t, tmask, e, e < E,
                      _row_offsets(table, s_tab, slot, t, tmask, vs_s, vs_t, 0), vs_h, 0, 0, 0, 0, E, True,
                      V_PER_TOKEN, 0, VBITS)
            m, l, acc = _softmax_step(m, l, acc, s, v, DOT)
    for start in range(lo, hi, BLOCK_T):
        t = start + tl.arange(0, BLOCK_T)
        tmask = (t < hi) & (t >= S)
        s = _scores(qg, s_qh, qscale, kc, kmid, khalf, klut, koi, kov, slot, hk, t, tmask, inv_freq,
                    _row_offsets(table, s_tab, slot, t, tmask, k_s, k_t, BS), k_h, k_ms, k_mt, k_os, k_ot, GROUP,
                    GP, E, R, HP, PP, FLOAT, K_PER_TOKEN, KSLOTS, KP, FAST, DOT, KBITS, KLEVELS)
        v = _tile(vc, vmid, vhalf, vlut, voi, vov, slot, hk, t, tmask, e, e < E,
                  _row_offsets(table, s_tab, slot, t, tmask, v_s, v_t, BS), v_h, v_ms, v_mt, v_os, v_ot, E, FLOAT,
                  V_PER_TOKEN, VSLOTS, VBITS)
        m, l, acc = _softmax_step(m, l, acc, s, v, DOT)
    _store_split(out, ws, i, hk, sp, rows, rmask, e, m, l, acc, s_ob, s_oh, w_b, w_h, w_p, w_e, GROUP, E, ONE_SPLIT)


@triton.jit
def _combine_kernel(ws, out, splits, hq, w_b, w_h, w_p, w_e, s_ob, s_oh, E: tl.constexpr, PS: tl.constexpr,
                    HB: tl.constexpr, EB: tl.constexpr, PC: tl.constexpr):
    """out[i, h] = Σ_p 2^(m_p - M) acc_p / Σ_p 2^(m_p - M) l_p over the P splits of (row i, query head h). A program
    per (row, HB heads, EB channels): ws holds the heads innermost (``_launch``), so a program reads whole segments
    of them; the splits' outputs PC at a time. H100, 66 splits, 32 heads: a program per (row, head) reading channels
    hq apart 0.010 ms (0.003 with the heads outermost); a (P, e, HB) tile a program 0.24 (spilled); a program per
    (row, HB heads) looping over the splits 0.03 (8 programs)."""
    i = tl.program_id(0)
    h = tl.program_id(1) * HB + tl.arange(0, HB)[None, :]  # (1, HB)
    p = tl.arange(0, PS)[:, None]  # (PS, 1)
    pm = (p < splits) & (h < hq)
    src = ws + i * w_b + h * w_h
    m = tl.load(src + p * w_p + E * w_e, mask=pm, other=float("-inf"))
    l = tl.load(src + p * w_p + (E + 1) * w_e, mask=pm, other=0.0)
    top = tl.max(m, 0)
    top = tl.where(top == float("-inf"), 0.0, top)[None, :]  # heads past hq: no NaN from -inf - -inf
    den = tl.sum(tl.exp2(m - top) * l, 0)  # empty splits: m = -inf, weight 0
    e = tl.program_id(2) * EB + tl.arange(0, EB)
    acc = tl.zeros((EB, HB), tl.float32)
    for p0 in range(0, splits, PC):
        pc = p0 + tl.arange(0, PC)[:, None]  # (PC, 1)
        cm = (pc < splits) & (h < hq)
        w = tl.exp2(tl.load(src + pc * w_p + E * w_e, mask=cm, other=float("-inf")) - top)
        part = tl.load((src + pc * w_p)[:, None, :] + e[None, :, None] * w_e, mask=cm[:, None, :], other=0.0)
        acc += tl.sum(w[:, None, :] * part, 0)  # (EB, HB)
    tl.store(out + i * s_ob + h * s_oh + e[:, None], acc / tl.where(h < hq, den, 1.0), mask=h < hq)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def default_splits(b: int, hkv: int, capacity: int, device: torch.device, block_t: int, cfg: dict | None = None,
                   resident: int = 0) -> int:
    """Splits a row's tokens get: WAVES programs an SM over b·hkv·P, at most one per MIN_TILES tiles of the
    cache's capacity (the rows' lengths stay on the GPU: they divide into the splits there); ``cfg``: the launch
    settings holding WAVES and MIN_TILES (default this kernel's). ``resident``: programs of the kernel an SM holds at
    once; given, P is moved to whole rounds of them (``whole_rounds``)."""
    cfg = cfg or CFG
    fill = cdiv(cfg["WAVES"] * _sm_count(device), b * hkv)
    if resident:
        fill = whole_rounds(fill, b * hkv, resident * _sm_count(device))
    return max(1, min(fill, cdiv(capacity, block_t * cfg["MIN_TILES"])))


@functools.lru_cache(maxsize=None)  # every decode launch asks: 0.26 ms a call uncached (8 kv heads, batch 1)
def whole_rounds(fill: int, pairs: int, slots: int, most: int | None = None) -> int:
    """The split count P in [fill / 2, ``most``] (default 2 fill) whose pairs · P programs leave the least of their
    last round of ``slots`` resident programs idle (ties: the nearest to fill, then the fewer). A latency-bound
    decode takes a round's time whether the round is full or not: b = 8 rows × 8 kv heads at 2 programs an SM of 132
    made 9 splits, 576 programs, 2.2 rounds run as 3; 8 splits are 512, 1.94 rounds run as 2 (H200:
    twice the splits, 4.1 rounds in 5, were already 15% faster than 9, ``s30_occupancy_sweep_b8.log``)."""
    def key(p):
        rounds = -(-pairs * p // slots)
        return Fraction(rounds * slots, pairs * p), abs(p - fill), p
    return min(range(max(1, fill // 2), (most or 2 * fill) + 1), key=key)


def resident_programs(regs: int, warps: int) -> int:
    """Programs of ``warps`` warps an SM holds at ``regs`` registers a thread (its 64K registers the limit: the
    decode kernels' shared memory, < 40 KB a program, is not)."""
    return 65536 // (regs * 32 * warps)


def _side(v: KVSideView):
    """Pointers and strides of one quantized side, in _decode_kernel's order."""
    c, m, o = v.codes, v.mid, v.out_idx
    ms = (m.stride(0), m.stride(1)) if v.per_token else (0, 0)
    book = v.codebook if v.codebook.dtype == torch.float32 and v.codebook.is_contiguous() else v.codebook.float()
    return (c, m, v.half, book.contiguous(), o, v.out_val), (c.stride(0), c.stride(1), c.stride(2), *ms,
                                                          o.stride(0), o.stride(1))


def constexprs(group: int, e: int, rotary_dim: int, sink: int, flags: dict, block_t: int, one_split: bool) -> dict:
    """_decode_kernel's constexprs for a launch."""
    return dict(GROUP=group, GP=max(16, next_pow2(group)), E=e, R=rotary_dim,
                HP=max(16, next_pow2(rotary_dim // 2)), PP=max(16, next_pow2(e - rotary_dim)),
                S=sink, SP=max(16, next_pow2(sink)), KP=next_pow2(max(flags["KSLOTS"], 1)),
                BLOCK_T=block_t, ONE_SPLIT=one_split, FAST=FAST_TRIG, DOT=CFG["dot"], **flags)


def _launch(q, slots, kv_lens, kt, ks, vt, vs, sinks, flags, rotary_dim, theta, softmax_scale, splits,
            kernel=None, cfg=None, const=None, extra=(), before_combine=None, block_table=None):
    """Runs a decode kernel (and _combine_kernel over several splits): q (b, hq, e) → (b, hq, e) float32.
    ``kernel``, its launch settings ``cfg`` and its constexpr builder ``const``: this module's by default, or
    ``kv_decode_fast``'s (the same arguments, the same split / combine scheme, and the ``extra`` ones after ws).
    ``before_combine(ws, splits)``: run between the two (it may add to the splits' outputs in ws); it takes at least
    two splits. ``cfg`` may also set MAXNREG and MAXNREG_OUTLIERS (register caps of quantized caches' launches:
    programs an SM follow, ``resident_programs``, and the splits take whole rounds of them, ``default_splits``),
    RESIDENT (programs an SM without a cap) and, for sweeps (``bench_kvquant.py --sweep``), WARPS_OUTLIERS and
    STAGES_OUTLIERS. ``block_table`` (slots, M): kt / vt are block pools (N, B, hkv, e)
    (this module's kernel: float caches; ``kv_decode_fast``'s: any)."""
    b, hq, e = q.shape
    codes = kt[0]
    pages, bs, capacity = paging(block_table, slots, codes)
    hkv = codes.shape[2]
    extra = (*pages, *extra)  # both kernels take a block table (a paged cache), or the rows' slots in its place
    kernel, cfg, const = kernel or _decode_kernel, cfg or CFG, const or constexprs
    assert e & (e - 1) == 0 and q.stride(-1) == 1, "head dim a power of two, contiguous"
    assert rotary_dim % 2 == 0 and rotary_dim <= e
    outliers = flags["KSLOTS"] or flags["VSLOTS"]
    block_t = cfg["BLOCK_T_OUTLIERS"] if outliers else cfg["BLOCK_T"]
    warps = cfg.get("WARPS_OUTLIERS", cfg["num_warps"]) if outliers else cfg["num_warps"]
    stages = cfg.get("STAGES_OUTLIERS", cfg["num_stages"]) if outliers else cfg["num_stages"]
    if flags["FLOAT"]:  # bound by bytes, not rounds; the float path keeps its own registers
        regs, resident = None, 0
    else:  # a register cap: more programs an SM (they follow from it), perhaps spills
        regs = cfg.get("MAXNREG_OUTLIERS", cfg.get("MAXNREG")) if outliers else cfg.get("MAXNREG")
        resident = resident_programs(regs, warps) if regs else cfg.get("RESIDENT", 0)
    cap = {"maxnreg": regs} if regs else {}
    splits = splits or default_splits(b, hkv, capacity, q.device, block_t, cfg, resident)
    splits = max(splits, 2) if before_combine else splits
    scale = e ** -0.5 if softmax_scale is None else softmax_scale
    inv_freq = _inv_freq(max(rotary_dim, 2), theta, q.device)
    out, ws = split_outputs(b, hq, e, splits, q.device)
    ksink, vsink = sinks
    kernel[(b, hkv, splits)](
        q, slots, kv_lens, inv_freq, out, ws, *extra, *kt, ksink, *vt, vsink, q.stride(0), q.stride(1), *ks, *vs,
        ksink.stride(0), ksink.stride(1), ksink.stride(2), vsink.stride(0), vsink.stride(1), vsink.stride(2),
        out.stride(0), out.stride(1), ws.stride(0), ws.stride(1), ws.stride(2), ws.stride(3), splits, scale,
        num_warps=warps, num_stages=stages, **cap,
        **const(hq // hkv, e, rotary_dim, ksink.shape[1], flags, block_t, splits == 1), BS=bs)
    if before_combine:
        before_combine(ws, splits)
    return combine_splits(out, ws, splits)


def split_outputs(b: int, hq: int, e: int, splits: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (b, hq, e) float32, ws): the splits' (acc, m, l) for ``combine_splits``, (b, hq, P, e + 2) with the heads
    innermost in memory (a value slot adds to its kv head's query heads at once: one vector atomic in
    kv_decode_fast's value pass); one split writes out itself (ws a view of it)."""
    out = torch.empty(b, hq, e, dtype=torch.float32, device=device)
    ws = (torch.empty(b, splits, e + 2, hq, dtype=torch.float32, device=device).permute(0, 3, 1, 2) if splits > 1
          else out[..., None])
    return out, ws


def combine_tiling(b: int, hq: int, e: int, splits: int, device: torch.device) -> tuple[int, int, int]:
    """(HB heads, EB channels, PC splits) a ``_combine_kernel`` program and loop step takes. Each program's loop over
    the splits is latency-bound, so a grid of few programs (one row, few heads: SmolLM2's 9 at head dim 64, 528
    splits, 12 programs) takes narrower channel blocks, down to 4, for at least two programs an SM, and every
    program steps over as many splits as a 2048-element tile holds (a step's loads in flight together)."""
    hb = min(4, next_pow2(hq))
    eb = min(16, e)
    while eb > 4 and b * cdiv(hq, hb) * (e // eb) < 2 * _sm_count(device):
        eb //= 2
    return hb, eb, min(next_pow2(splits), 2048 // (hb * eb))


def combine_splits(out: torch.Tensor, ws: torch.Tensor, splits: int, tiling: tuple[int, int, int] | None = None
                   ) -> torch.Tensor:
    """out from the splits' outputs in ws (``_combine_kernel``; nothing to do for one split); ``tiling`` overrides
    ``combine_tiling`` (the sweep)."""
    b, hq, e = out.shape
    if splits > 1:
        hb, eb, pc = tiling or combine_tiling(b, hq, e, splits, out.device)
        _combine_kernel[(b, cdiv(hq, hb), e // eb)](ws, out, splits, hq, *ws.stride(), out.stride(0),
                                                           out.stride(1), E=e, PS=next_pow2(splits),
                                                           HB=hb, EB=eb, PC=pc)
    return out


def quant_args(k: KVSideView, v: KVSideView):
    """(kt, ks, vt, vs, sinks, flags): the pointers, strides, sinks and flags of a quantized cache's two sides, as
    ``_launch`` takes them (checked)."""
    kt, ks = _side(k)
    vt, vs = _side(v)
    assert k.sink.shape[1] == v.sink.shape[1] and k.sink.stride(-1) == 1 and v.sink.stride(-1) == 1
    assert k.bits in (2, 3, 4) and v.bits in (2, 3, 4), "codes of 2, 3 or 4 bits"
    flags = dict(FLOAT=False, K_PER_TOKEN=k.per_token, V_PER_TOKEN=v.per_token, KSLOTS=k.out_idx.shape[-1],
                 VSLOTS=v.out_idx.shape[-1], KBITS=k.bits, VBITS=v.bits, KLEVELS=k.codebook.numel(),
                 VLEVELS=v.codebook.numel())
    return kt, ks, vt, vs, (k.sink, v.sink), flags


def quant_kv_decode(q: torch.Tensor, slots: torch.Tensor, kv_lens: torch.Tensor, k: KVSideView, v: KVSideView,
                    rotary_dim: int = 0, theta: float = 10000.0, softmax_scale: float | None = None,
                    splits: int | None = None) -> torch.Tensor:
    """``quant_kv_decode_ref`` on the GPU: q (b, hq, e) → (b, hq, e) float32. slots, kv_lens (b,) stay on the
    GPU (no host sync); ``splits`` overrides ``default_splits``."""
    return _launch(q, slots, kv_lens, *quant_args(k, v), rotary_dim, theta, softmax_scale, splits)


def float_args(k_cache: torch.Tensor, v_cache: torch.Tensor):
    """A float cache as the decode kernels' sides (``quant_args``' form): no codebook, scales, outliers or sink (their
    pointers are never read)."""
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    none = k_cache.new_empty(1, 0, 1, 1)
    kt = (k_cache, k_cache, k_cache, k_cache, k_cache, k_cache)
    vt = (v_cache, v_cache, v_cache, v_cache, v_cache, v_cache)
    ks = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), 0, 0, 0, 0)
    vs = (v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), 0, 0, 0, 0)
    flags = dict(FLOAT=True, K_PER_TOKEN=False, V_PER_TOKEN=False, KSLOTS=0, VSLOTS=0, KBITS=8, VBITS=8, KLEVELS=1,
                 VLEVELS=1)
    return kt, ks, vt, vs, (none, none), flags


def float_kv_decode(q: torch.Tensor, slots: torch.Tensor, kv_lens: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, softmax_scale: float | None = None,
                    splits: int | None = None, block_table: torch.Tensor | None = None) -> torch.Tensor:
    """The same kernel over a float cache: ``attention_ref(q[:, None], k_cache[slots], v_cache[slots], kv_lens)``
    for k_cache, v_cache (s, L, hkv, e) (keys post-RoPE; channels contiguous), q (b, hq, e) → (b, hq, e) float32.
    With ``block_table`` (s, M) the caches are block pools (N, B, hkv, e) (``ssmq.models.paged_kv``): token t of
    row i at block block_table[slots[i], t // B], offset t % B, read in place (no copy of the rows' prefix)."""
    kt, ks, vt, vs, sinks, flags = float_args(k_cache, v_cache)
    return _launch(q, slots, kv_lens, kt, ks, vt, vs, sinks, flags, 0, 10000.0, softmax_scale, splits,
                   block_table=block_table)
