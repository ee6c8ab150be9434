"""The engine in a process of its own: the model, the cache, the scheduler and the sampler run in a child process;
the HTTP process keeps the API, tokenization, detokenization and the streams.

Why: the server's event loop formats one server-sent event per token per client (tens of microseconds of Python
each). In one process that work and the engine's loop share one interpreter lock, so at thousands of tokens a
second the engine waits for the HTTP side between steps. In a child process the engine's loop never does.

``ProcessEngine`` is the HTTP process's side, with the methods the server uses on ``Engine`` (``start``,
``submit``, ``abort``, ``fail_all``, ``unfit``, ``stats``, ``health``, ``shutdown``). The child is started with the
``spawn`` method (a fresh interpreter: CUDA initialises in the child alone) and builds its model there, by calling
``load(config)`` → a model, or (model, runner) (e.g. a runner whose calls are wrapped); the kernel policy active
where ``start()`` is called (``ssmq.kernels.policy``) is the child's too.

Wire (two one-way pipes, pickled tuples; a request is a small int ``wid`` on the wire):

- to the engine: ``("submit", wid, prompt, params, max_tokens, logprobs, prompt_logprobs, timeout, arrival)``,
  ``("abort", wid)``, ``("fail_all", message, status)``, ``("stop",)``;
- from the engine: ``("ready", info)`` or ``("error", line)`` once at start; then ``("step", items, prompt_tokens,
  queue_waits, stats)``, one message per engine step (sent when the engine flushes its events, see
  ssmq.runtime.engine), ``items`` = [(wid, token id | Event)]: a generated token without logprobs travels as its
  bare id, every other event (prompt logprobs, a token with logprobs, done, error) as the ``Event``.

Metrics: the engine process measures what only it sees (queue time: arrival to admission, prompt tokens); the HTTP
process measures time to first token and per output token where a client sees them (after the hand-over), and
counts generated tokens and finished requests. ``time.monotonic`` is one clock for every process of a machine, so
a request's arrival stamped here times its queue there.

Failure: a request's error is an event of that request alone, as in the thread engine. If the child dies (a crash
in a kernel, killed), the HTTP process fails every request in flight with 500, ``health()`` reports why, new
requests are refused (503); nothing waits forever. The child ignores SIGINT and SIGTERM (the HTTP process drains,
then stops it) and exits when the HTTP process goes away (its command pipe closes).
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import multiprocessing.util  # its exit hook (joining children) registered before ours, so ours runs first
import signal
import threading
import time
from collections.abc import Callable

from ssmq.errors import SSMQError
from ssmq.runtime.engine import TALLIES, EngineConfig, Event, check_servable, unfit_reason

log = logging.getLogger("ssmq.serve")


class ProcessEngine:
    """The engine in a child process, seen from the HTTP process (module doc).

    ``load(config)`` runs in the child (it must pickle: a module-level function or a ``functools.partial`` of one);
    ``start()`` returns once the child's engine is ready, or raises ``SSMQError`` with the child's one-line reason.
    """

    def __init__(self, load: Callable, config: EngineConfig, metrics=None, log_level: str = "info"):
        self.load, self.cfg, self.metrics, self.log_level = load, config, metrics, log_level
        self.vocab_size: int | None = None
        self.kv_blocks: tuple[int, int] | None = None  # (blocks, tokens per block) of the child's KV pools
        self._stats: dict = {}
        self._requests: dict[int, object] = {}  # wid -> the server's Request, until its done/error event
        self._wids: dict[str, int] = {}  # Request.id -> wid
        self._next = 0
        self._lock = threading.Lock()  # the command pipe and the maps above
        self._proc = None
        self._commands = self._events = None
        self._reader: threading.Thread | None = None
        self._error: str | None = None  # why the engine cannot serve (its process died)
        self._stopping = False

    # ---------------------------------------------------------------- lifecycle
    def launch(self) -> ProcessEngine:
        """Start the engine process without waiting for it (its model loads meanwhile); ``start()`` waits."""
        if self._proc is not None:
            return self
        from ssmq.kernels.policy import active

        ctx = multiprocessing.get_context("spawn")
        cmd_in, self._commands = ctx.Pipe(duplex=False)
        self._events, ev_out = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_child_main, name="ssmq-engine", daemon=False,
                                 args=(self.load, self.cfg, cmd_in, ev_out, self.log_level, active()))
        self._proc.start()
        cmd_in.close()  # the child holds the only copies of its ends: its death is an EOF here, ours one there
        ev_out.close()
        _LIVE.add(self)
        return self

    def start(self) -> ProcessEngine:
        """Start the engine process (unless launched) and wait until it is ready (once; later calls do nothing)."""
        self.launch()
        if self._reader is not None or self._stopping:
            return self
        try:
            msg = self._events.recv()
        except (EOFError, OSError):
            msg = None
        except BaseException:  # interrupted (Ctrl-C) while the model loads: the child ignores SIGINT
            self._proc.kill()
            self._join()
            raise
        if msg is None or msg[0] != "ready":
            code = self._join()
            raise SSMQError(msg[1] if msg else f"the engine process exited with code {code} before it was ready")
        info = msg[1]
        self.vocab_size, self.kv_blocks, self._stats = info["vocab_size"], info["kv_blocks"], info["stats"]
        self._reader = threading.Thread(target=self._read, name="ssmq-engine-reader", daemon=True)
        self._reader.start()
        return self

    def shutdown(self) -> None:
        """Stop the engine (what is left fails with 503, as in the thread engine) and end its process."""
        if self._proc is None or self._stopping:
            return
        self._stopping = True
        if self._reader is None:  # launched, never waited for (a failure beside its start): nothing to keep
            self._proc.kill()
        self._send(("stop",))
        if self._reader is not None:
            self._reader.join(timeout=60)  # the child reports its last events, then exits: EOF
        self._join()

    def _join(self) -> int | None:
        """Wait for the child to exit (kill it after 30 s: it ignores SIGTERM), close the pipes; its exit code."""
        proc = self._proc
        proc.join(timeout=30)
        if proc.is_alive():
            log.warning("the engine process did not exit within 30 s: killing it")
            proc.kill()
            proc.join()
        with self._lock:
            self._commands.close()
        if self._reader is None:  # (else the reader closes its end when it ends)
            self._events.close()
        _LIVE.discard(self)
        return proc.exitcode

    # ---------------------------------------------------------------- the server's side, any thread
    def unfit(self, n_tokens: int) -> str | None:
        """Why a sequence of ``n_tokens`` (prompt + max_tokens) can never run here, or None."""
        return unfit_reason(n_tokens, self.cfg.max_model_len, self.kv_blocks)

    def health(self) -> str | None:
        """Why the engine cannot serve (its process died), or None."""
        return self._error

    def stats(self) -> dict:
        """The engine's counts as of its last step (``Engine.stats``)."""
        return dict(self._stats)

    def submit(self, req) -> None:
        if self._error is not None:
            raise SSMQError(f"the engine is not running: {self._error}")
        check_servable(req, self.unfit)
        with self._lock:
            if self._error is not None:  # died meanwhile: the reader has failed what it knew of
                raise SSMQError(f"the engine is not running: {self._error}")
            if len(self._requests) - self._stats.get("running", 0) >= self.cfg.max_waiting:
                raise SSMQError(f"the queue is full ({self.cfg.max_waiting} requests waiting)")
            wid, self._next = self._next, self._next + 1
            self._requests[wid], self._wids[req.id] = req, wid
            msg = ("submit", wid, req.prompt, req.params, req.max_tokens, req.logprobs, req.prompt_logprobs,
                   req.timeout, req.arrival)
            if not self._send_locked(msg):
                del self._requests[wid], self._wids[req.id]
                raise SSMQError(f"the engine is not running: {self._error or 'its process has exited'}")

    def abort(self, request_id: str) -> None:
        """Finish the request now (client gone): its slot is free for the engine's next step."""
        wid = self._wids.get(request_id)
        if wid is not None:
            self._send(("abort", wid))

    def fail_all(self, message: str, status: int = 503) -> None:
        """Finish every request, queued or running, with an error (a drain past its deadline)."""
        self._send(("fail_all", message, status))

    def _send(self, msg) -> bool:
        with self._lock:
            return self._send_locked(msg)

    def _send_locked(self, msg) -> bool:
        try:
            self._commands.send(msg)
            return True
        except (OSError, ValueError):  # the child is gone (the reader reports it) or the pipe is closed
            return False

    # ---------------------------------------------------------------- reader thread
    def _read(self) -> None:
        while True:
            try:
                msg = self._events.recv()
            except (EOFError, OSError):
                break
            try:
                self._deliver(*msg[1:])
            except Exception:  # a bug here must not stop the reports of every other request
                log.exception("could not deliver the engine's events")
        self._events.close()
        if self._stopping:
            self._fail_left("server shutting down", 503)
            return
        self._proc.join(timeout=5)
        with self._lock:
            self._error = f"the engine process died (exit code {self._proc.exitcode})"
        log.error("%s: failing the %d requests in flight; /health reports unhealthy", self._error,
                  len(self._requests))
        self._fail_left(f"engine error: {self._error}", 500)

    def _fail_left(self, message: str, status: int) -> None:
        with self._lock:
            left = list(self._requests)
        if left:
            self._deliver([(wid, Event("error", message=message, status=status)) for wid in left], 0, [], None)

    def _deliver(self, items: list, prompt_tokens: int, waits: list, stats: dict | None) -> None:
        """Hand one engine step's events to their requests (``emit``), then one ``flush`` per distinct flush."""
        if stats is not None:
            self._stats = stats
        m = self.metrics
        if m is not None:
            if prompt_tokens:
                m.prompt_tokens.inc(prompt_tokens)
            for w in waits:
                m.queue.observe(w)
        now = time.monotonic()
        flushes = set()
        tokens = 0
        for wid, item in items:
            r = self._requests.get(wid)
            if r is None:  # finished already (e.g. failed here when the child died)
                continue
            ev = Event("token", token=item) if type(item) is int else item
            if ev.kind == "token" and m is not None:
                tokens += 1
                if r.last_time:
                    m.tpot.observe(now - r.last_time)
                else:
                    m.ttft.observe(now - r.arrival)
                r.last_time = now
            try:
                r.emit(ev)
            except Exception:  # the client side is gone: nothing left to tell
                log.debug("could not report to request %s", r.id)
            if r.flush is not None:
                flushes.add(r.flush)
            if ev.kind in ("done", "error"):
                with self._lock:
                    self._requests.pop(wid, None)
                    self._wids.pop(r.id, None)
                if m is not None:
                    m.requests.labels(outcome=ev.reason if ev.kind == "done" else "error").inc()
        if tokens:
            m.generated_tokens.inc(tokens)
        for flush in flushes:
            try:
                flush()
            except Exception:
                log.debug("could not hand events over", exc_info=True)


