"""Next-token choice: greedy, or temperature sampling with top-k and top-p (nucleus) filtering."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ssmq.errors import SSMQError


SEED_LIMIT = 2**63  # seeds are torch.Generator seeds: [0, 2**63)


def seed_problem(seed) -> str | None:
    """Why ``seed`` is refused (one line), or None: the one rule ``ssmq generate`` and the server apply."""
    if seed is None or (isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < SEED_LIMIT):
        return None
    return f"seed must be an integer in [0, 2**63), got {seed!r}"


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means no top-k filter
    top_p: float = 1.0  # 1 means no nucleus filter
    stop_at_eos: bool = True
    eos_id: int = 0
    vocab_limit: int | None = None  # ids >= this (embedding padding) are never produced
    seed: int | None = None

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise SSMQError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise SSMQError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SSMQError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SSMQError(f"top_k must be >= 0, got {self.top_k}")
        if seed_problem(self.seed):
            raise SSMQError(seed_problem(self.seed))


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits: (b, vocab) → next token ids (b,) long."""
    if params.temperature == 0:  # the argmax of the allowed ids: no float copy, no masked clone (same ids)
        return logits[:, :params.vocab_limit].argmax(dim=-1)
    logits = logits.float()
    if params.vocab_limit is not None and params.vocab_limit < logits.shape[-1]:
        logits = logits.clone()
        logits[:, params.vocab_limit:] = float("-inf")
    logits = logits / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token once the mass before it already reaches top_p (the top token always stays)
        drop_sorted = probs.cumsum(dim=-1) - probs >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], generators: list) -> torch.Tensor:
    """logits: (b, vocab), one ``SamplingParams`` and generator (or None) per row → next ids (b,) long.

    Each sampled row draws from its own generator, so a seeded request gets the same tokens whatever else
    shares its batch; greedy rows are one argmax together.
    """
    greedy = [i for i, p in enumerate(params) if p.temperature == 0]
    if greedy and len({params[i].vocab_limit for i in greedy}) == 1:
        # one argmax over every row (the sampled rows' are overwritten below): no row index list to the device
        out = sample_next(logits, params[greedy[0]])
    else:
        out = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
        if greedy:
            idx = torch.tensor(greedy, device=logits.device)
            out[idx] = sample_next(logits[idx], params[greedy[0]])
    for i, p in enumerate(params):
        if p.temperature != 0:
            out[i] = sample_next(logits[i:i + 1], p, generators[i])[0]
    return out


def top_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int):
    """Log-probabilities over the whole vocabulary, as the scorers compute them.

    logits: (b, vocab); tokens: (b,) → (logprob of each token (b,), top-k logprobs (b, k), their ids (b, k)).
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, tokens[:, None]).squeeze(1)
    top = logp.topk(max(k, 1), dim=-1)
    return chosen, top.values, top.indices
