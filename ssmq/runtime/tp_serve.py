"""Serving over tensor parallelism: rank 0 runs the engine and the HTTP server; every other rank follows.

Each model call of an engine step (reset slots, prefill chunks, decode a batch, assign KV blocks) is broadcast by
rank 0 as a header ``[op, n_a, n_b]`` and one int64 payload (the slots and the chunks' ids, or the tokens and
slots), then run on every rank: the sharded model's own all-reduces keep the ranks in step, and every rank ends
with the same logits (lm_head is replicated), of which rank 0 samples. ``STOP`` ends the followers when the server
shuts down.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ssmq.models.cache import ids_on_device

RESET, PREFILL, PREFILL_ALL, DECODE, ASSIGN, STOP = range(1, 7)


class BroadcastRunner:
    """Rank 0's runner: tells the followers each call, then makes it on its own shard."""

    def __init__(self, local, group=None):
        self.local, self.group = local, group
        self.cache, self.device, self.kv_blocks = local.cache, local.device, local.kv_blocks

    def _send(self, op: int, payload: torch.Tensor | list[int] | None = None, n_a: int = 0) -> None:
        """The header and the payload (a device tensor, or Python ints), moved to the device without waiting for its
        queue: a pageable copy would wait for the step in flight, and under overlap rank 0 launches before reading
        back."""
        if isinstance(payload, list):
            payload = ids_on_device(payload, self.device)
        n = 0 if payload is None else payload.numel()
        dist.broadcast(ids_on_device([op, n_a, n - n_a], self.device), 0, group=self.group)
        if n:
            dist.broadcast(payload.to(dtype=torch.long).contiguous(), 0, group=self.group)

    def reset(self, slots: list[int]) -> None:
        self._send(RESET, list(slots), len(slots))
        self.local.reset(slots)

    def prefill(self, ids: torch.Tensor, slots: list[int], all_logits: bool) -> torch.Tensor:
        self._send(PREFILL_ALL if all_logits else PREFILL, torch.cat([ids_on_device(list(slots), ids.device),
                                                                      ids.flatten()]), len(slots))
        return self.local.prefill(ids, slots, all_logits)

    def decode(self, tokens: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        self._send(DECODE, torch.cat([tokens, slots]), tokens.numel())
        return self.local.decode(tokens, slots)

    def assign_blocks(self, slot: int, start: int, blocks: list[int]) -> None:
        self._send(ASSIGN, [slot, start, *blocks], 2)
        self.local.assign_blocks(slot, start, blocks)

    def stop(self) -> None:
        self._send(STOP)


@torch.inference_mode()
def follow(local, group=None) -> None:
    """A follower rank's loop: run what rank 0 broadcasts until STOP."""
    device = local.device
    while True:
        head = torch.empty(3, dtype=torch.long, device=device)
        dist.broadcast(head, 0, group=group)
        op, n_a, n_b = head.tolist()
        if op == STOP:
            return
        payload = torch.empty(n_a + n_b, dtype=torch.long, device=device)
        if n_a + n_b:
            dist.broadcast(payload, 0, group=group)
        a, b = payload[:n_a], payload[n_a:]
        if op == RESET:
            local.reset(a.tolist())
        elif op in (PREFILL, PREFILL_ALL):
            local.prefill(b.view(n_a, -1), a.tolist(), op == PREFILL_ALL)
        elif op == DECODE:
            local.decode(a, b)
        elif op == ASSIGN:
            local.assign_blocks(int(a[0]), int(a[1]), b.tolist())
