"""Loglikelihood of continuations given contexts, and the multiple-choice metrics, as lm-evaluation-harness 0.4.x.

Glossary: ``b`` batch, ``l`` sequence length, ``V`` vocabulary size, ``k`` continuation length in tokens.

A *request* is ``(context: str, continuation: str)``. It is scored as lm-eval's causal models score it:

1. Trailing whitespace of the context moves to the front of the continuation; the tokens of the continuation are
   ``encode(context + continuation)[len(encode(context)):]`` (so a word boundary tokenises as it would in running
   text). An empty context is replaced by the prefix token (EOS for the GPT-NeoX models).
2. The model reads ``(context + continuation)[-(max_length + 1):][:-1]`` (left truncation) and the loglikelihood is the
   sum of ``log_softmax`` at the last ``k`` positions; ``is_greedy`` says whether the argmax at each of those positions
   is the continuation token.

Any module with ``forward(input_ids (b, l) long) -> logits (b, l, V)`` works (duck typing). Rows are batched with
right padding: a causal model's logits at a position do not depend on later (padding) positions. Requests whose
model inputs are identical (e.g. MMLU's " A"/" B"/" C"/" D", one token each after the same prompt) share one row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from ssmq.errors import SSMQError

TokenRequest = tuple[list[int], list[int]]  # (context tokens, continuation tokens)


def _move_trailing_space(context: str, continuation: str) -> tuple[str, str]:
    n_spaces = len(context) - len(context.rstrip())
    return (context[:-n_spaces], context[-n_spaces:] + continuation) if n_spaces else (context, continuation)


def batch_encoder(tokenizer, requests: Sequence[tuple[str, str]]) -> Callable[[str], list[int]]:
    """``encode`` for every string ``encode_pair`` will ask of these requests, tokenized once each, in parallel.

    Multiple-choice requests share their context (MMLU: a 5-shot prompt per question), and the tokenizer's
    batch call runs on all cores: per-string calls made tokenization most of an MMLU run's time.
    """
    texts = []
    for c, x in requests:
        if c == "":
            texts.append(x)
        else:
            c, x = _move_trailing_space(c, x)
            texts += [c + x, c]
    unique = list(dict.fromkeys(texts))
    if hasattr(tokenizer, "encode_batch"):
        table = dict(zip(unique, tokenizer.encode_batch(unique)))
    else:
        table = {t: tokenizer.encode(t) for t in unique}
    return table.__getitem__


def encode_pair(encode: Callable[[str], list[int]], context: str, continuation: str, prefix_id: int) -> TokenRequest:
    """Token ids of one request, split as lm-eval's ``TemplateLM`` splits them (see the module docstring)."""
    if context == "":
        cont = encode(continuation)
        if not cont:
            raise SSMQError("empty continuation in a loglikelihood request")
        return ([prefix_id], cont) if cont[0] != prefix_id else (cont[:1], cont[1:])
    context, continuation = _move_trailing_space(context, continuation)
    whole = encode(context + continuation)
    ctx = encode(context)
    return ctx, whole[len(ctx):]


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's first parameter (CPU for a model without parameters)."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


PAD_MULTIPLE = 64


