"""The HTTP server: an OpenAI-compatible FastAPI app in front of the continuous-batching engine.

Routes: ``POST /v1/completions`` (streaming as server-sent events ending in ``data: [DONE]``), ``GET /v1/models``,
``GET /health``, ``GET /metrics`` (Prometheus text), and vLLM's ``POST /tokenize``, ``POST /detokenize``,
``GET /tokenizer_info`` (what lm-evaluation-harness's ``local-completions`` uses for a remote tokenizer).
Each completion choice is one engine request; a client that goes away aborts its requests at once.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import threading
import time
import uuid
import weakref
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ssmq.errors import SSMQError
from ssmq.runtime.body_limit import BodyLimit
from ssmq.runtime.completion import Choice
from ssmq.runtime.engine import Engine, Request as EngineRequest
from ssmq.runtime.metrics import ServerMetrics
from ssmq.runtime.protocol import (APIError, CompletionRequest, DetokenizeRequest, TokenizeRequest, check,
                                   error_body, parse, prompts_of, stop_strings)
from ssmq.runtime.sampling import SamplingParams

log = logging.getLogger("ssmq.serve")
DISCONNECT_POLL_S = 0.5


@dataclass
class ServerConfig:
    model_names: tuple[str, ...]  # the first is what /v1/models reports; any is accepted in requests
    max_body_bytes: int = 4 << 20
    body_timeout_s: float = 30.0  # the whole request body must arrive within this
    request_timeout_s: float | None = 600.0  # per engine request, from arrival to finish


def create_app(engine: Engine, tokenizer, config: ServerConfig, metrics: ServerMetrics | None = None) -> FastAPI:
    """The app over a started or not-yet-started engine (the app starts it with the server, stops it after)."""
    metrics = metrics or engine.metrics or ServerMetrics()
    engine.metrics = metrics
    vocab = engine.model.config.vocab_size
    max_len = engine.cfg.max_model_len
    created = int(time.time())

    async def lifespan(app):
        if engine._thread is None:
            engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="ssmq", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, e: StarletteHTTPException):
        return JSONResponse(error_body(str(e.detail)), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_, e: Exception):
        log.exception("internal error")
        return JSONResponse(error_body(f"internal error: {e}", "internal_error"), status_code=500)

    def check_model(name: str | None) -> None:
        if name is not None and name not in config.model_names:
            raise APIError(400, f"model {name!r} is not served here (served: {config.model_names[0]!r})", "model",
                           code="model_not_found")

    @app.get("/health")
    async def health():
        return {"status": "ok", **engine.stats()}

    @app.get("/metrics")
    async def prometheus():
        metrics.update(engine.stats())
        return Response(metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": config.model_names[0], "object": "model", "created": created,
                                            "owned_by": "ssmq", "max_model_len": max_len}]}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return {"eos_token": tokenizer.decode([tokenizer.eos_id]), "bos_token": None, "pad_token": None,
                "model_max_length": max_len, "tokenizer_class": type(tokenizer).__name__}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = parse(await request.body(), TokenizeRequest)
        check_model(req.model)
        ids = tokenizer.encode(req.prompt)
        return {"tokens": ids, "count": len(ids), "max_model_len": max_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = parse(await request.body(), DetokenizeRequest)
        check_model(req.model)
        if any(not 0 <= t < vocab for t in req.tokens):
            raise APIError(400, f"token ids must be in 0..{vocab - 1}", "tokens")
        return {"prompt": tokenizer.decode(req.tokens)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse(await request.body(), CompletionRequest)
        check_model(req.model)
        prompts = prompts_of(req, tokenizer)
        budgets = check(req, prompts, vocab, max_len)
        for prompt, budget in zip(prompts, budgets):
            why = engine.unfit(len(prompt.ids) + budget)
            if why:
                raise APIError(400, f"this request can never fit the cache: {why}", "max_tokens")
        stops = stop_strings(req)
        hide = None if req.ignore_eos else tokenizer.eos_id
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        choices, submitted = [], []
        for p_idx, (prompt, budget) in enumerate(zip(prompts, budgets)):
            for k in range(req.n):
                index = p_idx * req.n + k
                choices.append(Choice(index, prompt, tokenizer, stops, req.echo, req.logprobs, hide))
                params = SamplingParams(
                    max_new_tokens=max(budget, 1), temperature=req.temperature, top_k=max(req.top_k, 0),
                    top_p=req.top_p, stop_at_eos=not req.ignore_eos, eos_id=tokenizer.eos_id,
                    vocab_limit=min(len(tokenizer), vocab), seed=None if req.seed is None else req.seed + k)
                emit, flush = _emitter(loop, events, index)
                er = EngineRequest(prompt.ids, params, budget, emit, logprobs=req.logprobs,
                                   prompt_logprobs=req.echo and req.logprobs is not None,
                                   timeout=config.request_timeout_s, flush=flush)
                try:
                    engine.submit(er)
                except SSMQError as e:
                    for s in submitted:
                        engine.abort(s.id)
                    raise APIError(503, str(e), kind="server_busy") from None
                submitted.append(er)
        ids = [er.id for er in submitted]
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": config.model_names[0]}
        usage = _usage(prompts, choices)
        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            return StreamingResponse(_stream(engine, events, choices, ids, head, usage, include_usage),
                                     media_type="text/event-stream")
        try:
            while not all(c.finished for c in choices):
                try:
                    index, ev = await asyncio.wait_for(events.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return Response(status_code=499)
                    continue
                _handle(engine, choices[index], ids[index], ev)
        finally:
            for c, i in zip(choices, ids):
                if not c.finished:
                    engine.abort(i)
        failed = next((c.error for c in choices if c.error is not None), None)
        if failed is not None:
            kind = "timeout" if failed.status == 408 else "server_error"
            return JSONResponse(error_body(failed.message, kind), status_code=failed.status)
        return {**head, "choices": [c.body() for c in choices], "usage": usage()}

    return BodyLimit(app, config.max_body_bytes, config.body_timeout_s), app


class _Mailbox:
    """Engine thread → one event loop, with one wake-up per engine step for all the events of the step.

    ``call_soon_threadsafe`` per event writes to the loop's self-pipe each time (a syscall, which also hands the
    GIL to the loop thread mid-step): ~60% of the engine's host time per step at 64 streams, measured on the
    engine. Here ``put`` only appends; the engine calls ``flush`` once per step (see
    ssmq.runtime.engine).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        # a weak reference: the mailbox is the value of its loop's entry in _mailboxes, whose key must be free to go
        self.loop, self.items, self.scheduled = weakref.ref(loop), collections.deque(), False

    def put(self, queue: asyncio.Queue, item) -> None:
        self.items.append((queue, item))

    def flush(self) -> None:
        loop = self.loop()
        if self.items and not self.scheduled and loop is not None:
            self.scheduled = True
            loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        self.scheduled = False  # before taking: what a later flush adds is taken by the drain that flush schedules
        while self.items:
            queue, item = self.items.popleft()
            queue.put_nowait(item)


