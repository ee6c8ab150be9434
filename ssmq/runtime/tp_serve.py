"""Serving over tensor parallelism: rank 0 runs the engine and the HTTP server; every other rank follows.

Each model call of an engine step (reset slots, prefill chunks, decode a batch, assign KV blocks) is announced by
rank 0 and then run on every rank: the sharded model's own all-reduces keep the ranks in step, and every rank ends
with the same logits (lm_head is replicated), of which rank 0 samples. ``STOP`` ends the followers when the server
shuts down.

Two channels:
  - the *control* channel, a gloo group on the host: a header ``[op, n_host, n_device, split]`` and the call's
    Python ints (slots, KV block ids) in one message of ``HEADER + INLINE`` int64 (a second one for more ints);
  - the model's group (NCCL on GPUs): the call's device tensors (a prefill's token ids, a decode step's sampled
    tokens and slots), broadcast on the device's stream.
A follower thus learns the next call without waiting for its device: a header read off the device would wait for
the step in flight, and the follower would launch each step only after the previous one ended, while rank 0
(whose engine launches step n + 1 before reading step n back) waits in the step's first all-reduce. The control
group never times out: a follower waits on it while the server is idle, and a rank that dies closes its
connections, which ends the wait at once (torchrun then stops the job).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

RESET, PREFILL, PREFILL_ALL, DECODE, ASSIGN, STOP = range(1, 7)
HEADER = 4  # op, n_host, n_device, split (decode: sampled tokens before slots in the device payload)
INLINE = 256  # Python ints carried in the header's message; more take a second message
CONTROL_TIMEOUT = timedelta(days=365)


def control_group():
    """The host-side group of the header messages (collective: every rank calls it, in the same order)."""
    return dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)


class BroadcastRunner:
    """Rank 0's runner: tells the followers each call, then makes it on its own shard.

    ``group``: the model's process group (default: the world); ``control``: the header group (default: a new
    ``control_group()``, which every follower's ``follow`` creates too)."""

    def __init__(self, local, group=None, control=None):
        self.local, self.group = local, group
        self.control = control_group() if control is None else control
        self.cache, self.device, self.kv_blocks = local.cache, local.device, local.kv_blocks
        self._msg = torch.zeros(HEADER + INLINE, dtype=torch.long)

    def _send(self, op: int, host: list[int] = (), payload: torch.Tensor | None = None, split: int = 0) -> None:
        """The header with ``host`` ints on the control channel (no device work), then ``payload`` (a device
        tensor, taken as int64) on the model's group, queued on the device's stream without waiting for it."""
        n_dev = 0 if payload is None else payload.numel()
        msg = self._msg
        msg[:HEADER] = torch.tensor([op, len(host), n_dev, split])
        inline = list(host[:INLINE])
        msg[HEADER:HEADER + len(inline)] = torch.tensor(inline, dtype=torch.long)
        dist.broadcast(msg, 0, group=self.control)
        if len(host) > INLINE:
            dist.broadcast(torch.tensor(host[INLINE:], dtype=torch.long), 0, group=self.control)
        if n_dev:
            dist.broadcast(payload.to(dtype=torch.long).contiguous(), 0, group=self.group)

    def reset(self, slots: list[int]) -> None:
        self._send(RESET, list(slots))
        self.local.reset(slots)

    def prefill(self, ids: torch.Tensor, slots: list[int], all_logits: bool) -> torch.Tensor:
        self._send(PREFILL_ALL if all_logits else PREFILL, list(slots), ids.flatten())
        return self.local.prefill(ids, slots, all_logits)

    def decode(self, tokens: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        self._send(DECODE, (), torch.cat([tokens, slots]), tokens.numel())
        return self.local.decode(tokens, slots)

    def assign_blocks(self, slot: int, start: int, blocks: list[int]) -> None:
        self._send(ASSIGN, [slot, start, *blocks])
        self.local.assign_blocks(slot, start, blocks)

    def stop(self) -> None:
        self._send(STOP)


@torch.inference_mode()
def follow(local, group=None, control=None) -> None:
    """A follower rank's loop: run what rank 0 announces until STOP (``group``, ``control``: as
    ``BroadcastRunner``'s)."""
    control = control_group() if control is None else control
    msg = torch.empty(HEADER + INLINE, dtype=torch.long)
    while True:
        dist.broadcast(msg, 0, group=control)
        op, n_host, n_dev, split = msg[:HEADER].tolist()
        host = msg[HEADER:HEADER + min(n_host, INLINE)].tolist()
        if n_host > INLINE:
            rest = torch.empty(n_host - INLINE, dtype=torch.long)
            dist.broadcast(rest, 0, group=control)
            host += rest.tolist()
        if op == STOP:
            return
        payload = torch.empty(n_dev, dtype=torch.long, device=local.device)
        if n_dev:
            dist.broadcast(payload, 0, group=group)
        if op == RESET:
            local.reset(host)
        elif op in (PREFILL, PREFILL_ALL):
            local.prefill(payload.view(len(host), -1), host, op == PREFILL_ALL)
        elif op == DECODE:
            local.decode(payload[:split], payload[split:])
        elif op == ASSIGN:
            local.assign_blocks(host[0], host[1], host[2:])
