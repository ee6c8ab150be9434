"""Quantized KV state: an attention layer's keys and values as codes, scales and sparse outliers.

Glossary: s cache slots, L max_seqlen, b rows served, l new tokens, T tokens read, hkv kv heads, e head dim,
e' = ``packed_bytes(e, bits)`` bytes of a packed row (``ssmq.ops.kv_quant.pack_codes``: bits 2, 3, 4 for codebooks of
<= 4 / 8 / 16 entries, else 8), k outlier slots, S sink tokens.

Per side (keys, values), ``QuantSide`` holds
    codes     (s, L, hkv, e') uint8    nearest codebook entries (``ssmq.ops.kv_quant``), packed at ``bits`` a code
    mid, half (s, L, hkv) float16      per-token scales (per_token sides only; offline scales live in the quantizer)
    out_idx   (s, L, k) int16, out_val (s, L, k) float16    the token's sparse outliers
    sink      (s, S, hkv, e) float     the first S tokens, exactly (attention sink)
Paged (a ``BlockTable``, as ``ssmq.models.paged_kv``): the per-token buffers are block pools, (N, B, ...) in place
of (s, L, ...), shared by the slots; token t of slot i at block table.rows[i, t // B], offset t % B. The sink stays
per slot. The kernels (append, decode) read and write the pools in place through the table.
``append`` quantizes the new tokens as they are written (prefill writes the quantized cache directly), with static
shapes and no host read (a CUDA graph captures a decode step: ``append`` then ``decode``);
``read`` dequantizes the served rows (keys before RoPE are rotated after), so attention over a read equals
attention over ``KVQuantizer.fake_quant`` of the same keys and values. Same ops as ``KVState``.
"""

from __future__ import annotations

import torch

from ssmq import kernels
from ssmq.models.state import RopeAtRead, StateFormat, fill_rows
from ssmq.ops.attention import check_fits, read_extent
from ssmq.ops.kv_quant import (KVSideView, QuantizedKV, code_bits, dequantize_kv_ref, pack_codes, packed_bytes,
                               quantize_kv_ref, scales_of, unpack_codes)


