"""The OpenAI completions protocol: request schema, its checks, and the OpenAI-style error body.

Every problem with a request becomes an ``APIError`` (HTTP status + one-line message) answered as
``{"error": {"message", "type", "param", "code"}}``; the server goes on serving.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, ValidationError

from ssmq.runtime.sampling import seed_problem

MAX_N = 16  # choices per prompt
MAX_LOGPROBS = 20  # top alternatives per token (OpenAI allows 5, vLLM 20)
MAX_STOPS = 4  # stop strings (as OpenAI)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class CompletionRequest(BaseModel):
    """The fields of OpenAI's ``POST /v1/completions`` that ssmq serves (others are ignored), plus vLLM's
    ``top_k`` and ``ignore_eos``. Strict types: ``"5"`` is not a number here."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k filter
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    logprobs: int | None = None
    echo: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    prompt: str
    model: str | None = None
    add_special_tokens: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    tokens: list[int]
    model: str | None = None


def parse(raw: bytes, schema: type[BaseModel]):
    """Body bytes → a validated ``schema`` instance, or APIError 400 naming the first problem."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON body: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object")
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"] if not isinstance(p, int) and "[" not in str(p)) or None
        raise APIError(400, f"{field or 'body'}: {err['msg']}", param=field) from None


@dataclass
class Prompt:
    ids: list[int]
    text: str | None  # as sent, when it was a string


def prompts_of(req: CompletionRequest, tokenizer) -> list[Prompt]:
    p = req.prompt
    if isinstance(p, str):
        items = [p]
    elif p and isinstance(p[0], int):
        items = [p]
    else:
        items = list(p)
    if not items:
        raise APIError(400, "prompt is empty", "prompt")
    out = []
    for item in items:
        if isinstance(item, str):
            out.append(Prompt(tokenizer.encode(item) if item else [], item))
        else:
            out.append(Prompt(list(item), None))
        if not out[-1].ids:
            raise APIError(400, "prompt is empty (no tokens)", "prompt")
    return out


def check(req: CompletionRequest, prompts: list[Prompt], vocab_size: int, max_model_len: int) -> list[int]:
    """Raise APIError for what the engine cannot serve; return max_tokens per prompt."""
    if not 1 <= req.n <= MAX_N:
        raise APIError(400, f"n must be in 1..{MAX_N}, got {req.n}", "n")
    if req.temperature < 0 or req.temperature > 2:
        raise APIError(400, f"temperature must be in [0, 2], got {req.temperature}", "temperature")
    if not 0 < req.top_p <= 1:
        raise APIError(400, f"top_p must be in (0, 1], got {req.top_p}", "top_p")
    if req.top_k < -1:
        raise APIError(400, f"top_k must be -1 (off) or >= 0, got {req.top_k}", "top_k")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise APIError(400, f"logprobs must be in 0..{MAX_LOGPROBS}, got {req.logprobs}", "logprobs")
    if seed_problem(req.seed):
        raise APIError(400, seed_problem(req.seed), "seed")
    stops = stop_strings(req)
    if len(stops) > MAX_STOPS or any(s == "" for s in stops):
        raise APIError(400, f"stop takes at most {MAX_STOPS} non-empty strings", "stop")
    budgets = []
    for p in prompts:
        bad = [t for t in p.ids if not 0 <= t < vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})", "prompt")
        room = max_model_len - len(p.ids)
        if room < 0 or (room == 0 and not (req.echo and req.max_tokens == 0)):
            raise APIError(400, f"this model's maximum context length is {max_model_len} tokens; the prompt has "
                                f"{len(p.ids)}", "prompt")
        m = room if req.max_tokens is None else req.max_tokens
        if m < 0 or (m == 0 and not req.echo):
            raise APIError(400, f"max_tokens must be >= 1 (0 only with echo), got {m}", "max_tokens")
        if m > room:
            raise APIError(400, f"this model's maximum context length is {max_model_len} tokens; the prompt has "
                                f"{len(p.ids)} and max_tokens asks for {m} more", "max_tokens")
        budgets.append(m)
    return budgets


def stop_strings(req: CompletionRequest) -> list[str]:
    if req.stop is None:
        return []
    return [req.stop] if isinstance(req.stop, str) else list(req.stop)
