"""Paged KV state: an attention layer's keys and values in fixed-size blocks, found through a block table.

Glossary: s cache slots, N blocks in the pool, B tokens per block, M blocks per sequence at most (max_seqlen / B),
b rows served, T tokens read, hkv key/value heads, e head dim.

    pool k, v:    (N, B, hkv, e), shared by every slot of one layer
    BlockTable:   rows (s, M) long on the device, shared by every attention layer of the model; token t of
                  slot i sits at block rows[i, t // B], offset t % B

Blocks are handed out as sequences grow (``ssmq.runtime.kv_blocks.BlockAllocator`` on the host, written here
with ``BlockTable.assign``), so a slot holds KV for the tokens it has, not for max_seqlen. Block 0 is the null
block: entries not assigned point there, so the padding rows of a CUDA graph and positions past a row's end
read and write it, never another sequence's block (attention masks what they read by ``kv_lens``).
Same ops as ``KVState`` (append, read, decode, reset, nbytes): the attention layer does not know which it has.
"""

from __future__ import annotations

import torch

from ssmq import kernels
from ssmq.errors import SSMQError
from ssmq.models.state import RopeAtRead, StateFormat, kernel_decodes, fill_rows
from ssmq.ops.attention import check_fits, read_extent


class BlockTable:
    def __init__(self, max_batch: int, max_seqlen: int, block_size: int, num_blocks: int, device):
        if block_size < 1 or num_blocks < 2:
            raise SSMQError(f"a paged KV cache needs >= 2 blocks of >= 1 token, got {num_blocks} of {block_size}")
        self.block_size, self.num_blocks = block_size, num_blocks
        self.rows = torch.zeros(max_batch, -(-max_seqlen // block_size), dtype=torch.long, device=device)

    def assign(self, slot: int, start: int, blocks: list[int]) -> None:
        """Blocks ``blocks`` hold the tokens of ``slot`` from block index ``start`` on."""
        if blocks:
            ids = torch.tensor(blocks, dtype=torch.long)
            if self.rows.is_cuda:  # pinned, not waiting: a plain copy would wait for the decode step in flight
                ids = ids.pin_memory()
            self.rows[slot, start:start + len(blocks)].copy_(ids, non_blocking=True)

    def reset(self, slots=None) -> None:
        fill_rows(self.rows, slots)

    def gather(self, pool: torch.Tensor, slots: torch.Tensor, end: int) -> torch.Tensor:
        """The first ``end`` tokens of the rows ``slots`` (b,) of a pool (N, B, ...), their blocks copied in order:
        (b, ceil(end / B)·B, ...) (whole blocks; the tokens past ``end`` are whatever the last block holds)."""
        n = -(-end // self.block_size)
        return pool[self.rows[slots, :n]].flatten(1, 2)

    def locate(self, slots: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset) of the tokens at ``positions`` (b, l) of the rows ``slots`` (b,)."""
        index = (positions // self.block_size).clamp(max=self.rows.shape[1] - 1)
        return self.rows[slots[:, None].expand_as(positions), index], positions % self.block_size


class PagedKVState:
    format = StateFormat.PAGED

    def __init__(self, k: torch.Tensor, v: torch.Tensor, table: BlockTable, max_seqlen: int,
                 rope: RopeAtRead | None = None):
        self.k, self.v, self.table, self.max_seqlen, self.rope = k, v, table, max_seqlen, rope
        self.plan = None  # the layer's LayerPlan, set by the attention layer that allocates the cache

    @classmethod
    def allocate(cls, table: BlockTable, max_seqlen: int, kv_heads: int, head_dim: int, dtype, device,
                 rope: RopeAtRead | None = None) -> PagedKVState:
        shape = (table.num_blocks, table.block_size, kv_heads, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device),
                   table, max_seqlen, rope)

    @property
    def keys_before_rope(self) -> bool:
        return self.rope is not None

    def append(self, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v (b, l, hkv, e) at ``positions`` (b, l) of the rows ``slots``, into their blocks."""
        check_fits(positions, self.max_seqlen)
        block, offset = self.table.locate(slots, positions)
        self.k[block, offset] = k.to(self.k.dtype)
        self.v[block, offset] = v.to(self.v.dtype)

    def read(self, slots: torch.Tensor, kv_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (post-RoPE) and values of the rows ``slots``: (b, T, hkv, e), valid up to ``kv_lens`` (b,).

        T = the longest of ``kv_lens`` rounded up to whole blocks (max_seqlen while a CUDA graph is captured)."""
        end = read_extent(kv_lens, self.max_seqlen)
        keys, values = self.table.gather(self.k, slots, end), self.table.gather(self.v, slots, end)
        if self.rope is not None:
            b, t = keys.shape[:2]
            keys = kernels.rope(keys, torch.arange(t, device=keys.device).expand(b, t), self.rope.rotary_dim,
                                self.rope.theta)
        return keys, values

    def decode(self, q: torch.Tensor, slots: torch.Tensor, kv_lens: torch.Tensor) -> torch.Tensor | None:
        """``KVState.decode`` over blocks: the plan's kernel reads the rows' blocks in place through the block table
        (a gathered copy of their prefix would cost about what the kernel does); None where the plan has none (the
        caller runs ``attention_ref`` over ``read``)."""
        run = self.plan.decode
        return None if run is None else run(q, slots, kv_lens, self.k, self.v, block_table=self.table.rows)

    def prefill(self, q: torch.Tensor, slots: torch.Tensor, kv_lens: torch.Tensor) -> torch.Tensor | None:
        """``KVState.prefill`` over blocks, read in place through the block table."""
        if not kernel_decodes(self.k, self.rope):
            return None
        return kernels.prefill_attention(q, self.k, self.v, kv_lens, slots=slots, block_table=self.table.rows)

    def reset(self, slots=None) -> None:
        """Forget the rows ``slots``: their table entries go back to the null block (the allocator frees blocks)."""
        self.table.reset(slots)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v)) + self.table.rows.numel() * 8
