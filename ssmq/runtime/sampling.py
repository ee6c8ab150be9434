"""Next-token choice: greedy, or temperature sampling with top-k and top-p (nucleus) filtering; OpenAI's
``logit_bias``, ``frequency_penalty`` and ``presence_penalty`` on either.

``check_sampling`` is the one definition of the values the sampler serves (the CLI and the server both call it,
through ``SamplingParams`` or directly); every value it accepts samples without a non-finite number: the temperature
divides logits shifted to a maximum of 0, so no ratio overflows to inf - inf. A row whose logits from the model are
not finite (NaN, inf) is not sampled at all: its token is -1, and the caller fails that row alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ssmq.errors import SSMQError

MAX_TEMPERATURE = 2.0  # as OpenAI
MAX_PENALTY = 2.0  # |frequency_penalty|, |presence_penalty| (as OpenAI)
MAX_BIAS = 100.0  # |logit_bias| values (as OpenAI)
MAX_BIAS_ENTRIES = 1024


class SamplingError(SSMQError):
    """A sampling parameter outside what the sampler serves; ``param`` names it."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _real(name: str, v, lo: float, hi: float, lo_open: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise SamplingError(name, f"{name} must be a number, got {v!r}")
    if not math.isfinite(v) or v > hi or v < lo or (lo_open and v == lo):
        raise SamplingError(name, f"{name} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v!r}")
    return float(v)


