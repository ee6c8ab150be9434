"""Passkey retrieval: can the model recall a 5-digit key hidden at some depth in a long filler text?

The standard synthetic long-context check (Mohtashami & Jaggi 2023, "Landmark Attention"; also LongLoRA, KVQuant):

    [intro] [filler ...] [key sentence] [filler ...] [question]

``n_tokens`` is the prompt's exact length in tokens. The pieces are tokenized one by one and their ids joined, so
lengths and the key's position are exact (a tokenizer may merge across a piece boundary when the whole text is
tokenized at once; joining ids sidesteps that). The key (10000..99999) and its depth (fraction of the filler
before it, in [0.05, 0.95]) come from ``random.Random(seed)``, so a seed fixes the trial. The model decodes
greedily through its cache (``ssmq.runtime.generate``: a quantized KV cache when the model's attention layers carry
a KV format); a trial succeeds when the key's digits appear, not run into other digits, in what it produced.
"""

from __future__ import annotations

import random
import re
import time
from dataclasses import dataclass

from ssmq.errors import SSMQError

INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. Find it and "
         "memorize it. I will quiz you about it.\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
KEY = "The pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "What is the pass key? The pass key is"


@dataclass
class PasskeyPrompt:
    ids: list[int]  # (n_tokens,) the prompt's token ids
    key: str  # the 5 digits
    depth: float  # requested fraction of the filler placed before the key
    key_start: int  # index in ids where the key sentence's tokens begin
    key_ids: list[int]  # the key sentence's tokens, ids[key_start:key_start + len(key_ids)]


def build_prompt(tokenizer, n_tokens: int, seed: int, depth: float | None = None) -> PasskeyPrompt:
    """A prompt of exactly ``n_tokens`` tokens with the key sentence at ``depth`` (random from ``seed`` if None).

    The filler is whole filler sentences, the last one cut to fit; the key goes between two filler tokens at the
    nearest token to ``depth`` of the filler."""
    rng = random.Random(seed)
    key = str(rng.randint(10000, 99999))
    depth = rng.uniform(0.05, 0.95) if depth is None else depth
    if not 0.0 <= depth <= 1.0:
        raise SSMQError(f"passkey depth must be in [0, 1], got {depth}")
    intro, key_ids, question = (tokenizer.encode(t) for t in (INTRO, KEY.format(key=key), QUESTION))
    n_filler = n_tokens - len(intro) - len(key_ids) - len(question)
    if n_filler < 1:
        raise SSMQError(f"a passkey prompt of {n_tokens} tokens is too short: intro, key sentence and question "
                        f"alone take {n_tokens - n_filler}")
    sentence = tokenizer.encode(FILLER)
    filler = (sentence * (n_filler // len(sentence) + 1))[:n_filler]
    cut = round(depth * n_filler)
    ids = intro + filler[:cut] + key_ids + filler[cut:] + question
    return PasskeyPrompt(ids, key, depth, len(intro) + cut, key_ids)


def passkey_found(text: str, key: str) -> bool:
    """True when ``key``'s digits appear in ``text`` as a whole number (not inside a longer run of digits)."""
    return re.search(rf"(?<!\d){re.escape(key)}(?!\d)", text) is not None


def run_passkey(model, tokenizer, lengths: list[int], seeds: list[int], max_new_tokens: int = 8,
                on_row=None) -> list[dict]:
    """One trial per (length, seed): greedy decode through the model's cache (eager ``model.step``).

    Returns rows {n_tokens, seed, key, depth, output, success, seconds}; ``on_row(row)`` is called after each
    (write results incrementally)."""
    from ssmq.runtime.generate import generate
    from ssmq.runtime.sampling import SamplingParams

    if not lengths or not seeds:
        raise SSMQError("run_passkey needs at least one length and one seed")
    params = SamplingParams(max_new_tokens=max_new_tokens, stop_at_eos=False)
    rows = []
    for n in lengths:
        for seed in seeds:
            p = build_prompt(tokenizer, n, seed)
            t = time.time()
            out = generate(model, [p.ids], params)[0]
            text = tokenizer.decode(out)
            row = {"n_tokens": n, "seed": seed, "key": p.key, "depth": round(p.depth, 3), "output": text,
                   "success": passkey_found(text, p.key), "seconds": round(time.time() - t, 1)}
            rows.append(row)
            if on_row is not None:
                on_row(row)
    return rows
