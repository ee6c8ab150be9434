"""Generation over a batch of prompts of different lengths, streaming tokens as they are produced.

Each prompt is prefilled into its own cache slot (no padding enters an SSM state), then
all unfinished rows decode together, one token per step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from ssmq.errors import SSMQError
from ssmq.runtime.host_copy import HostCopy
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
    # the device runs one step ahead of the caller: step n + 1 is launched before step n's tokens are read back
    # (into pinned memory, waiting on that copy alone), so printing and detokenizing a token overlap the next step.
    # A row that ends is dropped one step later: the step launched meanwhile also computed it, and its token is unused.
    active, rows = torch.arange(len(prompts), device=device), list(range(len(prompts)))
    for produced in range(1, params.max_new_tokens + 1):
        current = tokens[active]
        readback = HostCopy(current)
        more = produced < params.max_new_tokens
        if more:  # a row whose logits were not finite (token -1) steps on token 0 and fails when read back below
            tokens[active] = sample_next(step(current.clamp_min(0), active), params, gen,
                                         None if counts is None else counts[active])
            if counts is not None:
                sub = counts[active]
                count_tokens(sub, tokens[active])
                counts[active] = sub
        values = readback.lists()[0]
        for row, tok in zip(rows, values):
            if tok < 0:
                raise SSMQError(f"the model's logits for prompt {row} are not finite (NaN or inf)")
            yield row, tok
        if params.stop_at_eos and params.eos_id in values:
            keep = [i for i, tok in enumerate(values) if tok != params.eos_id]
            rows = [rows[i] for i in keep]
            active = active[torch.tensor(keep, dtype=torch.long, device=device)]
        if not more or not rows:
            return


def generate(model, prompts: list[list[int]], params: SamplingParams, **kwargs) -> list[list[int]]:
    """All generated ids per prompt (EOS included when it stopped the row)."""
    out: list[list[int]] = [[] for _ in prompts]
    for row, tok in stream_generate(model, prompts, params, **kwargs):
        out[row].append(tok)
    return out
