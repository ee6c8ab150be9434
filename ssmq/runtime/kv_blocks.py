"""KV block allocation for hybrid models: which cache blocks each slot holds, and admission by free blocks.

A sequence's keys and values live in fixed-size blocks taken on demand as it grows (block tables, as paged
attention does); this allocator hands out block ids on the host, the runner writes them into the device block
table (``ssmq.models.paged_kv``). Admission reserves the blocks a request can ever need (prompt + max_tokens), so
a running sequence never finds the pool empty: no preemption and no out-of-memory; a request that does not fit
now waits in the queue. Block 0 is never handed out: unassigned table entries point there (see paged_kv).
"""

from __future__ import annotations


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2 or block_size < 1:
            raise ValueError(f"need >= 2 blocks of >= 1 token, got {num_blocks} of {block_size}")
        self.block_size, self.total = block_size, num_blocks - 1  # block 0 is the null block
        self._free = list(range(num_blocks - 1, 0, -1))
        self._owned: dict[int, list[int]] = {}
        self._promised: dict[int, int] = {}  # blocks reserved at admission, not taken yet
        self._reserved = 0

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    @property
    def used(self) -> int:
        return self.total - len(self._free)

    def can_admit(self, n_tokens: int) -> bool:
        return self.blocks_for(n_tokens) <= len(self._free) - self._reserved

    def admit(self, slot: int, n_tokens: int) -> None:
        """Reserve the blocks of a sequence of at most ``n_tokens`` in ``slot`` (call ``can_admit`` first)."""
        need = self.blocks_for(n_tokens)
        self._owned[slot], self._promised[slot] = [], need
        self._reserved += need

    def grow(self, slot: int, length: int) -> tuple[int, list[int]]:
        """Blocks for the first ``length`` tokens of ``slot``: (index in its table of the first new block, new ids)."""
        owned = self._owned[slot]
        start, need = len(owned), self.blocks_for(length) - len(owned)
        if need <= 0:
            return start, []
        if need > self._promised[slot]:
            raise RuntimeError(f"slot {slot} grew past the {start + self._promised[slot]} blocks it reserved")
        new = [self._free.pop() for _ in range(need)]
        owned += new
        self._promised[slot] -= need
        self._reserved -= need
        return start, new

    def release(self, slot: int) -> None:
        """The sequence in ``slot`` ended: its blocks and what it still had reserved go back to the pool."""
        self._free += self._owned.pop(slot, [])
        self._reserved -= self._promised.pop(slot, 0)