def check_sampling(temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, frequency_penalty: float = 0.0,
                   presence_penalty: float = 0.0, logit_bias: dict | None = None, vocab_size: int | None = None
                   ) -> dict[int, float] | None:
    """Raise ``SamplingError`` (naming the parameter) for a value the sampler does not serve; return ``logit_bias``
    with int keys (JSON gives its token ids as strings). ``vocab_size``: the ids that may be produced."""
    _real("temperature", temperature, 0.0, MAX_TEMPERATURE)
    _real("top_p", top_p, 0.0, 1.0, lo_open=True)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise SamplingError("top_k", f"top_k must be an integer >= 0 (0: off), got {top_k!r}")
    _real("frequency_penalty", frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
    _real("presence_penalty", presence_penalty, -MAX_PENALTY, MAX_PENALTY)
    if logit_bias is None:
        return None
    if not isinstance(logit_bias, dict) or len(logit_bias) > MAX_BIAS_ENTRIES:
        raise SamplingError("logit_bias", f"logit_bias must map at most {MAX_BIAS_ENTRIES} token ids to biases")
    out = {}
    for key, value in logit_bias.items():
        token = key if isinstance(key, int) and not isinstance(key, bool) else None
        if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 20:
            token = int(key)
        if token is None or token < 0 or (vocab_size is not None and token >= vocab_size):
            top = "" if vocab_size is None else f" in 0..{vocab_size - 1}"
            raise SamplingError("logit_bias", f"logit_bias keys must be token ids{top}, got {key!r}")
        out[token] = _real("logit_bias", value, -MAX_BIAS, MAX_BIAS)
    return out


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
    frequency_penalty: float = 0.0  # subtracted from a token's logit once per time it was generated
    presence_penalty: float = 0.0  # subtracted from the logit of every token generated at least once
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise SamplingError("max_new_tokens", f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        self.logit_bias = check_sampling(self.temperature, self.top_p, self.top_k, self.frequency_penalty,
                                         self.presence_penalty, self.logit_bias, self.vocab_limit) or None
        self._bias: tuple | None = None  # (ids, values) on the device of the last use

    @property
    def penalized(self) -> bool:
        """Whether the counts of generated tokens enter the logits."""
        return bool(self.frequency_penalty or self.presence_penalty)

    @property
    def plain_greedy(self) -> bool:
        return self.temperature == 0 and not self.penalized and not self.logit_bias

    def bias_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._bias is None or self._bias[0].device != device:
            ids, values = zip(*self.logit_bias.items())
            self._bias = (torch.tensor(ids, device=device), torch.tensor(values, device=device))
        return self._bias


def _finite_rows(logits: torch.Tensor, vocab_limit: int | None) -> torch.Tensor:
    """(b, vocab) → (b,) bool: the row's logits of the ids that may be produced are all finite."""
    return torch.isfinite(logits[:, :vocab_limit]).all(dim=-1)


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None,
                counts: torch.Tensor | None = None) -> torch.Tensor:
    """logits: (b, vocab) → next token ids (b,) long; -1 for a row whose logits are not finite.

    ``counts`` (b, vocab) float: how often each token was generated so far per row (the penalties need it).
    """
    ok = _finite_rows(logits, params.vocab_limit)
    if params.plain_greedy:  # the argmax of the allowed ids: no float copy, no masked clone (same ids)
        return torch.where(ok, logits[:, :params.vocab_limit].argmax(dim=-1), -1)
    logits = logits.float()
    if params.logit_bias:
        ids, values = params.bias_on(logits.device)
        logits = logits.index_add(1, ids, values.expand(logits.shape[0], -1))
    if params.penalized:
        logits = (logits - params.frequency_penalty * counts
                  - params.presence_penalty * (counts > 0).to(logits.dtype))
    if params.vocab_limit is not None and params.vocab_limit < logits.shape[-1]:
        logits = logits.clone()
        logits[:, params.vocab_limit:] = float("-inf")
    if params.temperature == 0:
        return torch.where(ok, logits.argmax(dim=-1), -1)
    # shifted to a maximum of 0 first: any temperature > 0 gives logits <= 0 (or -inf), never inf / inf; one below
    # float32's smallest normal number is that number (it would round to a division by 0)
    t = max(params.temperature, torch.finfo(torch.float32).tiny)
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / t
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token once the mass before it already reaches top_p (the top token always stays)
        drop_sorted = probs.cumsum(dim=-1) - probs >= params.top_p
        drop_sorted[:, 0] = False  # (a top_p below float32's smallest number rounds to 0 in the comparison)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    # a row that is not finite draws from a harmless distribution (multinomial raises on NaN, on CUDA
    # asynchronously, for the whole batch); its -1 tells the caller
    probs = logits.softmax(dim=-1).masked_fill(~ok[:, None], 1.0)
    return torch.where(ok, torch.multinomial(probs, 1, generator=generator).squeeze(-1), -1)


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], generators: list,
                counts: list | None = None) -> tuple[torch.Tensor, dict[int, str]]:
    """logits: (b, vocab), one ``SamplingParams``, generator (or None) and counts ((vocab,) or None) per row →
    (next ids (b,) long, {row: why it failed}).

    Each sampled row draws from its own generator, so a seeded request gets the same tokens whatever else
    shares its batch; plain greedy rows are one argmax together. A row whose sampling raises gets -1 and its
    reason; a row whose logits are not finite gets -1 (on the device); the other rows are unaffected.
    """
    counts = counts or [None] * len(params)
    greedy = [i for i, p in enumerate(params) if p.plain_greedy]
    if greedy and len({params[i].vocab_limit for i in greedy}) == 1:
        # one argmax over every row (the other rows' are overwritten below): no row index list to the device
        out = sample_next(logits, params[greedy[0]])
    else:
        out = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
        if greedy:
            idx = torch.tensor(greedy, device=logits.device)
            out[idx] = sample_next(logits[idx], params[greedy[0]])
    failed = {}
    for i, p in enumerate(params):
        if not p.plain_greedy:
            try:
                c = counts[i]
                out[i] = sample_row(logits[i:i + 1], p, generators[i], None if c is None else c[None])[0]
            except Exception as e:  # this row's failure is this row's alone
                out[i] = -1
                failed[i] = f"sampling failed: {type(e).__name__}: {e}"
    return out, failed


def sample_row(logits: torch.Tensor, params: SamplingParams, generator, counts) -> torch.Tensor:
    """One row of ``sample_rows`` that is not plain greedy: logits (1, vocab) → (1,)."""
    return sample_next(logits, params, generator, counts)


def count_tokens(counts: torch.Tensor, tokens: torch.Tensor) -> None:
    """counts (b, vocab) float += one-hot of tokens (b,) (the -1 of a failed row counts nothing)."""
    counts.scatter_add_(1, tokens.clamp(min=0)[:, None], (tokens >= 0).to(counts.dtype)[:, None])


def top_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int):
    """Log-probabilities over the whole vocabulary, as the scorers compute them.

    logits: (b, vocab); tokens: (b,) → (logprob of each token (b,), top-k logprobs (b, k), their ids (b, k)).
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, tokens.clamp(min=0)[:, None]).squeeze(1)
    top = logp.topk(max(k, 1), dim=-1)
    return chosen, top.values, top.indices
