"""CUDA graphs for decode and prefill, captured once over a static cache.

Decode: one graph of ``model.step`` per batch-size bucket. The cache gets one extra
scratch slot: rows that pad a batch up to its bucket point there, so padding never
touches a live sequence.

Prefill: one graph of ``model.forward`` per (rows, length), both powers of two. A chunk of
L tokens of b prompts is prefilled as the binary pieces of L, largest first, each
continuing from the states the previous left in the cache: exact (no padding enters a
live state: rows that pad b up to its bucket point at the scratch slot) and free of
per-op Python launch cost. Graphs exist up to ``max_tokens`` = rows x length: past a few
thousand tokens a forward's GPU time exceeds its host time, and an eager forward costs
no padding.
"""

from __future__ import annotations

import torch

from ssmq.errors import SSMQError
from ssmq.models.state import slot_rows
from ssmq.models.ffn import static_shapes_

# a batch runs in the smallest bucket that holds it. Past ~64 rows a step costs about its batch (Mamba2-2.7B on an
# H100: 11.7 ms at 128, 22 ms at 256), so powers of two alone would run 129 rows at the price of 256: steps of
# a quarter to a half keep the padding under 1.5x from 16 rows up, where it costs (more graphs: a capture each, and
# their logits buffers); below, reading the weights dominates a step and padding costs less
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def _capture(fn, pool, reset):
    """Warm ``fn`` up on a side stream (Triton compiles outside the capture), then capture it; returns (graph, out).

    ``reset()`` runs before each warm-up and after the capture: the runs write to a scratch cache slot.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.inference_mode():
        for _ in range(2):
            reset()
            fn()
        reset()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool), torch.inference_mode():
        out = fn()
    reset()
    return graph, out


class CudaGraphDecoder:
    """Replays ``model.step`` from captured graphs. Call as ``decoder(tokens (b,), slots (b,)) -> logits (b, vocab)``.

    The logits returned are a view of the graph's output buffer, overwritten by the next call of the same
    bucket (copying them would cost a (b, vocab) write per token): sample from them, or ``.clone()`` to keep.
    """

    def __init__(self, model, max_batch: int, max_seqlen: int, buckets=DEFAULT_BUCKETS, dtype=None, ssm_dtype=None,
                 cache=None, state_checkpoint: int | None = None):
        if model.device.type != "cuda":
            raise SSMQError("CUDA-graph decode needs the model on a CUDA device")
        static_shapes_(model)  # mixtures of experts without data-dependent shapes, as a capture needs
        self.model = model
        self.buckets = sorted(b for b in buckets if b < max_batch) + [max_batch]
        # the model's own state formats unless ssm_dtype asks for another (``model.allocate_cache``); state_checkpoint
        # K: SSM states checkpointed every K steps (ReplaySSM); the rings are fixed buffers too
        self.cache = cache or model.allocate_cache(max_batch + 1, max_seqlen, dtype=dtype, ssm_dtype=ssm_dtype,
                                                   state_checkpoint=state_checkpoint)
        if self.cache.max_batch < max_batch + 1:
            raise SSMQError(f"the decoder needs a cache of max_batch + 1 = {max_batch + 1} slots (one scratch)")
        self.scratch = self.cache.max_batch - 1
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, tuple] = {}

    def _capture(self, bs: int):
        device = self.model.device
        tokens = torch.zeros(bs, dtype=torch.long, device=device)
        slots = torch.full((bs,), self.scratch, dtype=torch.long, device=device)
        graph, logits = _capture(lambda: self.model.step(tokens, self.cache, slots), self.pool,
                                 lambda: self.cache.reset([self.scratch]))
        self.graphs[bs] = (graph, tokens, slots, logits)

    def capture_all(self) -> None:
        for bs in self.buckets:
            self._capture(bs)

    def capture(self, b: int) -> int:
        """The bucket that runs a batch of ``b`` rows, its graph captured now if it was not yet."""
        bs = next((x for x in self.buckets if x >= b), None)
        if bs is None:
            raise SSMQError(f"batch {b} exceeds the decoder's max batch {self.buckets[-1]}")
        if bs not in self.graphs:
            self._capture(bs)
        return bs

    def __call__(self, tokens: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        b = tokens.shape[0]
        bs = self.capture(b)
        graph, static_tokens, static_slots, logits = self.graphs[bs]
        static_tokens[:b].copy_(tokens)
        static_slots[:b].copy_(slots)
        if b < bs:  # padding rows write to the scratch slot, whose length stays 0: each replay advances it by one,
            # and past the cache's L its KV writes (and a quantized cache's kernel reads) would leave their buffers
            static_slots[b:] = self.scratch
            self.cache.seqlens[self.scratch] = 0
        graph.replay()
        return logits[:b]


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def graph_row_pieces(b: int, length: int, max_len: int, max_tokens: int, max_rows: int) -> list[int]:
    """Rows of the forwards, in order, that a chunk of ``length`` tokens of ``b`` prompts splits into so that each
    runs from ``CudaGraphPrefill``'s graphs (pieces up to ``max_len`` tokens, rows x piece up to ``max_tokens``, at
    most ``max_rows`` rows): as many rows a forward as a graph of the chunk's longest piece takes, the rest last;
    [] when not even one row is served."""
    if not 0 < length <= max_len or max_rows < 1:
        return []
    top = 1 << (length.bit_length() - 1)  # the longest binary piece of the chunk
    if top > max_tokens:
        return []
    cap = min(1 << ((max_tokens // top).bit_length() - 1), max_rows)
    return [min(cap, b - i) for i in range(0, b, cap)]


class CudaGraphPrefill:
    """Replays ``model.forward`` over binary pieces of a chunk of prompts. Call as
    ``prefill(ids (b, L), slots (b,)) -> logits (b, vocab)`` (a single ``int`` slot for b = 1).

    Graphs for rows r (powers of two) and pieces p (powers of two up to ``max_len``) with r * p <= ``max_tokens``
    (default ``max_len``: one row). ``serves(b, L)`` says whether a chunk runs here. Shares the decoder's cache and
    memory pool when given one, so a prompt prefilled here decodes there. Like the decoder's, the logits returned live
    in a graph's output buffer until its next replay.
    """

    def __init__(self, model, cache, max_len: int, pool=None, max_tokens: int | None = None):
        if model.device.type != "cuda":
            raise SSMQError("CUDA-graph prefill needs the model on a CUDA device")
        static_shapes_(model)
        # a piece longer than the cache would write KV past its end while being captured
        self.model, self.cache, self.max_len = model, cache, min(max_len, cache.max_seqlen)
        self.max_tokens = max(self.max_len if max_tokens is None else max_tokens, 1)
        self.pool = pool or torch.cuda.graph_pool_handle()
        self.scratch = cache.max_batch - 1
        self.max_rows = min(_pow2_at_least(self.scratch), self.max_tokens)  # the live slots, rounded up
        self.graphs: dict[tuple[int, int], tuple] = {}

    def _capture(self, rows: int, length: int):
        device = self.model.device
        ids = torch.zeros(rows, length, dtype=torch.long, device=device)
        slots = torch.full((rows,), self.scratch, dtype=torch.long, device=device)

        def run():
            return self.model(ids, self.cache, slots, num_last_tokens=1)[:, -1]

        graph, logits = _capture(run, self.pool, lambda: self.cache.reset([self.scratch]))
        self.graphs[rows, length] = (graph, ids, slots, logits)

    def shapes(self) -> list[tuple[int, int]]:
        """(rows, piece) of every graph, rows first."""
        out, rows = [], 1
        while rows <= self.max_rows:
            piece = 1
            while piece <= self.max_len and rows * piece <= self.max_tokens:
                out.append((rows, piece))
                piece *= 2
            rows *= 2
        return out

    def capture_all(self) -> None:
        for rows, piece in self.shapes():
            self._capture(rows, piece)

    def serves(self, b: int, length: int) -> bool:
        """Whether a chunk of ``length`` tokens of ``b`` prompts runs from graphs (its largest piece fits)."""
        # (rows <= max_rows follows: b <= scratch, and rows x piece <= max_tokens)
        return 0 < length <= self.max_len and b <= self.scratch \
            and _pow2_at_least(b) * (1 << (length.bit_length() - 1)) <= self.max_tokens

    def row_pieces(self, b: int, length: int) -> list[int]:
        """``graph_row_pieces`` of this prefill's graphs."""
        return graph_row_pieces(b, length, self.max_len, self.max_tokens, min(self.max_rows, self.scratch))

    def __call__(self, ids: torch.Tensor, slots, check_fit: bool = True) -> torch.Tensor:
        """check_fit: read the slots' lengths off the device (a sync) to refuse a chunk that overflows the cache;
        a caller that knows the lengths fit (the serving engine) passes False."""
        b, length = ids.shape
        if not self.serves(b, length):
            raise SSMQError(f"graph prefill takes up to {self.max_tokens} tokens of chunks of 1..{self.max_len} "
                            f"tokens, got {tuple(ids.shape)}")
        slots = slot_rows(slots, self.model.device)
        if slots.numel() != b:
            raise SSMQError(f"{b} prompts need {b} slots, got {slots.numel()}")
        if check_fit and int(self.cache.seqlens[slots].max()) + length > self.cache.max_seqlen:
            raise SSMQError(f"prompt does not fit the cache ({self.cache.max_seqlen} tokens)")
        rows = _pow2_at_least(b)
        start, logits = 0, None
        for bit in reversed(range(length.bit_length())):
            piece = 1 << bit
            if not length & piece:
                continue
            if (rows, piece) not in self.graphs:
                self._capture(rows, piece)
            graph, static_ids, static_slots, logits = self.graphs[rows, piece]
            static_ids[:b].copy_(ids[:, start:start + piece])
            static_slots[:b].copy_(slots)
            if b < rows:  # as the decoder's padding: the scratch slot restarts at length 0 before each piece
                static_slots[b:] = self.scratch
                self.cache.seqlens[self.scratch] = 0
            graph.replay()
            start += piece
        return logits[:b]