_mailboxes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop → its _Mailbox


def _emitter(loop: asyncio.AbstractEventLoop, events: asyncio.Queue, index: int):
    """(emit, flush) of an engine request reporting to ``events`` on ``loop`` (called on the loop, so the loop's
    mailbox is made there, never raced)."""
    box = _mailboxes.get(loop)
    if box is None:
        box = _mailboxes[loop] = _Mailbox(loop)
    return (lambda ev: box.put(events, (index, ev))), box.flush


def _handle(engine: Engine, choice: Choice, request_id: str, ev) -> None:
    already = choice.stopped
    choice.on_event(ev)
    if choice.stopped and not already:  # a stop string: the rest of this sequence is not wanted
        engine.abort(request_id)


def _usage(prompts, choices):
    def usage() -> dict:
        p = sum(len(x.ids) for x in prompts)
        c = sum(len(ch.tokens) for ch in choices)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
    return usage


async def _stream(engine, events, choices, ids, head, usage, include_usage):
    def sse(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    try:
        while not all(c.finished for c in choices):
            batch = [await events.get()]
            while not events.empty():  # behind the engine: one chunk per choice for all its new tokens
                batch.append(events.get_nowait())
            touched = []
            for index, ev in batch:
                c = choices[index]
                if c.finished:
                    continue
                _handle(engine, c, ids[index], ev)
                if c.error is not None:
                    yield sse(error_body(c.error.message, "timeout" if c.error.status == 408 else "server_error"))
                elif c not in touched:
                    touched.append(c)
            for c in touched:
                text, lp = c.take()
                if text or c.finished or (lp and lp["tokens"]):
                    yield sse({**head, "choices": [{"index": c.index, "text": text, "logprobs": lp,
                                                    "finish_reason": c.finish_reason}]})
        if include_usage:
            yield sse({**head, "choices": [], "usage": usage()})
        yield "data: [DONE]\n\n"
    finally:  # also when the client went away mid-stream (the generator is closed)
        for c, i in zip(choices, ids):
            if not c.finished:
                engine.abort(i)


def run_server(engine: Engine, tokenizer, config: ServerConfig, host: str = "127.0.0.1", port: int = 8000,
               log_level: str = "info") -> None:
    """Serve until interrupted (``ssmq serve``)."""
    import uvicorn

    asgi, _ = create_app(engine, tokenizer, config)
    uvicorn.run(asgi, host=host, port=port, log_level=log_level, timeout_keep_alive=5)


class BackgroundServer:
    """uvicorn in a thread on 127.0.0.1 (a free port unless given): for tests and benchmarks.

    ``with BackgroundServer(engine, tokenizer, config) as url: ...``
    """

    def __init__(self, engine: Engine, tokenizer, config: ServerConfig, port: int = 0):
        import socket

        import uvicorn

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", port))
        self.port = self.sock.getsockname()[1]
        asgi, self.app = create_app(engine, tokenizer, config)
        self.server = uvicorn.Server(uvicorn.Config(asgi, log_level="warning", timeout_keep_alive=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise SSMQError("the server did not start")
            time.sleep(0.02)
        return self.url

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()
