"""The HTTP server: an OpenAI-compatible FastAPI app in front of the continuous-batching engine.

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (streaming as server-sent events ending in
``data: [DONE]``), ``GET /v1/models``, ``GET /health`` (503 with ``"status": "draining"`` while draining, and
``"status": "unhealthy"`` once the engine cannot serve: its process died),
``GET /metrics`` (OpenMetrics, or Prometheus text), and vLLM's ``POST /tokenize``, ``POST /detokenize``,
``GET /tokenizer_info`` (what lm-evaluation-harness's ``local-completions`` uses for a remote tokenizer).
Each completion choice is one engine request; a client that goes away, streaming or not, aborts its requests at
once (its slot and KV blocks are free for the next engine step).

In front of the app (``_Gate``, then ``BodyLimit``): the API key (401), draining (503), the body's size (413) and
arrival time (408); below it, uvicorn's h11 protocol with a header-read timeout and a bound on open connections.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import json
import logging
import signal
import threading
import time
import uuid
import weakref
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ssmq.errors import SSMQError
from ssmq.runtime.body_limit import BodyLimit, reject
from ssmq.runtime.chat import ChatTemplate, ChatTemplateError
from ssmq.runtime.completion import Choice
from ssmq.runtime.engine import Engine, Request as EngineRequest
from ssmq.runtime.metrics import ServerMetrics
from ssmq.runtime.protocol import (MAX_LOGPROBS, APIError, ChatRequest, CompletionRequest, DetokenizeRequest, Prompt,
                                   SamplingFields, TokenizeRequest, budgets, check, check_sampling_fields, error_body,
                                   parse, prompts_of, stop_strings)
from ssmq.runtime.sampling import SamplingParams

log = logging.getLogger("ssmq.serve")


@dataclass
class ServerConfig:
    model_names: tuple[str, ...]  # the first is what /v1/models reports; any is accepted in requests
    max_body_bytes: int = 4 << 20
    body_timeout_s: float = 30.0  # the whole request body must arrive within this
    request_timeout_s: float | None = 600.0  # per engine request, from arrival to finish
    header_timeout_s: float = 10.0  # a request's headers must arrive within this (else 408 and close)
    max_connections: int | None = 1024  # open connections beyond this are answered 503 and closed
    drain_timeout_s: float = 30.0  # SIGTERM: requests in flight get this long to finish
    api_key: str | None = None  # required as "Authorization: Bearer KEY" on every route but /health, /metrics
    chat_template: ChatTemplate | None = None


class ServerState:
    """What the front (``_Gate``) and the shutdown share: draining, and the API requests in flight."""

    def __init__(self):
        self.draining = False
        self.inflight = 0


OPEN_PATHS = frozenset({"/health", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})


class _Gate:
    """Before a body is read: the API key (401, constant-time compare) and draining (503) for every API route;
    counts the API requests in flight (a stream until its last byte)."""

    def __init__(self, app, state: ServerState, api_key: str | None):
        self.app, self.state = app, state
        self.expected = None if api_key is None else b"Bearer " + api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        if self.expected is not None:
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                return await reject(send, 401, "invalid or missing API key (Authorization: Bearer KEY)",
                                    "authentication_error", [(b"www-authenticate", b"Bearer")])
        if self.state.draining:
            return await reject(send, 503, "the server is draining (shutting down): send the request elsewhere",
                                "server_busy")
        self.state.inflight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.inflight -= 1


_SCHEMAS: dict = {}  # the models the request bodies refer to, for the OpenAPI components


def _body_schema(model) -> dict:
    """An OpenAPI request body for a route that parses its body itself (``parse``), from its pydantic schema."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    _SCHEMAS.update(schema.pop("$defs", {}))
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def create_app(engine: Engine, tokenizer, config: ServerConfig, metrics: ServerMetrics | None = None):
    """(the ASGI app to serve, the FastAPI app) over a started or not-yet-started engine (the app starts it with
    the server, stops it after): an ``Engine`` (a thread of this process) or a ``ProcessEngine`` (a process of its
    own, ssmq.runtime.engine_proc), which have the same methods. ``app.state.ssmq`` is the ``ServerState``."""
    metrics = metrics or engine.metrics or ServerMetrics()
    engine.metrics = metrics
    vocab = engine.vocab_size
    vocab_limit = min(len(tokenizer), vocab)
    max_len = engine.cfg.max_model_len
    created = int(time.time())
    state = ServerState()
    template = config.chat_template
    chat_eos = tokenizer.eos_id  # the end of an assistant turn: the template's EOS when it is one token
    if template is not None and template.eos_token:
        ids = tokenizer.encode(template.eos_token)
        if len(ids) == 1:
            chat_eos = ids[0]

    async def lifespan(app):
        engine.start()
        s = engine.stats()
        log.info("engine: %d cache slots, max model len %d%s", s["slots_total"], max_len,
                 f", {s['kv_blocks_total']} KV blocks of {engine.cfg.kv_block_size} tokens"
                 if "kv_blocks_total" in s else "")
        yield
        engine.shutdown()

    app = FastAPI(title="ssmq", lifespan=lifespan)
    app.state.ssmq = state

    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, e: StarletteHTTPException):
        return JSONResponse(error_body(str(e.detail)), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_, e: Exception):
        log.exception("internal error")
        return JSONResponse(error_body(f"internal error: {type(e).__name__}: {e}", "internal_error"),
                            status_code=500)

    def check_model(name: str | None) -> None:
        if name is not None and name not in config.model_names:
            raise APIError(400, f"model {name!r} is not served here (served: {config.model_names[0]!r})", "model",
                           code="model_not_found")

    @app.get("/health")
    async def health():
        why = engine.health()
        if why is not None:
            return JSONResponse({"status": "unhealthy", "error": why, **engine.stats()}, status_code=503)
        if state.draining:
            return JSONResponse({"status": "draining", **engine.stats()}, status_code=503)
        return {"status": "ok", **engine.stats()}

    @app.get("/metrics")
    async def prometheus(request: Request):
        metrics.update(engine.stats())
        body, media_type = metrics.text(request.headers.get("accept", ""))
        return Response(body, media_type=media_type)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": config.model_names[0], "object": "model", "created": created,
                                            "owned_by": "ssmq", "max_model_len": max_len}]}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return {"eos_token": tokenizer.decode([tokenizer.eos_id]), "bos_token": None, "pad_token": None,
                "model_max_length": max_len, "tokenizer_class": type(tokenizer).__name__}

    @app.post("/tokenize", openapi_extra=_body_schema(TokenizeRequest))
    async def tokenize(request: Request):
        req = parse(await request.body(), TokenizeRequest)
        check_model(req.model)
        ids = tokenizer.encode(req.prompt)
        return {"tokens": ids, "count": len(ids), "max_model_len": max_len}

    @app.post("/detokenize", openapi_extra=_body_schema(DetokenizeRequest))
    async def detokenize(request: Request):
        req = parse(await request.body(), DetokenizeRequest)
        check_model(req.model)
        if any(not 0 <= t < vocab for t in req.tokens):
            raise APIError(400, f"token ids must be in 0..{vocab - 1}", "tokens")
        return {"prompt": tokenizer.decode(req.tokens)}

    def submit(req: SamplingFields, prompts: list[Prompt], budget: list[int], echo: bool, logprobs: int | None,
               eos: int, prompt_logprobs: bool):
        """One engine request per choice → (choices, their engine ids, the event queue they report to)."""
        for prompt, b in zip(prompts, budget):
            why = engine.unfit(len(prompt.ids) + b)
            if why:
                raise APIError(400, f"this request can never fit the cache: {why}", "max_tokens")
        stops = stop_strings(req)
        hide = None if req.ignore_eos else eos
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        choices, submitted = [], []
        for p_idx, (prompt, b) in enumerate(zip(prompts, budget)):
            for k in range(req.n):
                index = p_idx * req.n + k
                choices.append(Choice(index, prompt, tokenizer, stops, echo, logprobs, hide))
                params = SamplingParams(
                    max_new_tokens=max(b, 1), temperature=req.temperature, top_k=max(req.top_k, 0),
                    top_p=req.top_p, stop_at_eos=not req.ignore_eos, eos_id=eos, vocab_limit=vocab_limit,
                    seed=None if req.seed is None else req.seed + k, frequency_penalty=req.frequency_penalty,
                    presence_penalty=req.presence_penalty, logit_bias=req.logit_bias)
                emit, flush = _emitter(loop, events, index)
                er = EngineRequest(prompt.ids, params, b, emit, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                   timeout=config.request_timeout_s, flush=flush)
                try:
                    engine.submit(er)
                except SSMQError as e:
                    for s in submitted:
                        engine.abort(s.id)
                    raise APIError(503, str(e), kind="server_busy") from None
                submitted.append(er)
        return choices, [er.id for er in submitted], events

    async def respond(request: Request, req: SamplingFields, prompts, choices, ids, events, head, render, whole):
        """The stream (``render(choice, text, logprobs, first)`` → a chunk's choice) or the whole answer
        (``whole(choices, usage)``), aborting what is unfinished when the client goes away."""
        usage = _usage(prompts, choices)
        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            return StreamingResponse(_stream(engine, events, choices, ids, head, usage, include_usage, render),
                                     media_type="text/event-stream")
        watcher = asyncio.ensure_future(_watch_disconnect(request.receive, events))
        try:
            while not all(c.finished for c in choices):
                index, ev = await events.get()
                if index is None:  # the client went away: its requests end now (finally), whatever the step speed
                    return Response(status_code=499)
                _handle(engine, choices[index], ids[index], ev)
        finally:
            watcher.cancel()
            for c, i in zip(choices, ids):
                if not c.finished:
                    engine.abort(i)
        failed = next((c.error for c in choices if c.error is not None), None)
        if failed is not None:
            kind = "timeout" if failed.status == 408 else "server_error"
            return JSONResponse(error_body(failed.message, kind), status_code=failed.status)
        return whole(choices, usage())

    @app.post("/v1/completions", openapi_extra=_body_schema(CompletionRequest))
    async def completions(request: Request):
        req = parse(await request.body(), CompletionRequest)
        check_model(req.model)
        prompts = prompts_of(req, tokenizer)
        budget = check(req, prompts, vocab, max_len, vocab_limit)
        choices, ids, events = submit(req, prompts, budget, req.echo, req.logprobs, tokenizer.eos_id,
                                      req.echo and req.logprobs is not None)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": config.model_names[0]}

        def render(c, text, lp, first):
            return {"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason}

        def whole(choices, usage):
            return {**head, "choices": [c.body() for c in choices], "usage": usage}

        return await respond(request, req, prompts, choices, ids, events, head, render, whole)

    @app.post("/v1/chat/completions", openapi_extra=_body_schema(ChatRequest))
    async def chat_completions(request: Request):
        req = parse(await request.body(), ChatRequest)
        check_model(req.model)
        if template is None:
            raise APIError(400, "this model has no chat template (none in its tokenizer files): start the server "
                                "with --chat-template FILE, or use /v1/completions", "messages",
                           code="chat_template_missing")
        check_sampling_fields(req, vocab_limit)
        if not req.messages:
            raise APIError(400, "messages is empty", "messages")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        k = req.top_logprobs or 0
        if not 0 <= k <= MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs must be in 0..{MAX_LOGPROBS}, got {k}", "top_logprobs")
        try:
            text = template.render([m.for_template() for m in req.messages])
        except ChatTemplateError as e:
            raise APIError(400, str(e), "messages") from None
        prompts = [Prompt(tokenizer.encode(text), None)]
        if not prompts[0].ids:
            raise APIError(400, "the templated prompt is empty (no tokens)", "messages")
        budget = budgets(prompts, max_tokens, False, vocab, max_len,
                         "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens")
        logprobs = k if req.logprobs else None
        choices, ids, events = submit(req, prompts, budget, False, logprobs, chat_eos, False)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": config.model_names[0]}

        def render(c, text, lp, first):
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            return {"index": c.index, "delta": delta, "logprobs": _chat_logprobs(lp, k),
                    "finish_reason": c.finish_reason}

        def whole(choices, usage):
            return {**head, "object": "chat.completion", "usage": usage, "choices": [
                {"index": c.index, "message": {"role": "assistant", "content": c.body()["text"]},
                 "logprobs": _chat_logprobs(c.lp, k), "finish_reason": c.finish_reason} for c in choices]}

        return await respond(request, req, prompts, choices, ids, events, head, render, whole)

    def openapi() -> dict:
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
            spec.setdefault("components", {}).setdefault("schemas", {}).update(_SCHEMAS)
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi
    front = BodyLimit(app, config.max_body_bytes, config.body_timeout_s)
    return _Gate(front, state, config.api_key), app


def _chat_logprobs(lp: dict | None, k: int) -> dict | None:
    """Completions-style logprobs → chat's ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    if lp is None:
        return None

    def entry(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {"content": [{**entry(t, v), "top_logprobs": [entry(a, b) for a, b in list((top or {}).items())[:k]]}
                        for t, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"])]}


async def _watch_disconnect(receive, events: asyncio.Queue) -> None:
    """Put ``(None, None)`` on ``events`` when the client disconnects (the body was read: the next ASGI message
    is the disconnect)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            events.put_nowait((None, None))
            return


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


async def _stream(engine, events, choices, ids, head, usage, include_usage, render):
    def sse(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    started = set()
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
                    yield sse({**head, "choices": [render(c, text, lp, c.index not in started)]})
                    started.add(c.index)
        if include_usage:
            yield sse({**head, "choices": [], "usage": usage()})
        yield "data: [DONE]\n\n"
    finally:  # also when the client went away mid-stream (the generator is closed)
        for c, i in zip(choices, ids):
            if not c.finished:
                engine.abort(i)


def _http_protocol(header_timeout_s: float):
    """uvicorn's h11 protocol with a header-read timeout: a connection whose request headers are not whole within
    ``header_timeout_s`` of its first byte (or of its opening, when it sends nothing) gets 408 and is closed.
    (uvicorn times only the idle keep-alive; the body has its own timeout in ``BodyLimit``.)"""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._header_timer, self._partial = None, False
            self._arm()

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout_s, self._header_timeout)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_timer, self._partial = None, False

        def data_received(self, data: bytes) -> None:
            if self.conn.their_state is h11.IDLE:  # bytes of the next request's headers
                self._partial = True
                self._arm()
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # the headers are whole (or the connection failed)
                self._disarm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _header_timeout(self) -> None:
            self._header_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            if self._partial:
                body = json.dumps(error_body(f"request headers not received within {header_timeout_s:g} s",
                                             "timeout")).encode()
                self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                     b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
            self.transport.close()

    return Protocol


def _uvicorn_config(asgi, config: ServerConfig, **kw):
    import uvicorn

    # uvicorn answers 503 once its open connections (this one included) reach limit_concurrency
    limit = None if config.max_connections is None else config.max_connections + 1
    return uvicorn.Config(asgi, timeout_keep_alive=5, http=_http_protocol(config.header_timeout_s),
                          limit_concurrency=limit, **kw)


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server with a drain: the first SIGTERM (or SIGINT) starts it (``/health`` answers 503
        "draining", new API requests 503); the server exits once no API request is in flight, or at the drain
        deadline after failing what is left (503); a second signal exits at once. Exit code 0 after a drain, 1
        when forced (uvicorn itself would re-raise the signal: 143)."""

        def __init__(self, config, state: ServerState, engine: Engine, drain_timeout_s: float):
            super().__init__(config)
            self.state, self.engine, self.drain_timeout_s = state, engine, drain_timeout_s
            self.exit_code = 0
            self._loop: asyncio.AbstractEventLoop | None = None

        async def serve(self, sockets=None) -> None:
            self._loop = asyncio.get_running_loop()
            await super().serve(sockets)

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            sigs = (signal.SIGINT, signal.SIGTERM)
            original = {sig: signal.signal(sig, self.handle_exit) for sig in sigs}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig, frame) -> None:
            if self.state.draining:
                log.warning("second signal: exiting now")
                self.exit_code = 1
                self.engine.fail_all("server shutting down", 503)
                self.force_exit = self.should_exit = True
                return
            self.begin_drain()

        def begin_drain(self) -> None:
            """Start draining (any thread)."""
            if self._loop is None:
                self.should_exit = True
                return
            self._loop.call_soon_threadsafe(self._start_drain)

        def _start_drain(self) -> None:
            if not self.state.draining:
                self.state.draining = True
                log.warning("draining: %d API requests in flight, deadline %g s", self.state.inflight,
                            self.drain_timeout_s)
                self._drain_task = asyncio.ensure_future(self._drain())

        async def _drain(self) -> None:
            deadline = time.monotonic() + self.drain_timeout_s
            while self.state.inflight and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if self.state.inflight:
                log.warning("drain deadline: failing %d API requests still in flight", self.state.inflight)
                self.engine.fail_all("server shutting down (drain deadline passed)", 503)
                while self.state.inflight and time.monotonic() < deadline + 5:
                    await asyncio.sleep(0.05)
            self.should_exit = True

    return Server


def run_server(engine: Engine, tokenizer, config: ServerConfig, host: str = "127.0.0.1", port: int = 8000,
               log_level: str = "info") -> int:
    """Serve until a signal ends the drain (``ssmq serve``); the process exit code (0 after a drain)."""
    asgi, app = create_app(engine, tokenizer, config)
    server = _server_class()(_uvicorn_config(asgi, config, host=host, port=port, log_level=log_level),
                             app.state.ssmq, engine, config.drain_timeout_s)
    server.run()
    return server.exit_code


class BackgroundServer:
    """uvicorn in a thread on 127.0.0.1 (a free port unless given): for tests and benchmarks.

    ``with BackgroundServer(engine, tokenizer, config) as url: ...``; ``drain()`` starts a drain.
    """

    def __init__(self, engine: Engine, tokenizer, config: ServerConfig, port: int = 0):
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", port))
        self.port = self.sock.getsockname()[1]
        asgi, self.app = create_app(engine, tokenizer, config)
        self.server = _server_class()(_uvicorn_config(asgi, config, log_level="warning"), self.app.state.ssmq,
                                      engine, config.drain_timeout_s)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def drain(self) -> None:
        self.server.begin_drain()

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
