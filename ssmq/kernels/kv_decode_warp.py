"""The KVQuant decode as one warp a program, every tensor-core operand built in registers (Gluon; 4-, 3-
and 2-bit codes, cp.async rings): no operand passes through shared memory, which
the Triton kernels (``kv_decode_fast``) could not avoid (there each dequantized tile passed through shared memory to
become an operand: 6 trips and 11-13 barriers a 32-token tile, the profile's top stall). Shared memory holds only
the codes in flight: each tile's bytes arrive by cp.async STAGES - 1 tiles ahead and each lane reads its own once.

Glossary: b rows, hq query heads, hkv kv heads, g = hq / hkv (GROUP), e head dim (EH: 128 or 64), HEADS = 128 / e
kv heads a program, whose channels side by side are the E = 128 channels of the products (the columns: their
HEADS · g query heads, padded to N = 8), r rotary dim (0, 32, 64 or 128, at most e), HP = 64 slots a rotary half,
S sink tokens, T = 16 tokens a tile, P splits of a row, q (lane % 4) and g8 (lane // 4) a lane's place in the 8 x 4
grid of an m16n8k16 fragment, LW int32 words from one row's length to the next (2: an int64 tensor read in place).

Head dim 64, partial RoPE: the E channels are 8 chunks of 16, in the cache's byte order
(the HEADS kv heads one after the other); a lane's bytes a token are always one chunk. The two rotary halves are
the chunks whose bit HBIT is 0 / 1 (``ring_channel``; HBIT = log2(r / 32), or log2(e / 32) without RoPE): chunk
pairs 16 · 2^HBIT = r / 2 channels apart, each in one head, so channel c < r / 2 meets its partner c + r / 2; the
channels RoPE leaves pair among themselves at angle 0. A column's query is zero on the other head's channels, and a
value row is stored only for its own head's columns: the products' cross terms are computed and dropped (SmolLM2's
3 kv heads make two programs, the second with one head live).

One warp per (row, HEADS kv heads, split), tiles of T tokens, mma.sync m16n8k16 products with float32 accumulation:
    scores   Sᵀ (T, N) = K_rot (T, HP) · U_aᵀ + K_rot_b · U_bᵀ: keys are the A operand (rows = tokens), the query group
             the B operand, rotated back by the tile's t0 θ (U = R(t0 θ)ᵀ q, a float16 table of cos / sin of t0 θ
             read a tile, ``tile_angles``); keys x = mid + half · B (per-channel scales), turned by their
             within-tile angles j θ (a table in registers), in float16 multiply-adds
    values   Oᵀ (e, N) += V_Bᵀ (e, T) · (p ⊙ h)ᵀ: the value codes B are the A operand (rows = channels), the
             probabilities times the per-token halves the B operand; Σ p · mid is added at the end (as
             ``kv_decode_fast``)
    layouts  a thread's A fragment holds 2 tokens x 16 channels (keys) or 16 channels x 4 tokens (values). The
             products' K (key channels) and M (value channels) orders are permuted so that these are the
             channels of a lane's contiguous bytes of codes a token, one chunk (8 at 4 bits; 4 of the 2-bit
             plane, and 2 of the 1-bit plane at 3 bits), which the PRMT lookups (``kv_decode_fast._LUT4`` /
             ``_LUT3`` / ``_LUT2``) turn into the fragment's registers in place: key slot k of half h holds
             channel ``ring_channel(key_channel(k, bits), h, HBIT)``, value row m channel ``value_channel(m)``;
             the query and the tables are loaded in slot order, the output stored by channel
    sink     split 0 first takes the S float sink tokens as one tile (keys rotated by their own positions)
    outliers the sparse slots keep ``kv_decode_fast``'s own passes (``outlier_passes``): their key terms are added to
             the scores from the buffer sc, the scores left there for the value pass before the combine
Each split writes (m, l, acc) for ``kv_decode.combine_splits`` (one split: the output).

Served (``eligible``): 2-, 3- or 4-bit codes on each side (codebooks of 2^bits entries), per-channel keys,
per-token values, head dim 128 (query groups of at most 8) or 64 (at most 4), RoPE on 0, 32, 64 or 128 channels,
sparse outliers or none, a sink of at most 16 tokens, contiguous or paged caches with blocks of whole tiles. The
other formats keep ``kv_decode_fast``. Needs Triton's Gluon (3.5+) and an NVIDIA GPU of sm_80+ (mma.sync).

Accuracy: as ``kv_decode_fast`` (float16 operands, float32 accumulation); the query's rotation by t0 θ is in float16
(the angles' table rounded to float16: 2^-11 relative), the keys' within-tile rotation too: within 3e-3 of
``quant_kv_decode_ref`` at unit-scale data (the tests' bound).
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from ssmq.errors import SSMQError
from ssmq.kernels._common import cdiv, int32_words
from ssmq.kernels.dispatch import QUANT_KV_DECODE, quant_kv_view_launch, serves
from ssmq.kernels.kv_decode import (_sm_count, combine_splits, paging, resident_programs, split_outputs,
                                    whole_rounds)
from ssmq.kernels.kv_decode_fast import (_LUT2, _LUT2_CONSTRAINTS, _LUT3, _LUT3_CONSTRAINTS, _LUT4, _LUT4_CONSTRAINTS,
                                         outlier_passes)
from ssmq.ops.kv_quant import KVSideView

# Names that changed after the GPU machine's Triton 3.6 (this machine's 3.9 has the new ones): cp.async from global to
# shared memory (``async_load``, was ``async_copy_global_to_shared``) and the CTA barrier (``barrier``, was
# ``thread_barrier``)
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
TILE = 16  # tokens a tile: the m16 rows of the key product, the k16 of the value product
T = gl.constexpr(TILE)
E_SERVED = 128
# The layouts of the codes' bytes as loaded, for E_SERVED channels (one warp). Keys (a rotary half, tokens g8 and
# g8 + 8 a lane): KB4 8 bytes a lane (4 bits), KB2 4 bytes of the 2-bit plane, KB1 2 bytes of the 1-bit plane.
# Values (tokens 2q, 2q + 1, 2q + 8, 2q + 9 a lane): loaded bytes innermost (VB4: bytes 8 g8 .. 8 g8 + 7; VB2: 4 g8 ..
# 4 g8 + 3 of the 2-bit plane; VB1: 2 g8, 2 g8 + 1 of the 1-bit plane), then regrouped a token pair innermost for
# the lookups (_PAIRS: a lookup's float16 pair is then two tokens of one channel, a register of the A fragment)
KB4 = gl.constexpr(gl.BlockedLayout([1, 8], [8, 4], [1, 1], [1, 0]))
KB2 = gl.constexpr(gl.BlockedLayout([1, 4], [8, 4], [1, 1], [1, 0]))
KB1 = gl.constexpr(gl.BlockedLayout([1, 2], [8, 4], [1, 1], [1, 0]))
_LANES4 = [[2, 0], [4, 0], [0, 8], [0, 16], [0, 32]]
_LANES2 = [[2, 0], [4, 0], [0, 4], [0, 8], [0, 16]]
VB4 = gl.constexpr(gl.DistributedLinearLayout([[0, 1], [0, 2], [0, 4], [1, 0], [8, 0]], _LANES4, [], [],
                                              [TILE, E_SERVED // 2]))
VB4_PAIRS = gl.constexpr(gl.DistributedLinearLayout([[1, 0], [0, 1], [0, 2], [0, 4], [8, 0]], _LANES4, [], [],
                                                    [TILE, E_SERVED // 2]))
VB2 = gl.constexpr(gl.DistributedLinearLayout([[0, 1], [0, 2], [1, 0], [8, 0]], _LANES2, [], [],
                                              [TILE, E_SERVED // 4]))
VB2_PAIRS = gl.constexpr(gl.DistributedLinearLayout([[1, 0], [0, 1], [0, 2], [8, 0]], _LANES2, [], [],
                                                    [TILE, E_SERVED // 4]))
VB1 = gl.constexpr(gl.DistributedLinearLayout([[0, 1], [1, 0], [8, 0]], [[2, 0], [4, 0], [0, 2], [0, 4], [0, 8]], [],
                                              [], [TILE, E_SERVED // 8]))
# Programs an SM: 1-warp programs of ~230 registers (H200, Triton 3.6: 230 registers, 8 resident a SM;
# 212-224 in the sm_90 build since the cp.async rings, 9 could reside, but neither a cap nor 9 was faster:
# 2-bit capped at 168, three interleaved rounds: 6% faster at
# 1 x 128K tokens, 2% at 8 x 32K, 14% slower at 1 x 16K; not adopted, a cap by context would be a second build);
# the split count fills whole rounds of them (``kv_decode.whole_rounds``): at 8 rows x 8 kv heads x 128K tokens,
# 17 splits (1088 programs, 1.03 rounds run as 2) took 1.42 ms, 33 (2112, two full rounds) 0.88
RESIDENT = 8
MAXNREG = None  # a register cap a thread for the launch (None: the compiler's choice); RESIDENT then follows it
ROUNDS = 1  # rounds of resident programs a launch fills at least
MIN_TILES = 2  # a split covers at least this many tiles of the cache's capacity
STAGES = 3  # tiles of codes a program has in flight (cp.async), at least 2 (H200: 3 and 4 alike, 2 a little slower)
WIDEST = 8  # splits default_splits may take to fill the last round at large batch


@gluon.jit
def key_channel(k, BITS: gl.constexpr):
    """Channel of key slot k of a rotary half (64 slots), chosen so that lane q's bytes of a token are its own
    fragment's K slots and each lookup's float16 pair one fragment register. 4 bits: slot 32w + 16n + 8p + 2q + e
    holds channel 16q + 8w + 4p + 2e + n (byte 8q + 4w + 2p + e of the half, nibble n: the lookup pairs nibble n of
    two adjacent bytes). 2 and 3 bits: slot 16i + 8h + 2q + e holds channel 16q + 8h + 4e + i (byte 4q + 2h + e of
    the 2-bit plane, code i: the lookup pairs code i of two adjacent bytes; the 1-bit plane follows the 2-bit one).
    Plain arithmetic: ``key_channel.fn`` runs on torch tensors (the host tables)."""
    if BITS == 4:
        return 16 * ((k // 2) % 4) + 8 * (k // 32) + 4 * ((k // 8) % 2) + 2 * (k % 2) + (k // 16) % 2
    else:
        return 16 * ((k // 2) % 4) + 8 * ((k // 8) % 2) + 4 * (k % 2) + k // 16


@gluon.jit
def value_channel(m):
    """Channel of value row m (128 rows): row 16u + 8h + g8 holds channel 16 g8 + 2u + h, so that lane g8's bytes of
    a token (its 16 channels: 4 bits, byte 8 g8 + u, nibble h; 2 and 3 bits, byte 4 g8 + u // 2 of the 2-bit plane,
    code 2 (u % 2) + h) are its fragment's 16 rows, at every width (a lookup pairs two tokens of one channel)."""
    return 16 * (m % 8) + 2 * (m // 16) + (m // 8) % 2


@gluon.jit
def ring_channel(c, HALF: gl.constexpr, HBIT: gl.constexpr):
    """Channel among the E of the program's kv heads (byte order) of channel c of rotary half HALF: chunk c // 16 of
    the half with bit HALF inserted at HBIT (the module docstring). Plain arithmetic, as ``key_channel``."""
    q = c // 16
    lo = q % (1 << HBIT)
    return 16 * ((q - lo) * 2 + HALF * (1 << HBIT) + lo) + c % 16


@gluon.jit
def _cos_sin(a):
    """cos, sin of float32 angles: the Gluon twin of ``kv_decode._cos_sin`` (its Cody-Waite reduction and the
    hardware's approximations; a Gluon kernel calls Gluon functions only)."""
    k = gl.floor(a * 0.15915494309189535 + 0.5)
    r = gl.fma(k, -6.28125, a)
    r = gl.fma(k, -0.0019353071693331003, r)
    r = gl.fma(k, -1.0253131677018246e-11, r)
    c = gl.inline_asm_elementwise("cos.approx.f32 $0, $1;", "=r,r", [r], dtype=gl.float32, is_pure=True, pack=1)
    s = gl.inline_asm_elementwise("sin.approx.f32 $0, $1;", "=r,r", [r], dtype=gl.float32, is_pure=True, pack=1)
    return c, s


@gluon.jit
def _word(x, grp, k):
    return gl.sum(gl.where(grp == k, x, 0), 0)


@gluon.jit
def _lut_words(lut, LEVELS: gl.constexpr):
    """The codebook (float32, LEVELS = 16, 8 or 4 entries) as the lookups' 8 table words, once a program: 16 and 8
    entries as ``_LUT4`` / ``_LUT3`` read them (low bytes of entries 4k .. 4k + 3, then their high bytes; 8 entries
    fill words 0, 1, 4, 5), 4 entries as ``_LUT2``'s float16 pairs (entries (0, 1), (2, 3); the other words 0)."""
    L: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    i = gl.arange(0, 16, layout=L)
    e = gl.load(lut + i, mask=i < LEVELS, other=0.0).to(gl.float16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
    if LEVELS == 4:
        x = e << (i % 2) * 16
        grp = i // 2
        z = _word(x, grp, 8)
        return _word(x, grp, 0), _word(x, grp, 1), z, z, z, z, z, z
    else:
        sh = (i % 4) * 8
        lo = (e & 0xFF) << sh
        hi = (e >> 8) << sh
        grp = i // 4
        return (_word(lo, grp, 0), _word(lo, grp, 1), _word(lo, grp, 2), _word(lo, grp, 3), _word(hi, grp, 0),
                _word(hi, grp, 1), _word(hi, grp, 2), _word(hi, grp, 3))


@gluon.jit
def _lookup(w, h, w0, w1, w2, w3, w4, w5, w6, w7, BITS: gl.constexpr, N: gl.constexpr):
    """(.., N) float16 codebook values of the codes in bytes w (and h, 3 bits: their high bits, a nibble a byte of w)
    in w's layout, entries in channel order of the bytes (4 bits: 2 byte + nibble; 2 and 3 bits: 4 byte + code)."""
    if BITS == 4:
        lo, hi = gl.inline_asm_elementwise(_LUT4, _LUT4_CONSTRAINTS, [w, w0, w1, w2, w3, w4, w5, w6, w7],
                                           dtype=(gl.float16, gl.float16), is_pure=True, pack=4)
        return gl.reshape(gl.join(lo, hi), [T, N])
    else:
        if BITS == 3:
            b0, b1, b2, b3 = gl.inline_asm_elementwise(_LUT3, _LUT3_CONSTRAINTS, [w, h, w0, w1, w4, w5],
                                                       dtype=(gl.float16, gl.float16, gl.float16, gl.float16),
                                                       is_pure=True, pack=4)
        else:
            b0, b1, b2, b3 = gl.inline_asm_elementwise(_LUT2, _LUT2_CONSTRAINTS, [w, w0, w1, w2, w3, w4, w5, w6, w7],
                                                       dtype=(gl.float16, gl.float16, gl.float16, gl.float16),
                                                       is_pure=True, pack=4)
        # join adds its axis last: join(join(b0, b2), join(b1, b3))[.., y, x] = b_(2y + x)
        return gl.reshape(gl.join(gl.join(b0, b2), gl.join(b1, b3)), [T, N])


@gluon.jit
def _key_operand(w, h, w0, w1, w2, w3, w4, w5, w6, w7, HP: gl.constexpr, A: gl.constexpr, BITS: gl.constexpr):
    """(T, HP) float16 key codebook values in slot order (``key_channel``) as the A fragment, from ``_key_bytes``:
    the relabelling moves no data (asserted)."""
    if BITS == 4:
        x = _lookup(w, w, w0, w1, w2, w3, w4, w5, w6, w7, BITS, HP)  # column 2 byte + nibble
        x = gl.reshape(gl.permute(gl.reshape(x, [T, 4, HP // 32, 2, 2, 2]), [0, 2, 5, 3, 1, 4]), [T, HP])
    else:
        if BITS == 3:  # byte j's 4 high bits: nibble j % 2 of the 1-bit plane's byte j // 2
            h = gl.convert_layout(gl.reshape(gl.join(h & 15, h >> 4), [T, HP // 4]), KB2, assert_trivial=True)
        x = _lookup(w, h, w0, w1, w2, w3, w4, w5, w6, w7, BITS, HP)  # column 4 byte + code
        x = gl.reshape(gl.permute(gl.reshape(x, [T, 4, 2, 2, 4]), [0, 4, 2, 1, 3]), [T, HP])
    return gl.convert_layout(x, A, assert_trivial=True)


@gluon.constexpr_function
def copy_layout(n, heads):
    """cp.async layout of a plane's (T, n) bytes of a tile: 16 bytes a lane where each kv head's n / heads bytes
    (at least 8: ``eligible``'s widths) and the tile allow."""
    vec = min(16, n // heads, n * TILE // 32)
    return gl.BlockedLayout([1, vec], [32 // (n // vec), n // vec], [1, 1], [1, 0])


@gluon.jit
def _copy_rows(ring, stage, base, stride, head_stride, heads, live, off, N: gl.constexpr, HEADS: gl.constexpr):
    """Start copying one plane of the tile's T rows of codes from ``base`` into ring[stage] (cp.async): N bytes a
    row, N / HEADS of each of the program's kv heads (``head_stride`` apart) from byte ``off`` of the head; heads
    from ``heads`` on and rows from ``live`` on: zeros."""
    L: gl.constexpr = copy_layout(N, HEADS)
    t = gl.arange(0, T, layout=gl.SliceLayout(1, L))
    c = gl.arange(0, N, layout=gl.SliceLayout(0, L))
    if HEADS == 1:
        col = off + c
        mask = (t < live)[:, None] & (c >= 0)[None, :]
    else:
        PN: gl.constexpr = N // HEADS
        col = (c // PN) * head_stride + off + c % PN
        mask = (t < live)[:, None] & (c // PN < heads)[None, :]
    _async_load(ring.index(stage), base + t[:, None] * stride + col[None, :], mask=mask)


@gluon.jit
def _copy_side(ring, ring1, stage, base, stride, head_stride, heads, live, E: gl.constexpr, EH: gl.constexpr,
               BITS: gl.constexpr):
    """Start copying one side's codes of a tile (its planes: the 4-bit row, or the 2-bit plane and at 3 bits the
    1-bit one, which follows it in each head) into stage ``stage`` of its rings."""
    if BITS == 4:
        _copy_rows(ring, stage, base, stride, head_stride, heads, live, 0, E // 2, E // EH)
    else:
        _copy_rows(ring, stage, base, stride, head_stride, heads, live, 0, E // 4, E // EH)
        if BITS == 3:
            _copy_rows(ring1, stage, base, stride, head_stride, heads, live, EH // 4, E // 8, E // EH)


@gluon.jit
def _copy_tile(k_ring, k_ring1, v_ring, v_ring1, stage, kbase, k_t, k_h, vbase, v_t, v_h, heads, live,
               E: gl.constexpr, EH: gl.constexpr, KBITS: gl.constexpr, VBITS: gl.constexpr):
    """Start copying a tile's key and value codes into stage ``stage`` of the rings."""
    _copy_side(k_ring, k_ring1, stage, kbase, k_t, k_h, heads, live, E, EH, KBITS)
    _copy_side(v_ring, v_ring1, stage, vbase, v_t, v_h, heads, live, E, EH, VBITS)


@gluon.constexpr_function
def key_plane_layout(cb, hbit):
    """Layout of a tile's (T, 8 cb) plane of key codes (cb bytes a 16-channel chunk) loaded for both rotary halves:
    lane (g8, q) holds tokens g8 and g8 + 8 of the two chunks whose bits other than ``hbit`` spell q, so that each
    half split off along chunk bit ``hbit`` (``_halves``) is KB4 / KB2 / KB1."""
    others = [b for b in range(3) if b != hbit]
    regs = [[0, 1 << i] for i in range(cb.bit_length() - 1)] + [[8, 0], [0, cb << hbit]]
    lanes = [[0, cb << others[0]], [0, cb << others[1]], [1, 0], [2, 0], [4, 0]]
    return gl.DistributedLinearLayout(regs, lanes, [], [], [TILE, 8 * cb])


@gluon.jit
def _halves(x, CB: gl.constexpr, HBIT: gl.constexpr, KB: gl.constexpr):
    """The rotary halves (chunk bit HBIT 0, 1) of a plane loaded in ``key_plane_layout``, each (T, 4 CB) in layout
    KB: the relabelling moves no data (asserted)."""
    HI: gl.constexpr = 4 >> HBIT
    a, b = gl.split(gl.permute(gl.reshape(x, [T, HI, 2, CB << HBIT]), [0, 1, 3, 2]))
    return (gl.convert_layout(gl.reshape(a, [T, 4 * CB]), KB, assert_trivial=True),
            gl.convert_layout(gl.reshape(b, [T, 4 * CB]), KB, assert_trivial=True))


@gluon.jit
def _key_bytes(ring, ring1, stage, HBIT: gl.constexpr, E: gl.constexpr, BITS: gl.constexpr):
    """A tile's key codes from stage ``stage`` of the rings as each lane holds them, for rotary halves a and b:
    (wa, ha, wb, hb), its chunk of tokens g8 and g8 + 8 (8 bytes at 4 bits; 4 bytes of the 2-bit plane, and at 3
    bits h: 2 of the 1-bit plane, else a copy of w)."""
    if BITS == 4:
        wa, wb = _halves(ring.index(stage).load(key_plane_layout(E // 16, HBIT)), E // 16, HBIT, KB4)
        return wa, wa, wb, wb
    else:
        wa, wb = _halves(ring.index(stage).load(key_plane_layout(E // 32, HBIT)), E // 32, HBIT, KB2)
        if BITS == 3:
            ha, hb = _halves(ring1.index(stage).load(key_plane_layout(E // 64, HBIT)), E // 64, HBIT, KB1)
            return wa, ha, wb, hb
        else:
            return wa, wa, wb, wb


@gluon.jit
def _value_bytes(ring, ring1, stage, E: gl.constexpr, BITS: gl.constexpr):
    """A tile's value codes from stage ``stage`` of the rings, as each lane holds them: its 16 channels of tokens 2q,
    2q + 1, 2q + 8, 2q + 9 (8 bytes a token at 4 bits; 4 of the 2-bit plane, and at 3 bits 2 of the 1-bit plane,
    else a copy of the first)."""
    if BITS == 4:
        w = ring.index(stage).load(VB4)
        return w, w
    else:
        w = ring.index(stage).load(VB2)
        if BITS == 3:
            return w, ring1.index(stage).load(VB1)
        else:
            return w, w


@gluon.jit
def _tile_place(table, s_tab, slot, start, hi, BS: gl.constexpr):
    """(block or row, position in it) of the tile at ``start``: paged, the row's block from the table (none past
    hi: the null block 0)."""
    if BS > 0:
        pb = gl.load(table + slot * s_tab + start // BS, mask=start < hi, other=0).to(gl.int64)
        return pb, start % BS
    else:
        return slot, start


@gluon.jit
def _value_operand(w, h, w0, w1, w2, w3, w4, w5, w6, w7, E: gl.constexpr, A: gl.constexpr, BITS: gl.constexpr):
    """(E, T) float16 value codebook values, rows in ``value_channel`` order, as the A fragment, from
    ``_value_bytes``: regrouped within each lane (a token pair innermost) so that a lookup's float16 pair is two
    tokens of a channel."""
    if BITS == 4:
        x = _lookup(gl.convert_layout(w, VB4_PAIRS), w, w0, w1, w2, w3, w4, w5, w6, w7, BITS, E)
    else:
        if BITS == 3:
            h = gl.convert_layout(gl.reshape(gl.join(h & 15, h >> 4), [T, E // 4]), VB2_PAIRS)
        x = _lookup(gl.convert_layout(w, VB2_PAIRS), h, w0, w1, w2, w3, w4, w5, w6, w7, BITS, E)
    # x: column = channel 16 g8 + 2u + h -> row 16u + 8h + g8
    x = gl.reshape(gl.permute(gl.reshape(x, [T, 8, E // 16, 2]), [0, 2, 3, 1]), [T, E])
    return gl.convert_layout(gl.permute(x, [1, 0]), A, assert_trivial=True)


@gluon.jit
def _softmax_step(m, l, st):
    """Online softmax over the tokens (rows) of Sᵀ (T, N) (log2 units, -inf masked): m, l, p, alpha."""
    m_new = gl.maximum(m, gl.max(st, 0))
    m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(st - m_ref[None, :])
    alpha = gl.exp2(m - m_ref)
    return m_new, l * alpha + gl.sum(p, 0), p, alpha


@gluon.jit
def _token_scales(ptr, rows, h0, kvh, live, colok, HEADS: gl.constexpr):
    """A tile's per-token value scale (mid or half) of each column's kv head: (T, 1) with one head a program, else
    (T, N)."""
    if HEADS == 1:
        return gl.load(ptr + rows + h0, mask=live, other=0.0).to(gl.float32)[:, None]
    else:
        return gl.load(ptr + rows[:, None] + kvh[None, :], mask=live[:, None] & colok[None, :],
                       other=0.0).to(gl.float32)


@gluon.jit
def _decode_kernel(q, slots, lens, sinv, angles, rope, kscales, klut, vlut, out, ws, table, s_tab, sc, c_b, c_k,
                   kc, vc, vmid, vhalf, ksink, vsink, s_qb, s_qh, k_s, k_t, k_h, v_s, v_t, v_h, v_ms, v_mt, ks_s, ks_t,
                   ks_h, vs_s, vs_t, vs_h, s_ob, s_oh, w_b, w_h, w_p, w_e, splits, hkv, scale,
                   GROUP: gl.constexpr, E: gl.constexpr, EH: gl.constexpr, HBIT: gl.constexpr, SU: gl.constexpr,
                   S: gl.constexpr, BS: gl.constexpr, ONE_SPLIT: gl.constexpr, KSLOTS: gl.constexpr,
                   VSLOTS: gl.constexpr, KBITS: gl.constexpr, VBITS: gl.constexpr, STAGES: gl.constexpr,
                   LW: gl.constexpr):
    """BS > 0: a paged cache (blocks of BS tokens, a multiple of T: a tile is in one block, ``table`` (slots, M));
    the sinks are never paged. KSLOTS / VSLOTS: sparse outliers, whose passes (``kv_decode_fast.outlier_passes``)
    share the score buffer sc with this kernel: it adds the key pass's terms to its scores and leaves the scores
    there for the value pass, as ``kv_decode_fast``'s decode does (offsets: ``kv_decode_fast._sc_token``).
    The codes' strides (k_s .. v_h) come in units of SU bytes (16, or 8 where a stride is not a multiple of 16: a
    3-bit head of 64 channels is 24 bytes), which tells the compiler how far the copies' addresses are aligned.
    ``sinv``: the inverse frequencies in slot order (0 where RoPE leaves a channel). ``lens``: int32 words, a row's
    length every LW of them (``ssmq.kernels._common.int32_words``)."""
    HP: gl.constexpr = E // 2
    HEADS: gl.constexpr = E // EH
    PAIR: gl.constexpr = 16 << HBIT  # channels from a slot's channel in half a to its partner in half b
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    A: gl.constexpr = gl.DotOperandLayout(0, MMA, 2)
    B: gl.constexpr = gl.DotOperandLayout(1, MMA, 2)
    i = gl.program_id(0)
    h0 = gl.program_id(1) * HEADS  # the program's first kv head
    sp = gl.program_id(2)
    k_s, k_t, k_h = k_s * SU, k_t * SU, k_h * SU
    v_s, v_t, v_h = v_s * SU, v_t * SU, v_h * SU
    slot = gl.load(slots + i).to(gl.int64)
    n = gl.load(lens + i * LW)
    chunk = gl.cdiv(gl.cdiv(n, splits), T) * T
    lo = sp * chunk
    hi = gl.minimum(lo + chunk, n)

    # the query groups as B fragments (HP slots, 8 columns: column c is query head h0 · GROUP + c, of kv head
    # h0 + c // GROUP, zero on the other head's channels), pre-scaled (log2 units), float16
    kq = gl.arange(0, HP, layout=gl.SliceLayout(1, B))
    nq = gl.arange(0, 8, layout=gl.SliceLayout(0, B))
    cq = ring_channel(key_channel(kq, KBITS), 0, HBIT)
    qptr = q + i * s_qb + (h0 * GROUP + nq[None, :]) * s_qh + (cq % EH)[:, None]
    qmask = (((nq < HEADS * GROUP) & (h0 + nq // GROUP < hkv))[None, :]
             & ((cq // EH)[:, None] == (nq // GROUP)[None, :]))
    qs = scale * 1.4426950408889634
    qa = (gl.load(qptr, mask=qmask, other=0.0).to(gl.float32) * qs).to(gl.float16)
    qb = (gl.load(qptr + PAIR, mask=qmask, other=0.0).to(gl.float32) * qs).to(gl.float16)
    # loop-invariant A-fragment tables: cos / sin of j θ (``rope_table``), the key scales (``key_scale_table``)
    jA = gl.arange(0, T, layout=gl.SliceLayout(1, A))
    kA = gl.arange(0, HP, layout=gl.SliceLayout(0, A))
    cj = gl.load(rope + jA[:, None] * HP + kA[None, :])
    sj = gl.load(rope + T * HP + jA[:, None] * HP + kA[None, :])
    ksc = kscales + gl.program_id(1) * 4 * HP + kA
    ma = gl.load(ksc)[None, :]
    ha = gl.load(ksc + HP)[None, :]
    mb = gl.load(ksc + 2 * HP)[None, :]
    hb = gl.load(ksc + 3 * HP)[None, :]
    k0, k1, k2, k3, k4, k5, k6, k7 = _lut_words(klut, 2 ** KBITS)
    v0, v1, v2, v3, v4, v5, v6, v7 = _lut_words(vlut, 2 ** VBITS)

    m = gl.full([8], float("-inf"), gl.float32, gl.SliceLayout(0, MMA))
    l = gl.zeros([8], gl.float32, gl.SliceLayout(0, MMA))
    lm = gl.zeros([8], gl.float32, gl.SliceLayout(0, MMA))  # Σ p · mid of the values: added to every channel
    acc = gl.zeros([E, 8], gl.float32, MMA)
    tS = gl.arange(0, T, layout=gl.SliceLayout(1, MMA))
    nS = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    kvh = h0 + nS // GROUP  # each column's kv head
    colok = (nS < HEADS * GROUP) & (kvh < hkv)
    if S > 0:
        if sp == 0:  # the float sink tokens, positions [0, S), one tile: keys rotated by their own positions
            ns = gl.minimum(n, S)
            ck = ring_channel(key_channel(kA, KBITS), 0, HBIT)
            kp = ksink + slot * ks_s + jA[:, None] * ks_t + ((h0 + ck // EH) * ks_h + ck % EH)[None, :]
            km = (jA < ns)[:, None] & (h0 + ck // EH < hkv)[None, :]
            ka = gl.load(kp, mask=km, other=0.0).to(gl.float32)
            kb = gl.load(kp + PAIR, mask=km, other=0.0).to(gl.float32)
            cs, sn = _cos_sin(jA.to(gl.float32)[:, None] * gl.load(sinv + kA)[None, :])
            st = mma_v2((ka * cs - kb * sn).to(gl.float16), qa, gl.zeros([T, 8], gl.float32, MMA))
            st = mma_v2((kb * cs + ka * sn).to(gl.float16), qb, st)
            m, l, p, alpha = _softmax_step(m, l, gl.where((tS < ns)[:, None], st, float("-inf")))
            tA = gl.arange(0, T, layout=gl.SliceLayout(0, A))
            cv = value_channel(gl.arange(0, E, layout=gl.SliceLayout(1, A)))
            vp = vsink + slot * vs_s + tA[None, :] * vs_t + ((h0 + cv // EH) * vs_h + cv % EH)[:, None]
            vm = (tA < ns)[None, :] & (h0 + cv // EH < hkv)[:, None]
            vt = gl.load(vp, mask=vm, other=0.0).to(gl.float16)
            acc = mma_v2(vt, gl.convert_layout(p.to(gl.float16), B), acc)

    row_sc = i.to(gl.int64)  # sc's first index: the row, or (paged) the tile's block
    # the codes of the next STAGES - 1 tiles in flight (cp.async rings; the loop's other loads are small), each
    # tile read from its stage: without them the warp waited on its own loads (H200, 128K tokens x 8
    # rows: 2-bit 0.80 -> 0.67 ms, 4-bit 0.96 -> 0.92)
    SH: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    KN: gl.constexpr = E // 2 if KBITS == 4 else E // 4  # bytes of a token's first plane
    VN: gl.constexpr = E // 2 if VBITS == 4 else E // 4
    k_ring = gl.allocate_shared_memory(gl.uint8, [STAGES, T, KN], SH)
    v_ring = gl.allocate_shared_memory(gl.uint8, [STAGES, T, VN], SH)
    k_ring1 = gl.allocate_shared_memory(gl.uint8, [STAGES, T, E // 8], SH)  # the 1-bit planes (3 bits; else unused)
    v_ring1 = gl.allocate_shared_memory(gl.uint8, [STAGES, T, E // 8], SH)
    kbase = kc + h0 * k_h
    vbase = vc + h0 * v_h
    for j in gl.static_range(STAGES - 1):
        pj, tj = _tile_place(table, s_tab, slot, lo + j * T, hi, BS)
        _copy_tile(k_ring, k_ring1, v_ring, v_ring1, j, kbase + pj * k_s + tj * k_t, k_t, k_h,
                   vbase + pj * v_s + tj * v_t, v_t, v_h, hkv - h0, hi - lo - j * T, E, EH, KBITS, VBITS)
        async_copy.commit_group()
    for start in range(lo, hi, T):
        pb, t0 = _tile_place(table, s_tab, slot, start, hi, BS)
        if BS > 0:
            row_sc = pb
        it = (start - lo) // T
        nxt = start + (STAGES - 1) * T
        pn, tn = _tile_place(table, s_tab, slot, nxt, hi, BS)
        # this tile's copy done, and (the barrier: one warp) every lane's; the stage refilled next was read by all
        async_copy.wait_group(STAGES - 2)
        _barrier()
        _copy_tile(k_ring, k_ring1, v_ring, v_ring1, (it + STAGES - 1) % STAGES, kbase + pn * k_s + tn * k_t, k_t,
                   k_h, vbase + pn * v_s + tn * v_t, v_t, v_h, hkv - h0, hi - nxt, E, EH, KBITS, VBITS)
        async_copy.commit_group()
        wa, wa1, wb, wb1 = _key_bytes(k_ring, k_ring1, it % STAGES, HBIT, E, KBITS)
        wv, wv1 = _value_bytes(v_ring, v_ring1, it % STAGES, E, VBITS)
        ts = start + tS
        live = (ts < hi) & (ts >= S)
        rows = pb * v_ms + (t0 + tS) * v_mt
        mv = _token_scales(vmid, rows, h0, kvh, live, colok, HEADS)
        hv = _token_scales(vhalf, rows, h0, kvh, live, colok, HEADS)
        # keys: mid + half · B, then turned by j θ, all float16 (HFMA2)
        xa = ma + ha * _key_operand(wa, wa1, k0, k1, k2, k3, k4, k5, k6, k7, HP, A, KBITS)
        xb = mb + hb * _key_operand(wb, wb1, k0, k1, k2, k3, k4, k5, k6, k7, HP, A, KBITS)
        ra = xa * cj - xb * sj
        rb = xb * cj + xa * sj
        # the query turned back by t0 θ (float16 cos / sin by slot, ``tile_angles``)
        c0 = gl.load(angles + (start // T) * E + kq)
        s0 = gl.load(angles + (start // T) * E + HP + kq)
        ua = qa * c0[:, None] + qb * s0[:, None]
        ub = qb * c0[:, None] - qa * s0[:, None]
        st = mma_v2(ra, ua, gl.zeros([T, 8], gl.float32, MMA))
        st = mma_v2(rb, ub, st)
        if KSLOTS or VSLOTS:  # a token's GROUP terms together: (i or its block, kv head, position, query head)
            cs = sc + row_sc * c_b + (t0 + tS)[:, None] * GROUP + (kvh * c_k + nS % GROUP)[None, :]
            cm = live[:, None] & colok[None, :]
            if KSLOTS:
                st += gl.load(cs, mask=cm, other=0.0)
            if VSLOTS:
                gl.store(cs, st, mask=cm)
        m, l, p, alpha = _softmax_step(m, l, gl.where(live[:, None], st, float("-inf")))
        lm = lm * alpha + gl.sum(p * mv, 0)
        pv = gl.convert_layout((p * hv).to(gl.float16), B)
        acc = mma_v2(_value_operand(wv, wv1, v0, v1, v2, v3, v4, v5, v6, v7, E, A, VBITS), pv,
                     acc * alpha[None, :])

    async_copy.wait_group(0)  # no copy outlives the program (a split past its row's end issued some)
    mo = gl.arange(0, E, layout=gl.SliceLayout(1, MMA))
    no = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    cv = value_channel(mo)  # row mo's channel among the E: channel cv % EH of the program's head cv // EH
    channel = cv % EH
    heads = h0 * GROUP + no
    rmask = (no < HEADS * GROUP) & (h0 + no // GROUP < hkv)
    o = acc + lm[None, :]
    omask = rmask[None, :] & ((cv // EH)[:, None] == (no // GROUP)[None, :])  # a head's rows of its own columns
    if ONE_SPLIT:
        gl.store(out + i * s_ob + heads[None, :] * s_oh + channel[:, None], o / l[None, :], mask=omask)
    else:
        dst = ws + i * w_b + heads * w_h + sp * w_p
        gl.store(dst[None, :] + channel[:, None] * w_e, o, mask=omask)
        gl.store(dst + EH * w_e, m, mask=rmask)
        gl.store(dst + (EH + 1) * w_e, l, mask=rmask)


def eligible(k: KVSideView, v: KVSideView, rotary_dim: int, group: int, paged_block: int = 0) -> bool:
    """Formats this kernel serves: its row of ``dispatch.QUANT_KV_DECODE`` (module docstring); the rest go to
    ``kv_decode_fast``."""
    return serves(QUANT_KV_DECODE, "kv_decode_warp", quant_kv_view_launch(k, v, rotary_dim, group, paged_block))


def rotary_bit(head_dim: int, rotary_dim: int) -> int:
    """The chunk bit that tells the rotary halves apart (HBIT, module docstring): log2(r / 32), or without RoPE
    log2(e / 32) (any pairing within a head)."""
    return (rotary_dim or head_dim).bit_length() - 6


def constexprs(group: int, head_dim: int, rotary_dim: int, sink: int, paged_block: int, one_split: bool,
               key_slots: bool, value_slots: bool, key_bits: int, value_bits: int, stride_unit: int,
               length_words: int = 1) -> dict:
    """``_decode_kernel``'s compile-time arguments for a launch (``quant_kv_decode``, the compile test and
    ``tests/sass_kv_decode.py`` build the same kernel)."""
    return dict(GROUP=group, E=E_SERVED, EH=head_dim, HBIT=rotary_bit(head_dim, rotary_dim), SU=stride_unit, S=sink,
                BS=paged_block, ONE_SPLIT=one_split, KSLOTS=key_slots, VSLOTS=value_slots, KBITS=key_bits,
                VBITS=value_bits, STAGES=STAGES, LW=length_words)


CODE_STRIDES = ("k_s", "k_t", "k_h", "v_s", "v_t", "v_h")  # the codes' strides, in SU-byte units


def compile_signature(head_dim: int = E_SERVED) -> tuple[dict, list, int]:
    """(pointer types, strides given as multiples of 16, the codes' stride unit SU) of ``_decode_kernel`` as a launch
    specializes it on the bench's shapes: for ``ssmq.kernels.build.compile_sm90`` (the compile test,
    ``tests/sass_kv_decode.py``). The codes' strides (``CODE_STRIDES``, in SU-byte units) are not marked: a
    launch does not find them multiples of 16 (a kv head of 128 channels is 2-4 units of 16 bytes; SmolLM2's 3-bit
    token of 3 heads x 64 channels 9 units of 8), so the copies' alignment comes from SU alone."""
    pointers = dict(q="fp16", slots="i64", lens="i32", sinv="fp32", angles="fp16", rope="fp16", kscales="fp16",
                    klut="fp32", vlut="fp32", out="fp32", ws="fp32", table="i64", kc="u8", vc="u8", vmid="fp16",
                    vhalf="fp16", ksink="fp32", vsink="fp32", sc="fp32")
    strides = [a for a in _decode_kernel.arg_names if a.startswith(("s_", "k_", "v_", "ks_", "vs_", "w_", "c_"))
               and a not in ("v_mt", "s_tab", "w_h", *CODE_STRIDES)]
    return pointers, strides, 16 if head_dim == E_SERVED else 8


def slot_channels(head_dim: int, rotary_dim: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(head, channel) of the key slots of rotary half a, (HP,) each: the program's kv head (0 or 1) and the
    channel in it; slot k of half b holds channel + 16 · 2^HBIT of the same head (r / 2: its rotary partner)."""
    ring = ring_channel.fn(key_channel.fn(torch.arange(E_SERVED // 2), bits), 0, rotary_bit(head_dim, rotary_dim))
    return ring // head_dim, ring % head_dim


def slot_inv_freq(head_dim: int, rotary_dim: int, theta: float, bits: int) -> torch.Tensor:
    """(HP,) float64 inverse frequencies θ^(-2c / r) of the key slots (half a's channel c), 0 where RoPE leaves the
    channel (c ≥ r / 2, or no RoPE)."""
    c = slot_channels(head_dim, rotary_dim, bits)[1].double()
    if not rotary_dim:
        return torch.zeros_like(c)
    return torch.where(c < rotary_dim // 2, 1.0 / theta ** (2 * c / rotary_dim), 0.0)


def _slot_angles(positions: torch.Tensor, head_dim: int, rotary_dim: int, theta: float, bits: int) -> torch.Tensor:
    """(len(positions), HP) float64 angles t θ_c of the positions, columns in key slot order."""
    return positions.double()[:, None] * slot_inv_freq(head_dim, rotary_dim, theta, bits)[None, :]


@functools.lru_cache(maxsize=16)
def rope_table(head_dim: int, rotary_dim: int, theta: float, bits: int, device: torch.device) -> torch.Tensor:
    """(2, T, HP) float16: cos, sin of j θ_c for the within-tile positions j, columns in slot order (float64 on the
    host, then rounded)."""
    a = _slot_angles(torch.arange(TILE), head_dim, rotary_dim, theta, bits)
    return torch.stack([a.cos(), a.sin()]).half().contiguous().to(device)


@functools.lru_cache(maxsize=16)
def tile_angles(capacity: int, head_dim: int, rotary_dim: int, theta: float, bits: int,
                device: torch.device) -> torch.Tensor:
    """(ceil(capacity / T), 2 HP) float16: cos (first HP columns) and sin of t0 θ_c for the tiles' first positions t0,
    columns in slot order (float64 on the host, then rounded; 4 MB at 128K tokens, read from L2)."""
    a = _slot_angles(torch.arange(0, capacity, TILE), head_dim, rotary_dim, theta, bits)
    return torch.cat([a.cos(), a.sin()], 1).half().contiguous().to(device)


@functools.lru_cache(maxsize=16)
def _slot_inv_freq_on(head_dim: int, rotary_dim: int, theta: float, bits: int, device: torch.device) -> torch.Tensor:
    return slot_inv_freq(head_dim, rotary_dim, theta, bits).float().to(device)


def key_scale_table(k: KVSideView, rotary_dim: int) -> torch.Tensor:
    """(programs, 4, HP) float16: mid_a, half_a, mid_b, half_b of the per-channel key scales in slot order, a
    program's HEADS kv heads side by side (zeros for a missing last head; each side's constant: cached on the view's
    scales)."""
    cached = _SCALES.get((id(k.mid), rotary_dim))
    if cached is not None and cached[0] is k.mid:
        return cached[1]
    hkv, e = k.mid.shape
    heads = E_SERVED // e
    head, ch = (x.to(k.mid.device) for x in slot_channels(e, rotary_dim, k.bits))
    kv = (torch.arange(programs(hkv, e), device=k.mid.device)[:, None] * heads + head).clamp(max=hkv)
    mid, half = (torch.cat([x, x.new_zeros(1, e)]) for x in (k.mid, k.half))  # row hkv: the missing head
    pb = ch + (16 << rotary_bit(e, rotary_dim))
    table = torch.stack([mid[kv, ch], half[kv, ch], mid[kv, pb], half[kv, pb]], 1).half().contiguous()
    if len(_SCALES) > 256:
        _SCALES.clear()
    _SCALES[(id(k.mid), rotary_dim)] = (k.mid, table)  # the reference keeps the id from being reused while cached
    return table


_SCALES: dict = {}


def programs(hkv: int, head_dim: int) -> int:
    """Programs a row (and split): one a kv head at head dim 128, one a pair of them at 64."""
    return -(-hkv // (E_SERVED // head_dim))


def default_splits(b: int, hkv: int, capacity: int, device: torch.device) -> int:
    """Splits filling whole rounds of RESIDENT programs an SM (under a MAXNREG cap: the programs it allows), at most
    one per MIN_TILES tiles of the capacity. ``hkv``: the programs a row (kv heads, or head pairs at head dim 64).
    Up to WIDEST splits when a round is not a multiple of the b · hkv (row, program) pairs: there a few more splits
    can fill the last round (113 rows x 8 kv heads, 1056 resident programs: 2 splits are 1.71 rounds run as 2, 7 are
    5.99)."""
    resident = resident_programs(MAXNREG, 1) if MAXNREG else RESIDENT  # as ``kv_decode._launch`` derives it
    slots = resident * _sm_count(device)
    fill = cdiv(ROUNDS * slots, b * hkv)
    fill = whole_rounds(fill, b * hkv, slots, most=max(2 * fill, WIDEST))
    return max(1, min(fill, cdiv(capacity, TILE * MIN_TILES)))


def quant_kv_decode(q: torch.Tensor, slots: torch.Tensor, kv_lens: torch.Tensor, k: KVSideView, v: KVSideView,
                    rotary_dim: int = 0, theta: float = 10000.0, softmax_scale: float | None = None,
                    splits: int | None = None, block_table: torch.Tensor | None = None) -> torch.Tensor:
    """``quant_kv_decode_ref`` on the GPU for ``eligible`` formats: q (b, hq, e) → (b, hq, e) float32 (lengths stay
    on the GPU; ``block_table`` (s, M): block pools read in place)."""
    b, hq, e = q.shape
    hkv = k.codes.shape[2]
    (table, s_tab), bs, capacity = paging(block_table, slots, k.codes)
    if not eligible(k, v, rotary_dim, hq // hkv, bs):
        raise SSMQError("the warp KV decode kernel serves 2-, 3- and 4-bit per-channel keys and per-token values "
                        "(codebooks of 2^bits entries), head dim 128 or 64 with RoPE on 0, 32, 64 or 128 channels, "
                        f"at most {TILE} sink tokens, 8 query heads a kv head (4 at head dim 64) and blocks of whole "
                        f"{TILE}-token tiles; use ssmq.kernels.kv_decode_fast")
    assert q.stride(-1) == 1 and k.codes.stride(-1) == 1 and v.codes.stride(-1) == 1
    code_strides = (*k.codes.stride()[:3], *v.codes.stride()[:3])  # CODE_STRIDES' order
    su = 16 if all(x % 16 == 0 for x in code_strides) else 8
    assert all(x % su == 0 for x in code_strides), code_strides  # whole 8-byte heads: eligible's widths
    sc, (c_b, c_k), value_outliers = outlier_passes(q, slots, kv_lens, k, v, rotary_dim, theta, softmax_scale,
                                                    block_table)
    grid = (b, programs(hkv, e))
    splits = splits or default_splits(*grid, capacity, q.device)
    if value_outliers:  # the value pass adds into the splits' outputs: at least two
        splits = max(splits, 2)
    scale = e ** -0.5 if softmax_scale is None else softmax_scale
    out, ws = split_outputs(b, hq, e, splits, q.device)
    ks, vs = k.sink, v.sink
    lens, words = int32_words(kv_lens)
    _decode_kernel[(*grid, splits)](
        q, slots, lens, _slot_inv_freq_on(e, rotary_dim, theta, k.bits, q.device),
        tile_angles(capacity, e, rotary_dim, theta, k.bits, q.device),
        rope_table(e, rotary_dim, theta, k.bits, q.device), key_scale_table(k, rotary_dim),
        k.codebook.float().contiguous(), v.codebook.float().contiguous(), out, ws, table, s_tab, sc, c_b, c_k,
        k.codes, v.codes, v.mid, v.half, ks, vs, q.stride(0), q.stride(1), *(x // su for x in code_strides),
        v.mid.stride(0), v.mid.stride(1), ks.stride(0), ks.stride(1), ks.stride(2), vs.stride(0), vs.stride(1),
        vs.stride(2), out.stride(0), out.stride(1), *ws.stride(), splits, hkv, scale,
        **constexprs(hq // hkv, e, rotary_dim, k.sink.shape[1], bs, splits == 1, k.out_idx.shape[-1] > 0,
                     v.out_idx.shape[-1] > 0, k.bits, v.bits, su, words),
        num_warps=1, **({"maxnreg": MAXNREG} if MAXNREG else {}))
    if value_outliers:
        value_outliers(ws, splits)
    return combine_splits(out, ws, splits)