class QuantSide:
    def __init__(self, quantizer, which: str, max_batch: int, max_seqlen: int, dtype, device, table=None):
        self.q, self.which, self.table = quantizer, which, table
        side, hkv, e = quantizer.side(which), quantizer.hkv, quantizer.e
        self.bits = code_bits(side.levels)
        z = dict(device=device)
        lead = (max_batch, max_seqlen) if table is None else (table.num_blocks, table.block_size)
        self.codes = torch.zeros(*lead, hkv, packed_bytes(e, self.bits), dtype=torch.uint8, **z)
        per_token = side.granularity == "per_token"
        self.mid = torch.zeros(*lead, hkv, dtype=torch.float16, **z) if per_token else None
        self.half = torch.ones(*lead, hkv, dtype=torch.float16, **z) if per_token else None
        k = quantizer.outlier_slots(which)
        self.out_idx = torch.full((*lead, k), -1, dtype=torch.int16, **z)
        self.out_val = torch.zeros(*lead, k, dtype=torch.float16, **z)
        self.sink = torch.zeros(max_batch, quantizer.kv.sink, hkv, e, dtype=dtype, **z)
        self._offline = None  # (lo, hi, their versions, mid, half): ``view``'s offline scales, derived once

    @property
    def block_table(self) -> torch.Tensor | None:
        return None if self.table is None else self.table.rows

    def _locate(self, slots: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Indices (b, l) of the per-token buffers' first two dims for ``positions`` (b, l) of the rows ``slots``."""
        if self.table is not None:
            return self.table.locate(slots, positions)
        return slots[:, None].expand_as(positions), positions

    def _prefix(self, t: torch.Tensor, slots: torch.Tensor, end: int) -> torch.Tensor:
        """The first ``end`` tokens of the rows ``slots`` of a per-token buffer: (b, end, ...)."""
        if self.table is None:
            return t[slots, :end]
        return self.table.gather(t, slots, end)[:, :end]

    def buffers(self) -> list[torch.Tensor]:
        return [t for t in (self.codes, self.mid, self.half, self.out_idx, self.out_val, self.sink) if t is not None]

    def write(self, slots: torch.Tensor, positions: torch.Tensor, x: torch.Tensor) -> None:
        """x (b, l, hkv, e) at ``positions`` (b, l) of the rows ``slots`` (b,). Static shapes, no host read of a
        device value (a CUDA graph captures it): every buffer is written by index, the sink by ``write_sink``; on
        CUDA, by one fused kernel (``kernels.quant_kv_append``, the same bytes; ``KernelPolicy.kv_fused_append``)."""
        p = self.q.params(self.which)
        if kernels.quant_kv_append(x, slots, positions, p, self.bits, self.codes, self.mid, self.half, self.out_idx,
                                   self.out_val, self.sink, block_table=self.block_table):
            return
        q = quantize_kv_ref(x.reshape(-1, *x.shape[-2:]), p)
        lead = x.shape[:2]
        rows, at = self._locate(slots, positions)
        codes = pack_codes(q.codes, self.bits)
        self.codes[rows, at] = codes.reshape(*lead, *codes.shape[1:])
        if self.mid is not None:
            self.mid[rows, at] = q.mid.reshape(*lead, -1)
            self.half[rows, at] = q.half.reshape(*lead, -1)
        self.out_idx[rows, at] = q.out_idx.reshape(*lead, -1)
        self.out_val[rows, at] = q.out_val.reshape(*lead, -1)
        self.write_sink(slots, positions, x)

    def write_sink(self, slots: torch.Tensor, positions: torch.Tensor, x: torch.Tensor) -> None:
        """The tokens of x (b, l, hkv, e) at positions < S, exactly, into the sink of the rows ``slots``: each sink
        position takes the token written there, or keeps its value (a gather and a select over (b, S, hkv, e), in
        place of a mask over the positions, whose boolean indexing would read its count on the host)."""
        S = self.sink.shape[1]
        if not S:
            return
        hit = positions[:, :, None] == torch.arange(S, device=positions.device)  # (b, l, S)
        src = hit.long().argmax(1)  # (b, S): the token at each sink position (0 where none: not used)
        new = x.gather(1, src[:, :, None, None].expand(-1, -1, *x.shape[2:])).to(self.sink.dtype)
        self.sink[slots] = torch.where(hit.any(1)[:, :, None, None], new, self.sink[slots])

    def quantized(self, slots: torch.Tensor, end: int) -> QuantizedKV:
        """The rows ``slots`` up to ``end`` as a QuantizedKV of (b·T) tokens (codes unpacked)."""
        codes = unpack_codes(self._prefix(self.codes, slots, end), self.bits, self.q.e)
        n = len(slots) * end
        flat = lambda t: None if t is None else self._prefix(t, slots, end).reshape(n, *t.shape[2:])  # noqa: E731
        return QuantizedKV(codes.reshape(-1, *codes.shape[2:]), flat(self.mid), flat(self.half), flat(self.out_idx),
                           flat(self.out_val))

    def read(self, slots: torch.Tensor, end: int, dtype) -> torch.Tensor:
        """(b, T, hkv, e): dequantized, the sink positions exact."""
        x = dequantize_kv_ref(self.quantized(slots, end), self.q.params(self.which))
        x = x.reshape(len(slots), end, *x.shape[1:]).to(dtype)
        s = min(self.sink.shape[1], end)
        if s:
            x[:, :s] = self.sink[slots, :s].to(dtype)
        return x

    def view(self) -> KVSideView | None:
        """The buffers as the decode kernels read them; None for formats they do not take (8-bit codes, rotation)."""
        p = self.q.params(self.which)
        if self.bits > 4 or p.signs is not None:
            return None
        if self.mid is not None:
            mid, half = self.mid, self.half
        else:
            mid, half = self._offline_scales(p)
        return KVSideView(self.codes, p.codebook, mid, half, self.mid is not None, self.out_idx, self.out_val,
                          self.sink, self.bits)

    def _offline_scales(self, p) -> tuple[torch.Tensor, torch.Tensor]:
        """Offline scales as the reference derives them, broadcast to (hkv, e) float32: the same tensors while the
        quantizer's range buffers are (same objects, unmodified). A decode step builds every layer's view, and fresh
        tensors each time would cost two copies a layer and a miss of ``kv_decode_warp``'s per-side scale table."""
        c = self._offline
        if c is None or c[0] is not p.lo or c[1] is not p.hi or c[2] != (p.lo._version, p.hi._version):
            mid, half = (t.expand(self.q.hkv, self.q.e).float().contiguous() for t in scales_of(None, p, None))
            self._offline = c = (p.lo, p.hi, (p.lo._version, p.hi._version), mid, half)
        return c[3], c[4]

    def reset(self, slots) -> None:
        fill_rows(self.sink, slots)
        if self.table is not None:  # the slots' blocks go back to the pool: a token is written before it is read
            return
        for t in self.buffers():
            fill_rows(t, slots)
        fill_rows(self.out_idx, slots, -1)
        if self.half is not None:
            fill_rows(self.half, slots, 1)


class QuantKVState:
    """Keys and values of one attention layer in a quantized format (module docstring); ``quantizer`` is the
    layer's calibrated ``KVQuantizer`` (its buffers are read, not copied: allocate after moving the model);
    ``table``: a ``BlockTable`` for a paged cache (the buffers are block pools), None for rows of max_seqlen."""

    format = StateFormat.QUANT

    def __init__(self, quantizer, max_batch: int, max_seqlen: int, dtype, device, rope: RopeAtRead | None = None,
                 table=None):
        self.quantizer, self.rope, self.dtype, self.max_seqlen, self.table = quantizer, rope, dtype, max_seqlen, table
        self.k = QuantSide(quantizer, "keys", max_batch, max_seqlen, dtype, device, table)
        self.v = QuantSide(quantizer, "values", max_batch, max_seqlen, dtype, device, table)

    @property
    def keys_before_rope(self) -> bool:
        return self.rope is not None

    def append(self, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize and write k, v (b, l, hkv, e) at ``positions`` (b, l) of the rows ``slots`` (b,). The writes have
        static shapes and read nothing on the host; the bound check reads the last position, so it is skipped while
        a CUDA graph is being captured (the graph runner's caller keeps the lengths within the cache, as KVState)."""
        check_fits(positions, self.max_seqlen)
        self.k.write(slots, positions, k)
        self.v.write(slots, positions, v)

    def read(self, slots: torch.Tensor, kv_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (post-RoPE) and values of the rows ``slots``: (b, T, hkv, e) each, valid up to ``kv_lens`` (b,).
        Dequantizes the whole prefix (prefill, and the formats without a decode kernel): T = the longest of
        ``kv_lens`` (a host read), or L while a CUDA graph is being captured (static shapes; the mask hides the rest).
        A decode step reads through ``decode`` instead, which reads no length on the host."""
        end = read_extent(kv_lens, self.max_seqlen)
        viewed = self._read_views(slots, end)
        if viewed is not None:
            return viewed
        keys, values = self.k.read(slots, end, self.dtype), self.v.read(slots, end, self.dtype)
        if self.rope is not None:
            keys = kernels.rope(keys, torch.arange(end, device=keys.device).expand(keys.shape[0], end),
                                self.rope.rotary_dim, self.rope.theta)
        return keys, values

    def prefill(self, q: torch.Tensor, slots: torch.Tensor, kv_lens: torch.Tensor) -> torch.Tensor | None:
        """``KVState.prefill`` over the quantized cache: each side read once by the dequantizing kernel
        (``kernels.quant_kv_read``, keys rotated), up to each row's length, then the prefill kernel over the rows;
        on CUDA for float16 / bfloat16 models and the formats the kernels' view takes, else None (the caller reads
        the prefix, every position, and attends with the reference)."""
        if not q.is_cuda or q.dtype != self.dtype or q.dtype == torch.float32:
            return None
        viewed = self._read_views(slots, read_extent(kv_lens, self.max_seqlen), kv_lens)
        return None if viewed is None else kernels.prefill_attention(q, *viewed, kv_lens)

    def _read_views(self, slots, end: int, kv_lens=None):
        """Keys (rotated) and values of the rows ``slots`` up to ``end`` through the kernels' view, one dequantizing
        pass a side (``kernels.quant_kv_read``; ``kv_lens``: a row's tokens past its length may be left unwritten);
        None for the formats without a view."""
        k, v, r = self.k.view(), self.v.view(), self.rope
        if k is None or v is None:
            return None
        table = self.k.block_table
        keys = kernels.quant_kv_read(k, slots, end, r.rotary_dim if r else 0, r.theta if r else 1e4, self.dtype,
                                     table, kv_lens)
        return keys, kernels.quant_kv_read(v, slots, end, dtype=self.dtype, block_table=table, kv_lens=kv_lens)

    def decode(self, q: torch.Tensor, slots: torch.Tensor, kv_lens: torch.Tensor) -> torch.Tensor | None:
        """Attention of one query per row, q (b, hq, e) post-RoPE, over the rows' quantized cache (LUT kernels on
        CUDA, ``quant_kv_decode_ref`` elsewhere): (b, hq, e) float32; None when the format has no decode kernel.
        The kernels take ``slots`` and ``kv_lens`` on the device: no host sync, so a CUDA graph captures the step."""
        k, v = self.k.view(), self.v.view()
        if k is None or v is None:
            return None
        r = self.rope
        return kernels.quant_kv_decode(q, slots, kv_lens, k, v, r.rotary_dim if r else 0, r.theta if r else 1e4,
                                       block_table=self.k.block_table)

    def reset(self, slots=None) -> None:
        self.k.reset(slots)
        self.v.reset(slots)
        if self.table is not None:  # the rows' entries back to the null block (the allocator frees the blocks)
            self.table.reset(slots)

    def nbytes(self) -> int:
        table = 0 if self.table is None else self.table.rows.numel() * 8
        return sum(t.numel() * t.element_size() for side in (self.k, self.v) for t in side.buffers()) + table