@torch.no_grad()
def loglikelihood_tokens(
    model: torch.nn.Module,
    requests: Sequence[TokenRequest],
    batch_size: int = 16,
    max_length: int = 2048,
    progress: bool = True,
    desc: str = "loglikelihood",
    max_batch_tokens: int | None = 32768,
) -> list[tuple[float, bool]]:
    """``(sum of log p(continuation | context), is_greedy)`` per request, in request order.

    Rows are sorted longest first (an out-of-memory error shows at the first batch) and right-padded. A batch holds
    at most ``batch_size`` rows and, when ``max_batch_tokens`` is set, at most that many padded tokens (at least one
    row): the logits alone are ``rows * length * V`` numbers (32768 tokens * 50288 * 2 bytes = 3.3 GB in fp16).
    """
    if batch_size < 1:
        raise SSMQError(f"batch size must be >= 1, got {batch_size}")
    groups: dict[tuple[int, ...], list[int]] = {}  # model input -> indices of the requests it serves
    for i, (ctx, cont) in enumerate(requests):
        if not cont:
            raise SSMQError(f"request {i} has an empty continuation")
        if len(cont) > max_length:
            raise SSMQError(f"a continuation of {len(cont)} tokens does not fit max_length={max_length}")
        whole = (list(ctx) + list(cont))[-(max_length + 1):]
        groups.setdefault(tuple(whole[:-1]), []).append(i)

    inputs = sorted(groups, key=lambda t: (-len(t), t))
    batches, start = [], 0
    while start < len(inputs):  # longest first, so the first row of a batch sets its padded length
        rows = batch_size
        if max_batch_tokens is not None:
            rows = max(1, min(batch_size, max_batch_tokens // len(inputs[start])))
        batches.append(inputs[start:start + rows])
        start += rows
    device = model_device(model)
    out: list[tuple[float, bool] | None] = [None] * len(requests)
    for batch in tqdm(batches, desc=desc, disable=not progress, unit="batch"):
        # pad to a multiple of 64: few distinct shapes, so GPU kernels compile once per shape
        # (right padding never changes a causal model's outputs at the real positions)
        longest = -(-len(batch[0]) // PAD_MULTIPLE) * PAD_MULTIPLE
        ids = torch.zeros(len(batch), longest, dtype=torch.long)
        for row, inp in enumerate(batch):
            ids[row, :len(inp)] = torch.tensor(inp, dtype=torch.long)
        logits = model(ids.to(device))  # (b, l, V)
        scored = []  # (request, ll, greedy) as device tensors: one device-to-host copy per batch
        for row, inp in enumerate(batch):
            n = len(inp)
            members = groups[inp]
            k_max = max(len(requests[i][1]) for i in members)
            logp = torch.log_softmax(logits[row, n - k_max:n].float(), dim=-1)  # (k_max, V)
            greedy = logp.argmax(dim=-1)
            for i in members:
                cont = torch.tensor(requests[i][1], dtype=torch.long, device=logp.device)
                k = len(cont)
                scored.append((i, logp[k_max - k:].gather(1, cont[:, None]).sum(), (greedy[k_max - k:] == cont).all()))
        lls = torch.stack([ll for _, ll, _ in scored]).double().cpu().tolist()
        greedies = torch.stack([g for _, _, g in scored]).cpu().tolist()
        for (i, _, _), ll, g in zip(scored, lls, greedies):
            out[i] = (ll, bool(g))
    return out  # type: ignore[return-value]


def loglikelihood(
    model: torch.nn.Module,
    tokenizer,
    requests: Sequence[tuple[str, str]],
    batch_size: int = 16,
    max_length: int = 2048,
    progress: bool = True,
    desc: str = "loglikelihood",
    max_batch_tokens: int | None = 32768,
) -> list[tuple[float, bool]]:
    """Score string requests ``(context, continuation)``; ``tokenizer`` has ``encode`` and ``eos_id``."""
    encode = batch_encoder(tokenizer, requests)
    token_requests = [encode_pair(encode, c, x, tokenizer.eos_id) for c, x in requests]
    return loglikelihood_tokens(model, token_requests, batch_size, max_length, progress, desc, max_batch_tokens)


# ----------------------------------------------------------------------------------------------------------------------
# multiple-choice metrics (lm-eval ``ConfigurableTask.process_results`` for ``output_type: multiple_choice``)


def choice_metrics(lls: Sequence[float], choices: Sequence[str], gold: int) -> dict[str, float]:
    """acc: argmax loglikelihood; acc_norm: argmax loglikelihood / ``len(choice)``.

    As lm-eval 0.4.x: the length is that of the choice string *without* the target delimiter, counted in characters
    (lm-eval's ``completion_len``; its ``acc_bytes`` divides by UTF-8 bytes instead — the same for ASCII choices).
    Ties go to the first choice (``np.argmax``).
    """
    lls = np.asarray(lls, dtype=np.float64)
    lengths = np.array([float(len(c)) for c in choices])
    n_bytes = np.array([float(len(c.encode("utf-8"))) for c in choices])
    return {
        "acc": float(np.argmax(lls) == gold),
        "acc_norm": float(np.argmax(lls / lengths) == gold),
        "acc_bytes": float(np.argmax(lls / n_bytes) == gold),
    }


def mean_stderr(values: Sequence[float]) -> float:
    """Standard error of the mean (sample standard deviation / sqrt(n)), as lm-eval's ``mean_stderr``."""
    n = len(values)
    if n < 2:
        return float("nan")
    return float(np.std(np.asarray(values, dtype=np.float64), ddof=1) / np.sqrt(n))
