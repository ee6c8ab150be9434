"""Perplexity over non-overlapping windows of a tokenised text (WikiText-2 test by default).

Glossary: ``b`` batch (windows), ``l`` window length (``seqlen``), ``V`` vocabulary size.

The whole text is tokenised at once with the GPT-NeoX tokenizer (no BOS/EOS added), cut into
``n_windows = n_tokens // seqlen`` consecutive windows of exactly ``seqlen`` tokens (the tail shorter than a window
is dropped, as in the GPTQ / Quamba evaluation scripts; a text shorter than one window is scored as one short
window), and every window predicts its tokens 1..l-1 from the ones before it:

    ppl = exp( sum of NLL over all predicted tokens / n_predicted ),   n_predicted = n_windows * (seqlen - 1)

The file is read verbatim (UTF-8). ``shared/data/eval/wikitext2/test.txt`` is WikiText-2 **v1 tokenised** text
(``<unk>``, `` @-@ ``), not the ``raw`` variant published numbers use: compare our own models with it, not papers.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ssmq.errors import SSMQError
from ssmq.eval.scoring import model_device
from ssmq.paths import shared_path


def wikitext2_path(split: str = "test") -> Path:
    p = shared_path("data", "eval", "wikitext2", f"{split}.txt")
    if p is None:
        raise SSMQError(f"WikiText-2 {split} not found: expected data/eval/wikitext2/{split}.txt in "
                        "the data folder (set $SSMQ_SHARED to it); ppl:PATH scores any text file")
    return p


def windows(ids: list[int], seqlen: int, limit: int | None = None) -> torch.Tensor:
    """(n_windows, seqlen) long tensor of consecutive non-overlapping windows; (1, n) when n < seqlen."""
    if seqlen < 2:
        raise SSMQError(f"--seqlen must be >= 2, got {seqlen}")
    if len(ids) < 2:
        raise SSMQError("the text has fewer than 2 tokens: nothing to predict")
    t = torch.tensor(ids, dtype=torch.long)
    n = len(ids) // seqlen
    w = t[None] if n == 0 else t[:n * seqlen].view(n, seqlen)
    return w if limit is None else w[:limit]


@torch.no_grad()
def perplexity_of_ids(
    model: torch.nn.Module,
    ids: list[int],
    seqlen: int = 2048,
    batch_size: int = 1,
    limit: int | None = None,
    progress: bool = True,
    desc: str = "perplexity",
    per_window: bool = False,
) -> dict:
    """Perplexity of a token sequence; returns the number and the setting it was measured with.
    per_window: also each window's summed NLL (``window_nll``), for paired comparisons of two runs."""
    w = windows(ids, seqlen, limit)  # (n_windows, l)
    device = model_device(model)
    nll_sum, n_pred, window_nll = 0.0, 0, []
    for start in tqdm(range(0, len(w), batch_size), desc=desc, disable=not progress, unit="batch"):
        x = w[start:start + batch_size].to(device)  # (b, l)
        logits = model(x)  # (b, l, V)
        for row in range(x.shape[0]):  # one row at a time keeps the float32 copy of the logits small
            window_nll.append(F.cross_entropy(logits[row, :-1].float(), x[row, 1:], reduction="sum").item())
            nll_sum += window_nll[-1]
        n_pred += x.shape[0] * (x.shape[1] - 1)
    extra = {"window_nll": window_nll} if per_window else {}
    return {**extra,
        "ppl": math.exp(nll_sum / n_pred),
        "nll_mean": nll_sum / n_pred,
        "seqlen": int(w.shape[1]),
        "n_windows": int(w.shape[0]),
        "n_tokens_text": len(ids),
        "n_tokens_predicted": n_pred,
    }


@torch.no_grad()
def decode_perplexity_of_ids(
    model: torch.nn.Module,
    ids: list[int],
    seqlen: int = 512,
    limit: int | None = 8,
    prefill: int = 0,
    ssm_dtype: torch.dtype | None = None,
    progress: bool = True,
    state_checkpoint: int | None = None,
) -> dict:
    """Perplexity through the decode path: the windows (as ``perplexity_of_ids`` cuts them, ``limit`` of them, one
    batch) are fed one token a step to ``model.step`` over a cache (``ssm_dtype``: its SSM state format, None the
    model's own: int8 for an int8-state model; ``state_checkpoint`` K: states checkpointed every K steps, ReplaySSM), teacher-forced, after an
    optional prefill of their first ``prefill`` tokens through the cache. So
    the cache's state formats and the decode kernels are what is scored; a full-window forward never runs. Same
    keys as ``perplexity_of_ids`` (with ``window_nll``), predicted tokens counted from the end of the prefill."""
    w = windows(ids, seqlen, limit)  # (b, l)
    b, length = w.shape
    if not 0 <= prefill < length - 1:
        raise SSMQError(f"prefill must leave tokens to decode: 0 <= prefill < {length - 1}, got {prefill}")
    device = model_device(model)
    w = w.to(device)
    cache = model.allocate_cache(b, length, ssm_dtype=ssm_dtype, state_checkpoint=state_checkpoint)
    window_nll = torch.zeros(b, dtype=torch.float64, device=device)
    if prefill:  # its last logits predict token `prefill`
        logits = model(w[:, :prefill], cache, num_last_tokens=1)[:, -1]
        window_nll += F.cross_entropy(logits.float(), w[:, prefill], reduction="none").double()
    for t in tqdm(range(prefill, length - 1), desc="decode perplexity", disable=not progress, unit="step"):
        logits = model.step(w[:, t], cache)  # token t in, token t + 1 predicted
        window_nll += F.cross_entropy(logits.float(), w[:, t + 1], reduction="none").double()
    n_pred = b * (length - max(prefill, 1))
    return {"ppl": math.exp(window_nll.sum().item() / n_pred), "nll_mean": window_nll.sum().item() / n_pred,
            "seqlen": int(length), "n_windows": int(b), "n_tokens_text": len(ids), "n_tokens_predicted": n_pred,
            "prefill": prefill, "window_nll": window_nll.tolist()}


def perplexity_of_file(model, tokenizer, path: str | Path, seqlen: int = 2048, batch_size: int = 1,
                       limit: int | None = None, progress: bool = True) -> dict:
    """Perplexity of a UTF-8 text file (WikiText-2 test: ``wikitext2_path()``)."""
    path = Path(path)
    if not path.is_file():
        raise SSMQError(f"text file {path} not found")
    text = path.read_text(encoding="utf-8")
    ids = tokenizer.encode(text)
    out = perplexity_of_ids(model, ids, seqlen, batch_size, limit, progress, desc=f"ppl {path.name}")
    out["file"] = str(path)
    return out