_LIVE: set = set()  # started engines: their processes are ended at interpreter exit


@atexit.register
def _end_children() -> None:  # before multiprocessing's exit hook, which would wait for the children forever
    for engine in list(_LIVE):
        try:
            engine.shutdown()
        except Exception:
            pass


# -------------------------------------------------------------------- the engine process
class _Tally:
    """The engine's ``metrics`` in its process: queue times and prompt tokens are kept for the next message; what
    the HTTP process measures itself (tokens, TTFT, TPOT, outcomes) is dropped here."""

    def __init__(self):
        self.waits: list[float] = []
        self.prompt = 0
        self.queue = _Call(self.waits.append)
        self.prompt_tokens = _Call(self._add)
        self.generated_tokens = self.ttft = self.tpot = self.requests = _NOTHING

    def _add(self, n: int = 1) -> None:
        self.prompt += n

    def take(self) -> tuple[int, list[float]]:
        prompt, waits = self.prompt, list(self.waits)
        self.prompt = 0
        self.waits.clear()
        return prompt, waits


class _Call:
    def __init__(self, fn):
        self.observe = self.inc = fn


class _Nothing:
    def observe(self, *_):
        pass

    inc = observe

    def labels(self, **_):
        return self


_NOTHING = _Nothing()


class _Outbox:
    """The engine's events, gathered per step and sent as one message (``flush``, the flush of every request)."""

    def __init__(self, conn):
        self.conn, self.items, self.tally, self.lock = conn, [], _Tally(), threading.Lock()
        self.engine = None
        self.sent: dict = {}

    def emitter(self, wid: int) -> Callable[[Event], None]:
        items = self.items

        def emit(ev: Event) -> None:
            items.append((wid, ev.token if ev.kind == "token" and ev.logprob is None else ev))
        return emit

    def flush(self) -> None:
        """(engine thread) this step's events, with the engine's stats and metrics."""
        items = self.items[:]  # the same list stays: the emitters hold it
        self.items.clear()
        self.send(items)

    def on_turn(self) -> None:
        """(engine thread, after each loop turn) the stats alone, when they changed without an event to carry them
        (a prompt's chunk prefilled, a request admitted)."""
        s = self.engine.stats()
        if {k: v for k, v in s.items() if k not in TALLIES} != {k: v for k, v in self.sent.items() if k not in TALLIES}:
            self.send([], s)

    def send(self, items: list, stats: dict | None = None) -> None:
        stats = self.engine.stats() if stats is None else stats
        with self.lock:
            prompt, waits = self.tally.take()
            self.conn.send(("step", items, prompt, waits, stats))
            self.sent = stats


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    text = text[0] if text else ""
    return text if isinstance(e, SSMQError) else f"the engine process failed to start: {type(e).__name__}: {text}"


