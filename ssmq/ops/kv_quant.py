"""KV-cache quantization references: one parametrized path for KVQuant and the engines' KV formats.

Glossary: t tokens (leading dims flattened), hkv kv heads, e head dim, N = hkv·e entries of one token,
C codebook entries, k outlier slots per token.

One side (keys or values) of t tokens, x (t, hkv, e), is stored as a ``QuantizedKV``:
    codes     (t, hkv, e) uint8   index of the nearest entry of the sorted codebook c (C,) in [-1, 1]
    mid, half (t, hkv) float16 for per_token scales (computed here, online); per_channel (hkv, e) and
              per_tensor () scales are offline, float32, given as ``KVParams.lo / hi``
    out_idx   (t, k) int16: flat index in N of each sparse outlier, increasing, then -1 for the empty slots
    out_val   (t, k) float16: the outlier's value, stored exactly
and read back as x̂ = mid + half · c[codes] (then un-rotated), with the outliers written over it. The code under an
outlier is the codebook's end on its value's side (``outlier_codes``): the decode kernels get x̂ there from the value
instead of gathering the code.

Outliers (dense-and-sparse): per_channel scales clip at offline thresholds lo / hi, and the entries beyond them
(largest excess first, at most k per token) are kept sparse; per_token scales take the k largest |x| of each
token as outliers and normalize the rest. Rotation (TurboQuant-style): x ↦ (x ⊙ signs) H / √e per head,
H the Sylvester Hadamard matrix, before the scalar quantizer; its inverse after dequantization.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ssmq.ops.attention import read_extent

FP8_MAX = 448.0  # largest finite float8 e4m3fn value


@dataclass
class KVParams:
    """Everything that defines one side's quantizer. lo / hi: offline range (per_channel (hkv, e), per_tensor ());
    k: outlier slots per token (0: none); signs (e,) ±1: rotation (None: none)."""

    codebook: torch.Tensor
    granularity: str = "per_token"
    symmetric: bool = False
    lo: torch.Tensor | None = None
    hi: torch.Tensor | None = None
    k: int = 0
    signs: torch.Tensor | None = None


@dataclass
class QuantizedKV:
    codes: torch.Tensor
    mid: torch.Tensor | None
    half: torch.Tensor | None
    out_idx: torch.Tensor
    out_val: torch.Tensor


# ---------------------------------------------------------------------------------------------------------------
# codebooks
# ---------------------------------------------------------------------------------------------------------------
def uniform_codebook(bits: int, symmetric: bool = False) -> torch.Tensor:
    """(C,): 2^bits levels spanning [-1, 1]; symmetric: 2^bits - 1 levels, 0 among them (intX with absmax)."""
    if symmetric:
        m = 2 ** (bits - 1) - 1
        return torch.arange(-m, m + 1, dtype=torch.float32) / m
    return torch.linspace(-1.0, 1.0, 2 ** bits, dtype=torch.float32)


@functools.lru_cache(maxsize=1)
def _fp8_values() -> torch.Tensor:
    v = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    return torch.unique(v[torch.isfinite(v)])  # sorted, -0 and +0 merged


def fp8_codebook() -> torch.Tensor:
    """(253,): the finite float8 e4m3 values / 448, sorted (nearest-value rounding = casting, ties aside)."""
    return _fp8_values() / FP8_MAX


def nearest_code(u: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Index (uint8) of the nearest entry of the sorted ``codebook`` (C,) for each u (ties go up)."""
    c = codebook.to(u.device, torch.float32)
    return torch.bucketize(u.float(), (c[1:] + c[:-1]) / 2).to(torch.uint8)


# ---------------------------------------------------------------------------------------------------------------
# rotation
# ---------------------------------------------------------------------------------------------------------------
def hadamard(e: int, device=None) -> torch.Tensor:
    """(e, e) Sylvester Hadamard / √e (orthogonal, symmetric); e a power of two."""
    if e & (e - 1):
        raise ValueError(f"the rotation needs a power-of-two head dim, got {e}")
    h = torch.ones(1, 1)
    while h.shape[0] < e:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / e ** 0.5).to(device)


@functools.lru_cache(maxsize=None)
def _hadamard_on(e: int, device: torch.device) -> torch.Tensor:
    return hadamard(e, device)  # built once a device: no host-to-device copy a call (CUDA graphs refuse one)


