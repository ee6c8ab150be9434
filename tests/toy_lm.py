"""Tiny causal LMs with the ssmq model interface, for tests and smoke runs of the scorers on CPU.

Glossary: ``b`` batch, ``l`` sequence length, ``d`` width, ``V`` vocabulary size.
"""

from __future__ import annotations

import torch
from torch import nn


class ToyLM(nn.Module):
    """Random causal LM: embedding, a causal running mean mixed with the current token, tanh MLP, untied head."""

    def __init__(self, vocab_size: int = 50288, d: int = 16, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embedding = nn.Embedding(vocab_size, d)
        self.mix = nn.Linear(2 * d, d)
        self.lm_head = nn.Linear(d, vocab_size, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # (b, l) -> (b, l, V)
        e = self.embedding(input_ids)  # (b, l, d)
        steps = torch.arange(1, e.shape[1] + 1, device=e.device, dtype=e.dtype)[None, :, None]
        past = e.cumsum(dim=1) / steps  # (b, l, d) causal mean
        h = torch.tanh(self.mix(torch.cat([e, past], dim=-1)))
        return self.lm_head(h) * 3.0


class BigramLM(nn.Module):
    """logits[t, v] = weight of the transition input_ids[t] -> v (0 unless set by :meth:`favour`): a sparse bigram."""

    def __init__(self, vocab_size: int = 50288):
        super().__init__()
        self.vocab_size = vocab_size
        self.dummy = nn.Parameter(torch.zeros(()), requires_grad=False)  # gives the model a device
        self.bonus: dict[int, dict[int, float]] = {}

    def favour(self, ids: list[int], weight: float = 10.0) -> BigramLM:
        """Make every transition ids[i] -> ids[i+1] likely."""
        for a, b in zip(ids[:-1], ids[1:]):
            row = self.bonus.setdefault(a, {})
            row[b] = row.get(b, 0.0) + weight
        return self

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # (b, l) -> (b, l, V)
        b, l = input_ids.shape
        logits = torch.zeros(b, l, self.vocab_size, device=self.dummy.device)
        for i in range(b):
            for t in range(l):
                for v, w in self.bonus.get(int(input_ids[i, t]), {}).items():
                    logits[i, t, v] = w
        return logits
