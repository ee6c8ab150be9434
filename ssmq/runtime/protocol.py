"""The OpenAI completions and chat completions protocol: request schemas, their checks, and the OpenAI-style error
body.

Every problem with a request becomes an ``APIError`` (HTTP status + one-line message) answered as
``{"error": {"message", "type", "param", "code"}}``; the server goes on serving. A field ssmq does not serve is
refused by name (400), never ignored: unknown fields, ``best_of`` > 1, a ``suffix``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from ssmq.runtime.sampling import SamplingError, check_sampling

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


STRICT = ConfigDict(strict=True, extra="forbid")


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class SamplingFields(BaseModel):
    """What completions and chat completions share: OpenAI's sampling fields, plus vLLM's ``top_k`` and
    ``ignore_eos``. Strict types: ``"5"`` is not a number here; a field not listed is refused."""

    model_config = STRICT
    model: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k filter
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None  # token id (a string, as JSON keys are) -> bias in [-100, 100]
    user: str | None = None  # an end-user id for the client's records; it changes nothing


class CompletionRequest(SamplingFields):
    """OpenAI's ``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None  # 1 only (no server-side candidates)
    suffix: str | None = None  # none: no insertion mode


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def for_template(self) -> dict:
        content = self.content if not isinstance(self.content, list) else "".join(p.text for p in self.content)
        out = {"role": self.role, "content": content or ""}
        if self.name is not None:
            out["name"] = self.name
        return out


class ChatRequest(SamplingFields):
    """OpenAI's ``POST /v1/chat/completions`` (text messages)."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # OpenAI's newer name of max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    prompt: str
    model: str | None = None
    add_special_tokens: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    tokens: list[int]
    model: str | None = None


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def parse(raw: bytes, schema: type[BaseModel]):
    """Body bytes → a validated ``schema`` instance, or APIError 400 naming the first problem (malformed or too
    deeply nested JSON, NaN / Infinity, a lone surrogate escape, a wrong type, an unsupported field)."""
    try:
        data = json.loads(raw, parse_constant=_no_constant)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
        raise APIError(400, f"malformed JSON body: {e}") from None
    except RecursionError:
        raise APIError(400, "malformed JSON body: nested too deeply") from None
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object")
    if b"\\u" in raw and rb"\ud" in raw.lower():  # a \uD800-\uDFFF escape may leave a string no text can hold
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, "a string in the body holds a lone UTF-16 surrogate (\\uD800-\\uDFFF)") from None
    try:
        return schema.model_validate(data)
    except RecursionError:
        raise APIError(400, "malformed JSON body: nested too deeply") from None
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"] if not isinstance(p, int) and "[" not in str(p)) or None
        if err["type"] == "extra_forbidden":
            raise APIError(400, f"{field}: this field is not supported by this server", param=field) from None
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


def check_sampling_fields(req: SamplingFields, vocab_limit: int) -> None:
    """Raise APIError for a sampling field the engine cannot serve (``vocab_limit``: the ids it may produce)."""
    if not 1 <= req.n <= MAX_N:
        raise APIError(400, f"n must be in 1..{MAX_N}, got {req.n}", "n")
    if req.top_k < -1:
        raise APIError(400, f"top_k must be -1 (off) or >= 0, got {req.top_k}", "top_k")
    try:
        check_sampling(req.temperature, req.top_p, max(req.top_k, 0), req.frequency_penalty, req.presence_penalty,
                       req.logit_bias, vocab_limit)
    except SamplingError as e:
        raise APIError(400, str(e), e.param) from None
    if req.seed is not None and not 0 <= req.seed < 2**63:
        raise APIError(400, f"seed must be in [0, 2**63), got {req.seed}", "seed")
    stops = stop_strings(req)
    if len(stops) > MAX_STOPS or any(s == "" for s in stops):
        raise APIError(400, f"stop takes at most {MAX_STOPS} non-empty strings", "stop")


def check(req: CompletionRequest, prompts: list[Prompt], vocab_size: int, max_model_len: int,
          vocab_limit: int | None = None) -> list[int]:
    """Raise APIError for what the engine cannot serve; return max_tokens per prompt."""
    check_sampling_fields(req, vocab_size if vocab_limit is None else vocab_limit)
    if req.best_of is not None and req.best_of != 1:
        raise APIError(400, f"best_of must be 1 (this server returns every candidate it generates: use n), got "
                            f"{req.best_of}", "best_of")
    if req.suffix:
        raise APIError(400, "suffix is not supported (no insertion mode)", "suffix")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise APIError(400, f"logprobs must be in 0..{MAX_LOGPROBS}, got {req.logprobs}", "logprobs")
    return budgets(prompts, req.max_tokens, req.echo, vocab_size, max_model_len)


def budgets(prompts: list[Prompt], max_tokens: int | None, echo: bool, vocab_size: int, max_model_len: int,
            param: str = "max_tokens") -> list[int]:
    """Raise APIError for a prompt the engine cannot serve; return max_tokens per prompt (None: all the room)."""
    out = []
    for p in prompts:
        bad = [t for t in p.ids if not 0 <= t < vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})", "prompt")
        room = max_model_len - len(p.ids)
        if room < 0 or (room == 0 and not (echo and max_tokens == 0)):
            raise APIError(400, f"this model's maximum context length is {max_model_len} tokens; the prompt has "
                                f"{len(p.ids)}", "prompt")
        m = room if max_tokens is None else max_tokens
        if m < 0 or (m == 0 and not echo):
            raise APIError(400, f"{param} must be >= 1 (0 only with echo), got {m}", param)
        if m > room:
            raise APIError(400, f"this model's maximum context length is {max_model_len} tokens; the prompt has "
                                f"{len(p.ids)} and {param} asks for {m} more", param)
        out.append(m)
    return out


def stop_strings(req: SamplingFields) -> list[str]:
    if req.stop is None:
        return []
    return [req.stop] if isinstance(req.stop, str) else list(req.stop)