def rotate_heads(x: torch.Tensor, signs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x (..., e) ↦ (x ⊙ signs) H, or its inverse (x H) ⊙ signs."""
    h = _hadamard_on(x.shape[-1], x.device)
    return (x.float() @ h) * signs if inverse else (x.float() * signs) @ h


# ---------------------------------------------------------------------------------------------------------------
# outliers and scales
# ---------------------------------------------------------------------------------------------------------------
def select_outliers(x: torch.Tensor, p: KVParams) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (t, hkv, e) float32 → out_idx (t, k) int16 (-1 empty), out_val (t, k) float16, mask (t, hkv, e) bool."""
    t = x.shape[0]
    flat = x.reshape(t, -1)
    if p.k == 0:
        return (torch.empty(t, 0, dtype=torch.int16, device=x.device),
                torch.empty(t, 0, dtype=torch.float16, device=x.device), torch.zeros_like(x, dtype=torch.bool))
    if p.granularity == "per_channel":  # beyond the offline thresholds, by how far (relative to the range)
        lo, hi = p.lo.to(x.device).reshape(1, -1), p.hi.to(x.device).reshape(1, -1)
        score = torch.maximum(flat - hi, lo - flat) / (hi - lo).clamp(min=1e-8)
    else:  # per_token: the largest magnitudes of each token
        score = flat.abs() + 1.0  # > 0: every slot is used
    top, where = score.topk(p.k, dim=1)
    idx = order_slots(torch.where(top > 0, where, -1))
    valid = idx >= 0
    val = torch.where(valid, flat.gather(1, idx.clamp(min=0)), 0.0).half()
    mask = torch.zeros(t, flat.shape[1] + 1, dtype=torch.bool, device=x.device)
    mask.scatter_(1, torch.where(valid, idx, flat.shape[1]), True)
    return idx.to(torch.int16), val, mask[:, :-1].reshape(x.shape)


def order_slots(idx: torch.Tensor, val: torch.Tensor | None = None):
    """A token's slots (..., k) in increasing index order, the empty ones (-1) last (with val (..., k) permuted alike,
    if given). The storage keeps them so: a kv head's slots follow each other (its channels are consecutive indices), so
    the fast decode kernel's key pass adds them to one score segment in turn (H100, 128K tokens: 0.060 -> 0.047 ms).
    Dequantization does not depend on the order."""
    n = torch.iinfo(torch.int32).max
    key, order = torch.where(idx >= 0, idx.long(), n).sort(dim=-1)
    idx = torch.where(key < n, key, -1).to(idx.dtype)
    return idx if val is None else (idx, val.gather(-1, order))


def _mid_half(lo: torch.Tensor, hi: torch.Tensor, symmetric: bool):
    if symmetric:
        return torch.zeros_like(hi), torch.maximum(lo.abs(), hi.abs())
    return (hi + lo) / 2, (hi - lo) / 2


def token_scales(x: torch.Tensor, mask: torch.Tensor, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Online per-(token, head) mid, half (t, hkv) float16 over the entries that are not outliers."""
    hi = torch.where(mask, -torch.inf, x).amax(-1)
    lo = torch.where(mask, torch.inf, x).amin(-1)
    mid, half = _mid_half(lo, hi, symmetric)
    return mid.half(), half.clamp(min=1e-4).half()


def scales_of(q: QuantizedKV, p: KVParams, device) -> tuple[torch.Tensor, torch.Tensor]:
    """mid, half broadcastable to (t, hkv, e), float32."""
    if p.granularity == "per_token":
        return q.mid.float()[..., None], q.half.float()[..., None]
    mid, half = _mid_half(p.lo.float(), p.hi.float(), p.symmetric)
    return mid.to(device), half.clamp(min=1e-8).to(device)


# ---------------------------------------------------------------------------------------------------------------
# quantize / dequantize
# ---------------------------------------------------------------------------------------------------------------
def quantize_kv_ref(x: torch.Tensor, p: KVParams) -> QuantizedKV:
    """x (t, hkv, e) → QuantizedKV (module docstring)."""
    x = x.float()
    if p.signs is not None:
        x = rotate_heads(x, p.signs.to(x.device).float())
    out_idx, out_val, mask = select_outliers(x, p)
    q = QuantizedKV(None, None, None, out_idx, out_val)
    if p.granularity == "per_token":
        q.mid, q.half = token_scales(x, mask, p.symmetric)
    mid, half = scales_of(q, p, x.device)
    q.codes = outlier_codes(nearest_code(((x - mid) / half).clamp(-1.0, 1.0), p.codebook), out_idx, out_val, mid,
                            p.codebook.numel())
    return q


def outlier_codes(codes: torch.Tensor, out_idx: torch.Tensor, out_val: torch.Tensor, mid: torch.Tensor,
                  levels: int) -> torch.Tensor:
    """codes (..., hkv, e) with the entry under each outlier slot (out_idx, out_val (..., k)) set to the codebook's
    end on the value's side: levels - 1 where val >= mid (mid broadcastable to codes, float32), else 0.
    Dequantization never reads these entries (the slot overwrites them); the decode kernels' outlier passes need
    x̂ = mid + half · c[code] there, and with this rule take it from the value's sign rather than a random byte
    gather of the code a slot. Outliers lie
    beyond the clip range (per-channel thresholds; a token's largest |x| for per-token scales), so the rule only
    restates the nearest code of the clipped value, except where a range is degenerate (tested)."""
    if out_idx.shape[-1] == 0:
        return codes
    e = codes.shape[-1]
    flat = codes.reshape(-1, *codes.shape[-2:])
    at = out_idx.reshape(len(flat), -1).long().clamp(min=0)
    rows = torch.arange(len(flat), device=codes.device)[:, None]
    # indexing the broadcast view (its leading dims merged, a view for the scales' layouts): no copy of mid per entry
    m = mid.expand(codes.shape).reshape(flat.shape)[rows, at // e, at % e]
    end = torch.where(out_val.reshape(at.shape).float() >= m, levels - 1, 0).to(codes.dtype)
    return scatter_outliers(flat, out_idx.reshape(at.shape), end).reshape(codes.shape)


def dequantize_kv_ref(q: QuantizedKV, p: KVParams) -> torch.Tensor:
    """QuantizedKV → (t, hkv, e) float32."""
    mid, half = scales_of(q, p, q.codes.device)
    x = mid + half * p.codebook.to(q.codes.device).float()[q.codes.long()]
    if p.signs is not None:
        x = rotate_heads(x, p.signs.to(x.device).float(), inverse=True)
    return scatter_outliers(x, q.out_idx, q.out_val)


def scatter_outliers(x: torch.Tensor, out_idx: torch.Tensor, out_val: torch.Tensor) -> torch.Tensor:
    """Write the sparse outliers over x (t, hkv, e) (in x's dtype): empty slots (-1) go to a scratch column that is
    dropped."""
    if out_idx.shape[-1] == 0:
        return x
    t = x.shape[0]
    flat = torch.cat([x.reshape(t, -1), x.new_zeros(t, 1)], 1)
    n = flat.shape[1] - 1
    idx = out_idx.long()
    flat.scatter_(1, torch.where(idx >= 0, idx, n), out_val.to(x.dtype))
    return flat[:, :n].reshape(x.shape)


def fake_quant_kv_ref(x: torch.Tensor, p: KVParams) -> torch.Tensor:
    """dequantize(quantize(x)) in x's shape (..., hkv, e) and dtype."""
    t = x.reshape(-1, *x.shape[-2:])
    return dequantize_kv_ref(quantize_kv_ref(t, p), p).reshape(x.shape).to(x.dtype)


# ---------------------------------------------------------------------------------------------------------------
# storage: codes packed at their bit width
# ---------------------------------------------------------------------------------------------------------------
# Layout (QuantKVState and the decode kernels), one (token, kv head) row of e codes a unit, padded to whole bytes:
#     bits 4: two a byte, channel 2j in the low nibble of byte j, 2j + 1 in the high one: ceil(e/2) bytes
#     bits 2: four a byte, channel 4j + i at bits 2i of byte j: ceil(e/4) bytes
#     bits 3: two bit planes: the codes' low 2 bits as a 2-bit row (ceil(e/4) bytes), then their bit 2 as a 1-bit
#             row (channel 8j + i at bit i of byte ceil(e/4) + j; ceil(e/8) bytes)
#     bits 8: one a byte (codebooks of more than 16 entries)
# Why planes for 3 bits (rather than a little-endian bit string, 8 codes a 24-bit field): the fast kernel reads
# a tile's codes as contiguous byte vectors and looks them up by byte permutes; with planes a 3-bit tile is a 2-bit
# tile and a 1-bit one, both whole bytes at the same channel offsets, where 24-bit fields had to be reassembled
# from words and their 8 outputs interleaved through three levels of joins (layout conversions in shared memory:
# 3-bit decoded no faster than float16 while 2-bit was 1.6x faster; with planes 1.46x at 128K tokens, H100).
# Rows are padded per head, not per token, so that a token's write replaces whole bytes (no read-modify-write
# of a neighbour's bits).
def code_bits(levels: int) -> int:
    """Bits a code of a codebook of ``levels`` entries takes in the cache: 2, 3 or 4 (<= 4 / 8 / 16 entries), else 8."""
    return next(b for b in (2, 3, 4, 8) if levels <= 2 ** b)


def packed_bytes(e: int, bits: int) -> int:
    """Bytes of one packed row of e codes (3 bits: the two planes)."""
    if bits == 3:
        return packed_bytes(e, 2) + packed_bytes(e, 1)
    return (e * bits + 7) // 8


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., e) uint8 codes < 2^bits → (..., packed_bytes(e, bits)) uint8 (the layout above)."""
    if bits == 8:
        return codes
    if bits == 3:
        return torch.cat([pack_codes(codes & 3, 2), pack_codes(codes >> 2, 1)], -1)
    per = 8 // bits  # codes a byte
    x = torch.nn.functional.pad(codes, (0, -codes.shape[-1] % per)).long().unflatten(-1, (-1, per))
    return (x << torch.arange(per, device=codes.device) * bits).sum(-1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, e: int) -> torch.Tensor:
    """(..., packed_bytes(e, bits)) → (..., e) uint8: the inverse of ``pack_codes``."""
    if bits == 8:
        return packed
    if bits == 3:
        n = packed_bytes(e, 2)
        return unpack_codes(packed[..., :n], 2, e) | unpack_codes(packed[..., n:], 1, e) << 2
    per = 8 // bits
    x = (packed.long()[..., None] >> torch.arange(per, device=packed.device) * bits) & (2 ** bits - 1)
    return x.flatten(-2)[..., :e].to(torch.uint8)


# ---------------------------------------------------------------------------------------------------------------
# decode: one query token per row over a quantized cache (the Triton twins: ssmq.kernels.kv_decode)
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class KVSideView:
    """One side of a quantized cache as the decode kernels read it (s slots, L positions, S sink tokens):
    codes (s, L, hkv, ceil(e·bits/8)) uint8, ``bits`` (2, 3 or 4) a code (``pack_codes``); codebook (C,) float32;
    mid, half: per-token (s, L, hkv) float16, or per-channel (hkv, e) float32 when ``per_token`` is False;
    out_idx, out_val (s, L, k), a token's slots ordered (``order_slots``; the kernels' speed assumes it); sink
    (s, S, hkv, e) (its last dim gives e). The codes under the outliers must be as ``outlier_codes`` leaves them:
    the kernels take x̂ there from that rule, while the reference never reads them."""

    codes: torch.Tensor
    codebook: torch.Tensor
    mid: torch.Tensor
    half: torch.Tensor
    per_token: bool
    out_idx: torch.Tensor
    out_val: torch.Tensor
    sink: torch.Tensor
    bits: int

    def dequantize(self, slots: torch.Tensor, end: int) -> torch.Tensor:
        """(b, T, hkv, e) float32 of the rows ``slots`` up to ``end``: codes, scales, outliers, then the sink."""
        codes = unpack_codes(self.codes[slots, :end], self.bits, self.sink.shape[-1]).long()  # (b, T, hkv, e)
        if self.per_token:
            mid, half = self.mid[slots, :end].float()[..., None], self.half[slots, :end].float()[..., None]
        else:
            mid, half = self.mid.float(), self.half.float()
        x = mid + half * self.codebook.float()[codes]
        b, t = x.shape[:2]
        k = self.out_idx.shape[-1]
        x = scatter_outliers(x.reshape(b * t, *x.shape[2:]), self.out_idx[slots, :end].reshape(b * t, k),
                             self.out_val[slots, :end].reshape(b * t, k)).reshape(x.shape)
        s = min(self.sink.shape[1], end)
        x[:, :s] = self.sink[slots, :s].float()
        return x

    def paged(self, block_table: torch.Tensor, block_size: int) -> KVSideView:
        """The inverse of ``gathered``: this side's s rows (s, M·B, ...) as block pools of 1 + s·M blocks, row i's
        j-th block at block_table[i, j] (a permutation of 1 .. s·M); block 0, the null block, holds row 0's first
        block (stale contents, as a pool's free blocks have). Tests and benchmarks build paged caches with it."""
        s, m = block_table.shape

        def pool(t):
            out = t.new_empty(1 + s * m, block_size, *t.shape[2:])
            out[0] = t[0, :block_size]
            out[block_table.flatten()] = t[:, :m * block_size].reshape(s * m, block_size, *t.shape[2:])
            return out

        mid, half = (pool(self.mid), pool(self.half)) if self.per_token else (self.mid, self.half)
        return KVSideView(pool(self.codes), self.codebook, mid, half, self.per_token, pool(self.out_idx),
                          pool(self.out_val), self.sink, self.bits)

    def gathered(self, block_table: torch.Tensor, slots: torch.Tensor) -> KVSideView:
        """The rows ``slots`` (b,) of a paged side as a contiguous one of b rows (slots then ``arange(b)``): the
        per-token buffers are block pools (N, B, ...), token t of row i at block block_table[slots[i], t // B],
        offset t % B (``ssmq.models.paged_kv``); each row's blocks are copied in order, (b, M·B, ...). What the CPU
        reference and the general kernel (``ssmq.kernels.kv_decode``) read of a paged cache (the fast kernel reads
        the pools in place)."""
        rows = block_table[slots]  # (b, M)
        pages = lambda t: t[rows].flatten(1, 2)  # noqa: E731
        mid, half = (pages(self.mid), pages(self.half)) if self.per_token else (self.mid, self.half)
        return KVSideView(pages(self.codes), self.codebook, mid, half, self.per_token, pages(self.out_idx),
                          pages(self.out_val), self.sink[slots], self.bits)


def quant_kv_decode_ref(q: torch.Tensor, slots: torch.Tensor, kv_lens: torch.Tensor, k: KVSideView, v: KVSideView,
                        rotary_dim: int = 0, theta: float = 10000.0, softmax_scale: float | None = None):
    """Decode attention over a quantized cache: q (b, hq, e) post-RoPE queries of the rows ``slots`` (b,), which
    hold ``kv_lens`` (b,) tokens (the new one included); keys stored before RoPE when ``rotary_dim`` > 0 (rotated
    after dequantization); a paged cache is read through ``KVSideView.gathered``. Returns (b, hq, e)
    float32: the dequantized cache, then float attention. Reads the longest of ``kv_lens`` on the host, except while
    a CUDA graph is being captured: then all L positions (masked)."""
    from ssmq.ops.attention import attention_ref

    end = read_extent(kv_lens, k.codes.shape[1])
    keys, values = quant_kv_read_ref(k, slots, end, rotary_dim, theta), quant_kv_read_ref(v, slots, end)
    return attention_ref(q.float()[:, None], keys, values, kv_lens, softmax_scale)[:, 0]


def quant_kv_read_ref(side: KVSideView, slots: torch.Tensor, end: int, rotary_dim: int = 0, theta: float = 10000.0,
                      dtype=torch.float32) -> torch.Tensor:
    """One side of a quantized cache, the rows ``slots`` (b,) up to ``end``, as (b, end, hkv, e) in ``dtype``:
    dequantized (``KVSideView.dequantize``), then the first ``rotary_dim`` channels rotated by their positions
    (keys cached before RoPE; 0: as stored), in float32."""
    from ssmq.ops.attention import rope_ref

    x = side.dequantize(slots, end)
    return rope_ref(x, torch.arange(end, device=x.device).expand(x.shape[0], end), rotary_dim, theta).to(dtype)
