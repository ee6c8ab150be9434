"""Generation over a batch of prompts of different lengths, streaming tokens as they are produced.

Each prompt is prefilled into its own cache slot (no padding enters an SSM state), then
all unfinished rows decode together, one token per step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from ssmq.errors import SSMQError
from ssmq.runtime.sampling import SamplingParams, count_tokens, sample_next

DecodeFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (tokens (b,), slots (b,)) -> logits (b, vocab)


@torch.inference_mode()
def stream_generate(model, prompts: list[list[int]], params: SamplingParams, cache=None,
                    decode_fn: DecodeFn | None = None, state_checkpoint: int | None = None
                    ) -> Iterator[tuple[int, int]]:
    """Yield ``(row, token)`` pairs as tokens are produced, for every row until EOS or max_new_tokens.

    ``cache`` (optional; by default one of len(prompts) slots, the SSM state in its calibrated format: int8 for an
    int8-state model) must have at least len(prompts) slots; ``decode_fn`` replaces ``model.step`` (e.g. by a
    CUDA-graph runner over the same cache). ``state_checkpoint`` K: the default cache writes each SSM state once
    every K steps (ReplaySSM, ``model.allocate_cache``).
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise SSMQError("every prompt must have at least one token")
    device = model.device
    max_len = max(len(p) for p in prompts) + params.max_new_tokens
    if cache is None:
        cache = model.allocate_cache(len(prompts), max_len, state_checkpoint=state_checkpoint)
    elif cache.max_batch < len(prompts):
        raise SSMQError(f"cache has {cache.max_batch} slots for {len(prompts)} prompts")
    cache.reset()
    step = decode_fn or (lambda tokens, slots: model.step(tokens, cache, slots))
    gen = None
    if params.seed is not None:
        gen = torch.Generator(device=device).manual_seed(params.seed)

    tokens = torch.empty(len(prompts), dtype=torch.long, device=device)
    counts = None  # (b, vocab): generated tokens per row, for the penalties
    for row, prompt in enumerate(prompts):
        ids = torch.tensor([prompt], dtype=torch.long, device=device)
        logits = model(ids, cache, slots=[row], num_last_tokens=1)[:, -1]
        if params.penalized and counts is None:
            counts = torch.zeros(len(prompts), logits.shape[-1], device=device)
        tokens[row] = sample_next(logits, params, gen, None if counts is None else counts[row:row + 1])[0]
    if counts is not None:
        count_tokens(counts, tokens)
    active = torch.arange(len(prompts), device=device)
    for produced in range(1, params.max_new_tokens + 1):
        for row, tok in zip(active.tolist(), tokens[active].tolist()):
            if tok < 0:
                raise SSMQError(f"the model's logits for prompt {row} are not finite (NaN or inf)")
            yield row, tok
        if params.stop_at_eos:
            active = active[tokens[active] != params.eos_id]
        if produced == params.max_new_tokens or active.numel() == 0:
            return
        tokens[active] = sample_next(step(tokens[active], active), params, gen,
                                     None if counts is None else counts[active])
        if counts is not None:
            sub = counts[active]
            count_tokens(sub, tokens[active])
            counts[active] = sub


def generate(model, prompts: list[list[int]], params: SamplingParams, **kwargs) -> list[list[int]]:
    """All generated ids per prompt (EOS included when it stopped the row)."""
    out: list[list[int]] = [[] for _ in prompts]
    for row, tok in stream_generate(model, prompts, params, **kwargs):
        out[row].append(tok)
    return out