def _child_main(load: Callable, cfg: EngineConfig, commands, events, log_level: str, policy) -> None:
    """The engine process: build the model and the engine, then run the engine's thread and take commands here.
    ``policy``: the kernel policy active where the engine was started (a process starts with the default)."""
    import os
    import sys

    import torch

    from ssmq.kernels.policy import set_policy
    from ssmq.runtime.engine import Engine, Request

    set_policy(policy)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the HTTP process drains on these, then stops the engine
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logger = logging.getLogger("ssmq")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(log_level.upper())
    box = _Outbox(events)
    try:
        loaded = load(cfg)
        model, runner = loaded if isinstance(loaded, tuple) else (loaded, None)
        engine = Engine(model, cfg, metrics=box.tally, runner=runner, on_turn=box.on_turn)
    except BaseException as e:  # noqa: BLE001 - every startup failure is one line to the HTTP process
        if not isinstance(e, SSMQError):
            log.exception("the engine process failed to start")
        events.send(("error", _one_line(e)))
        events.close()
        sys.exit(1)
    box.engine = engine
    kv = None if engine.blocks is None else (engine.blocks.total, engine.blocks.block_size)
    events.send(("ready", {"vocab_size": engine.vocab_size, "kv_blocks": kv, "stats": engine.stats(),
                           "pid": os.getpid(), "torch_threads": torch.get_num_threads()}))
    engine.start()
    while True:
        try:
            msg = commands.recv()
        except (EOFError, OSError):  # the HTTP process is gone
            break
        op = msg[0]
        if op == "submit":
            wid, prompt, params, max_tokens, logprobs, prompt_logprobs, timeout, arrival = msg[1:]
            r = Request(prompt, params, max_tokens, box.emitter(wid), logprobs=logprobs,
                        prompt_logprobs=prompt_logprobs, timeout=timeout, flush=box.flush, id=wid, arrival=arrival)
            try:
                engine.submit(r)
            except SSMQError as e:  # the queue filled meanwhile: this request's answer alone
                with box.lock:
                    events.send(("step", [(wid, Event("error", message=str(e), status=503))], 0, [], None))
        elif op == "abort":
            engine.abort(msg[1])
        elif op == "fail_all":
            engine.fail_all(msg[1], msg[2])
        elif op == "stop":
            break
    engine.shutdown()  # what is left fails with 503; its events are flushed before the loop ends
    with box.lock:
        events.close()
