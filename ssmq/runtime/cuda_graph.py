"""CUDA-graph decode: one graph per batch-size bucket, captured once over a static cache.

The cache gets one extra scratch slot: rows that pad a batch up to its bucket
point there, so padding never touches a live sequence.
"""

from __future__ import annotations

import torch

from ssmq.errors import SSMQError

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class CudaGraphDecoder:
    """Replays ``model.step`` from captured graphs. Call as ``decoder(tokens (b,), slots (b,)) -> logits (b, vocab)``."""

    def __init__(self, model, max_batch: int, max_seqlen: int, buckets=DEFAULT_BUCKETS, dtype=None, ssm_dtype=None):
        if not model.embedding.weight.is_cuda:
            raise SSMQError("CUDA-graph decode needs the model on a CUDA device")
        self.model = model
        self.buckets = sorted(b for b in buckets if b < max_batch) + [max_batch]
        self.cache = model.allocate_cache(max_batch + 1, max_seqlen, dtype=dtype, ssm_dtype=ssm_dtype)
        self.scratch = max_batch  # the extra slot
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, tuple] = {}

    def _capture(self, bs: int):
        device = self.model.embedding.weight.device
        tokens = torch.zeros(bs, dtype=torch.long, device=device)
        slots = torch.full((bs,), self.scratch, dtype=torch.long, device=device)
        seqlens = self.cache.seqlens.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):  # warm up: Triton compiles and autotunes outside the capture
                self.model.step(tokens, self.cache, slots)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool), torch.inference_mode():
            logits = self.model.step(tokens, self.cache, slots)
        self.cache.seqlens.copy_(seqlens)  # warm-up and capture advanced the scratch slot only; undo anyway
        self.cache.reset([self.scratch])
        self.graphs[bs] = (graph, tokens, slots, logits)

    def capture_all(self) -> None:
        for bs in self.buckets:
            self._capture(bs)

    def __call__(self, tokens: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        b = tokens.shape[0]
        bs = next((x for x in self.buckets if x >= b), None)
        if bs is None:
            raise SSMQError(f"batch {b} exceeds the decoder's max batch {self.buckets[-1]}")
        if bs not in self.graphs:
            self._capture(bs)
        graph, static_tokens, static_slots, logits = self.graphs[bs]
        static_tokens[:b].copy_(tokens)
        static_slots[:b].copy_(slots)
        static_slots[b:] = self.scratch
        graph.replay()
        return logits[:b]
