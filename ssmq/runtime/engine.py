"""Continuous-batching engine: requests join and leave the running decode batch at every step.

Glossary: *slot* a cache row owned by one sequence from admission to finish (its conv + SSM state, and for hybrids
its KV block table, over block pools of float or quantized KV); *chunk* a piece of a prompt prefilled in one call;
*step* one turn of the engine loop: admit waiting requests into free slots, prefill up to ``prefill_tokens`` prompt
tokens over the requests in prefill, at most ``prefill_chunk`` of one request (so a long prompt does not stall
everyone: its chunks are interleaved with decode steps), then decode one token for every sequence past its prefill,
all rows in one call.

Batched prefill: the chunks of a step that have the same length are prefilled together, one forward of (b, n)
tokens (``prefill_groups``). Rows of one forward never differ in length, so no padding enters a state: each row's
conv and SSM states continue exactly from its previous chunk, and attention appends the chunk's keys and values at
each row's own positions. A forward of several rows that raises is blamed on none of them: each row restarts its
prompt from an empty state and is prefilled alone from then on, so a fault that belongs to one request fails that
request only. With ``overlap`` (on CUDA) a step launches its decode before it reads back the tokens of the step
before, so the host work of a step (reporting, scheduling) runs while the device computes.

The engine runs in its own thread (``Engine``), or in a process of its own behind a proxy with the same methods
(``ssmq.runtime.engine_proc.ProcessEngine``); ``submit`` and ``abort`` may be called from any thread. Each request
reports through its ``emit`` callback, called from the engine thread with one ``Event`` at a time; ``emit`` may only
queue the event if the request also has a ``flush``, called once per step after events were emitted to the request
(one hand-off to the server's event loop per step, not per token): on CUDA as soon as the next decode step is
launched, or at the end of the turn when no decode follows; elsewhere as soon as the step has sampled its tokens.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ssmq.errors import SSMQError
from ssmq.models.cache import int8_state_note
from ssmq.models.state import ids_on_device
from ssmq.runtime.host_copy import HostCopy
from ssmq.runtime.kv_blocks import BlockAllocator
from ssmq.runtime.sampling import SamplingParams, count_tokens, sample_rows, top_logprobs

log = logging.getLogger("ssmq.serve")

# counts in Engine.stats() that grow every turn (since start): steps, prefill forwards and their rows, and the
# engine thread's wall time (ms) in its steps and in their prefill forwards (each waits for its first tokens, so on
# a GPU it holds the forward's device time, and what was queued before it)
TALLIES = ("steps", "prefill_forwards", "prefill_rows", "prefill_ms", "busy_ms")


@dataclass
class EngineConfig:
    max_batch: int = 64  # cache slots = sequences decoded together
    max_model_len: int = 2048  # prompt + generated tokens of one sequence
    # prompt tokens prefilled per step, over every request in prefill (batched). Mamba2-2.7B, 64 clients of 128-token
    # prompts on an H100: 8192 (every waiting prompt in one forward) reached 0.69 of the decode-step bound, 2048 0.53
    # (benchmarks/results/serve-prefill-h100.json)
    prefill_tokens: int = 8192
    prefill_chunk: int = 512  # prompt tokens of one request prefilled per step (chunked prefill)
    # tokens per KV block (hybrids): whole 32-token tiles of the decode kernels (H100, one Llama-8B layer
    # at 128K tokens, in place / contiguous: 4-bit codes 1.08 at 32, 1.21 at 16; float16 1.04 / 1.08)
    kv_block_size: int = 32
    # KV blocks per attention layer; None: from kv_cache_bytes, else a quarter of the slots
    kv_blocks: int | None = None
    kv_cache_bytes: int | None = None  # KV memory (all attention layers) the blocks take, in the cache's format,
    # with the decode workspace that grows with them (kv_pool_bytes_per_token)
    max_waiting: int = 4096  # queued requests beyond which submit refuses
    cuda_graphs: bool = True  # decode (and prefill) from CUDA graphs on CUDA
    # rows x tokens of the largest prefill forward replayed from CUDA graphs (rows padded to a power of two), where
    # the host's launches set an eager forward's time (Mamba2-2.7B FP16 on an H100: 1024 tokens take 37 ms eagerly,
    # 15 ms from a graph; 8192 tokens 111 ms eagerly, their GPU time); larger forwards run eagerly, unpadded
    graph_prefill_tokens: int = 512
    # a prefill forward too large for one graph runs as up to this many graph-sized forwards of its rows (each from
    # graphs) instead of eagerly: below a few thousand tokens the host's launches, not the device, set an eager
    # forward's time. Mamba2-2.7B FP16 on an H100, 1024 requests of 128 + 128 tokens, share of the decode-step
    # bound at 64 / 256 clients: 1 (never split) 0.72 / 0.75, 4 0.75 / 0.73, 8 0.76 / 0.75
    # (benchmarks/results/serve-admission-h100.json)
    graph_prefill_pieces: int = 8
    state_checkpoint: int | None = None  # K: SSM states written once every K decode steps (ReplaySSM); None: every step
    # launch decode step n+1 before reading step n's tokens back, so the engine's host work of a step runs while the
    # device computes the next (a row that stops at n has computed one token more, dropped); None: on CUDA
    overlap: bool | None = None


@dataclass
class Event:
    """``kind``: "prompt" (``prompt``: [(logprob, top)] for prompt tokens 1..), "token" (``token``, ``logprob``,
    ``top``: [(id, logprob)] or None), "done" (``reason``: stop | length | abort), "error" (``message``)."""

    kind: str
    token: int | None = None
    logprob: float | None = None
    top: list | None = None
    prompt: list | None = None
    reason: str | None = None
    message: str | None = None
    status: int = 500  # HTTP status of an "error": 408 timed out, 500 engine failure, 503 shutting down


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams  # params.max_new_tokens is ignored: ``max_tokens`` rules (it may be 0 with echo)
    max_tokens: int
    emit: Callable[[Event], None]
    logprobs: int | None = None  # top-k alternatives reported per generated token (None: no logprobs)
    prompt_logprobs: bool = False  # report the logprob of every prompt token (echo + logprobs)
    timeout: float | None = None  # seconds from arrival
    flush: Callable[[], None] | None = None  # delivers what ``emit`` queued; called once per step (module doc)
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    arrival: float = field(default_factory=time.monotonic)
    # engine-side state
    slot: int = -1
    pos: int = 0  # prompt tokens prefilled so far
    output: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    carry: torch.Tensor | None = None  # log-softmax of the last prefilled position (prompt logprobs across chunks)
    ahead: int = 0  # tokens sampled on the device, not yet read back (overlap: 0 or 1)
    last_time: float = 0.0
    counts: torch.Tensor | None = None  # (vocab,) float: generated tokens, when the sampling has penalties
    failure: str | None = None  # why this request's last sampled token is -1 (the sampler raised)
    alone: bool = False  # prefilled in forwards of its own (a batched forward it was part of raised)

    def top_k(self) -> int:
        return max(self.logprobs or 0, 1)


@dataclass
class _Sampled:
    """A step's tokens, still on the device: ``toks`` (b,) for ``rows``; ``lp`` (chosen, top values, top ids) for
    the rows at indices ``want`` (those asking for logprobs); ``host``: their copies on the way to the host."""

    rows: list[Request]
    toks: torch.Tensor
    want: list[int]
    lp: tuple = ()
    host: HostCopy | None = None

    def send_to_host(self) -> None:
        """Start copying toks and lp to the host without waiting (``HostCopy``: reading them back then waits for
        this step alone, not for the step launched after it)."""
        self.host = HostCopy(self.toks, *self.lp)

    def on_host(self) -> tuple[list, tuple]:
        """(tokens, (chosen, top values, top ids) or ()) as lists, once the step is done."""
        toks, *lp = (self.host or HostCopy(self.toks, *self.lp)).lists()
        return toks, tuple(lp)


def prefill_groups(remaining: list[int], budget: int, chunk: int, keys: list | None = None) -> list[tuple[int, list]]:
    """The forwards of one step's prefill: ``remaining`` prompt tokens of each request in prefill (first come first),
    ``budget`` tokens for the step, at most ``chunk`` per request → [(n, [request indices])], one forward of (b, n)
    tokens per entry, in order of first appearance. Requests take min(remaining, chunk, what is left of the budget)
    in turn; those with the same n (and the same ``keys`` entry, when given) share a forward."""
    groups: dict = {}
    for i, left in enumerate(remaining):
        n = min(left, chunk, budget)
        if n <= 0:
            break
        groups.setdefault((n, None if keys is None else keys[i]), []).append(i)
        budget -= n
    return [(n, rows) for (n, _), rows in groups.items()]


def unfit_reason(n_tokens: int, max_model_len: int, kv_blocks: tuple[int, int] | None) -> str | None:
    """Why a sequence of ``n_tokens`` (prompt + max_tokens) can never run in an engine of ``max_model_len`` whose
    KV pools (hybrids) hold ``kv_blocks`` = (blocks, tokens per block), or None."""
    if n_tokens > max_model_len:
        return f"{n_tokens} tokens exceed the engine's max_model_len {max_model_len}"
    if kv_blocks is not None:
        total, size = kv_blocks
        need = -(-n_tokens // size)
        if need > total:
            return f"{n_tokens} tokens need {need} KV blocks; the cache has {total} of {size} tokens"
    return None


def check_servable(req, unfit: Callable[[int], str | None]) -> None:
    """Raise SSMQError for a request no step can ever serve: an empty prompt, or a prompt and max_tokens that
    ``unfit`` (an engine's ``unfit``) says never fit."""
    if len(req.prompt) == 0:
        raise SSMQError("empty prompt")
    why = unfit(len(req.prompt) + req.max_tokens)
    if why:
        raise SSMQError(why)


def kv_bytes_per_token(model) -> float:
    """Bytes a token takes in the KV cache of every attention layer of ``model`` (float or quantized, as allocated)."""
    dtype = model.norm_f.weight.dtype
    return sum(m.kv_bytes_per_token(dtype) for m in model.state_modules() if hasattr(m, "kv_bytes_per_token"))


def kv_pool_bytes_per_token(model) -> float:
    """What a token of the KV pools costs in GPU memory: its bytes in every layer's cache and in the largest decode
    workspace that grows with the pools (a KVQuant model with outliers: its outlier passes' scores)."""
    workspace = max((m.decode_workspace_bytes_per_token() for m in model.state_modules()
                     if hasattr(m, "decode_workspace_bytes_per_token")), default=0)
    return kv_bytes_per_token(model) + workspace


def kv_block_count(model, cfg: EngineConfig) -> int:
    """KV blocks of the engine's pools (the null block aside): ``kv_blocks``, or as many as ``kv_cache_bytes`` holds
    in the model's KV format and workspace (``kv_pool_bytes_per_token``; a quantized cache: 3.5-5x the float16
    blocks), or a quarter of max_batch × max_model_len tokens."""
    if cfg.kv_blocks:
        return cfg.kv_blocks
    if cfg.kv_cache_bytes:
        n = int(cfg.kv_cache_bytes // (cfg.kv_block_size * kv_pool_bytes_per_token(model))) - 1
        if n < 1:
            raise SSMQError(f"a KV cache of {cfg.kv_cache_bytes / 2 ** 30:.3g} GiB holds no block of "
                            f"{cfg.kv_block_size} tokens of this model")
        return n
    return max(2, -(-cfg.max_batch * cfg.max_model_len // (4 * cfg.kv_block_size)))


class LocalRunner:
    """The model calls of the engine on this process: the cache, and the CUDA graphs of decode and prefill on GPU."""

    def __init__(self, model, cfg: EngineConfig):
        self.model, self.device = model, model.device
        note = int8_state_note(model, cfg.state_checkpoint)
        if note:
            log.warning(note)
        graphs = self.device.type == "cuda" and cfg.cuda_graphs
        kw = {"state_checkpoint": cfg.state_checkpoint}  # the model's own state formats (int8 when calibrated)
        self.kv_blocks = None  # (blocks, block size) when attention layers keep their KV in blocks
        if model.config.attention_layers():
            n = kv_block_count(model, cfg)
            log.info("KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB with its decode workspace)", n,
                     cfg.kv_block_size, n * cfg.kv_block_size,
                     (n + 1) * cfg.kv_block_size * kv_pool_bytes_per_token(model) / 2 ** 30)
            self.kv_blocks = (n + 1, cfg.kv_block_size)  # + the null block
            kw.update(kv_blocks=n + 1, kv_block_size=cfg.kv_block_size)
        # the graphs' padding rows use one more, scratch, slot
        self.cache = model.allocate_cache(cfg.max_batch + graphs, cfg.max_model_len, **kw)
        self.graph_prefill, self.graph_pieces = None, cfg.graph_prefill_pieces
        if graphs:
            from ssmq.runtime.cuda_graph import CudaGraphDecoder, CudaGraphPrefill

            dec = CudaGraphDecoder(model, max_batch=cfg.max_batch, max_seqlen=cfg.max_model_len, cache=self.cache)
            self.graph_prefill = CudaGraphPrefill(model, self.cache, max_len=cfg.prefill_chunk, pool=dec.pool,
                                                  max_tokens=min(cfg.graph_prefill_tokens, cfg.prefill_tokens))
            start = time.monotonic()
            dec.capture_all()
            self.graph_prefill.capture_all()
            log.info("CUDA graphs: %d decode (batch buckets), %d prefill (rows x tokens up to %d), captured in %.1f s",
                     len(dec.graphs), len(self.graph_prefill.graphs), self.graph_prefill.max_tokens,
                     time.monotonic() - start)
            self.decode = dec

    def reset(self, slots: list[int]) -> None:
        """Forget the sequences in ``slots`` so they take new prompts (no wait for the device's queue)."""
        self.cache.reset(ids_on_device(slots, self.device))

    def assign_blocks(self, slot: int, start: int, blocks: list[int]) -> None:
        """KV blocks ``blocks`` hold the slot's tokens from block index ``start`` on."""
        self.cache.block_table.assign(slot, start, blocks)

    def prefill(self, ids: torch.Tensor, slots: list[int], all_logits: bool) -> torch.Tensor:
        """ids: (b, n), continuing the sequences of ``slots`` (b) by n tokens each → logits (b, n, vocab) if
        all_logits, else (b, vocab) of each row's last token."""
        if all_logits:
            return self.model(ids, self.cache, slots=slots)
        graphs = self.graph_prefill
        if graphs is not None:
            # no fit check (a sync): the engine admits only what fits (Engine.unfit)
            if graphs.serves(*ids.shape):
                return graphs(ids, slots, check_fit=False)
            rows = graphs.row_pieces(*ids.shape)
            if 1 < len(rows) <= self.graph_pieces:
                # each piece's logits copied out: a later piece of the same rows replays the same graph
                out, start = [], 0
                for r in rows:
                    out.append(graphs(ids[start:start + r], slots[start:start + r], check_fit=False).clone())
                    start += r
                return torch.cat(out)
        return self.model(ids, self.cache, slots=slots, num_last_tokens=1)[:, -1]

    def decode(self, tokens: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """tokens, slots: (b,) → logits (b, vocab); CUDA graphs replace this method on GPU."""
        return self.model.step(tokens, self.cache, slots)


class Engine:
    """Owns the model, the cache and the loop thread. ``start()``, ``submit(req)``, ``abort(id)``, ``shutdown()``.

    ``on_turn``: called on the loop thread after every turn of the loop (the engine process reports its state
    with it)."""

    def __init__(self, model, config: EngineConfig, metrics=None, runner=None, on_turn: Callable | None = None):
        self.model, self.cfg, self.metrics = model, config, metrics
        self.vocab_size = model.config.vocab_size
        self.on_turn = on_turn
        self.runner = runner or LocalRunner(model, config)
        self.device = self.runner.device
        self._inbox: collections.deque = collections.deque()
        self._aborts: set[str] = set()
        self._fail_all: tuple[str, int] | None = None
        self._cv = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.waiting: collections.deque[Request] = collections.deque()
        self.prefilling: list[Request] = []
        self.decoding: list[Request] = []
        self.free_slots = list(range(config.max_batch))[::-1]
        kv = getattr(self.runner, "kv_blocks", None)
        self.blocks = BlockAllocator(*kv) if kv else None  # None: admission counts slots only
        self.steps = 0
        self.prefill_forwards = self.prefill_rows = 0  # forwards of prompt chunks, and their rows in all
        self.prefill_s = self.busy_s = 0.0  # wall time in steps, and in their prefill forwards
        self._threads = torch.get_num_threads()  # OpenMP's setting is per thread: carried into the loop's
        self._flushes: set = set()  # flush callbacks of the requests emitted to since the last flush
        # on CUDA a step's events wait for the next decode's launch (_deliver), which returns at once; elsewhere the
        # decode call returns when done, so waiting for it would deliver every token one step late
        self._defer_flush = self.device.type == "cuda"
        self._overlap = config.overlap if config.overlap is not None else self.device.type == "cuda"
        self._behind: _Sampled | None = None  # overlap: the decode step launched last turn, not read back yet
        # the last token of each slot stays on the device, where the next decode step reads it
        self._last = torch.zeros(config.max_batch, dtype=torch.long, device=self.device)
        self._slots_key: list[int] = []
        self._slots: torch.Tensor | None = None

    # ---------------------------------------------------------------- public, any thread
    def start(self) -> Engine:
        """Start the loop thread (once; later calls do nothing)."""
        if self._thread is not None:
            return self
        self._thread = threading.Thread(target=self._loop, name="ssmq-engine", daemon=True)
        self._thread.start()
        return self

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)
            if self._thread.is_alive():  # a model call that does not return: the daemon thread dies with the process
                log.warning("the engine thread did not stop within 30 s")

    def unfit(self, n_tokens: int) -> str | None:
        """Why a sequence of ``n_tokens`` (prompt + max_tokens) can never run here, or None."""
        return unfit_reason(n_tokens, self.cfg.max_model_len,
                            None if self.blocks is None else (self.blocks.total, self.blocks.block_size))

    def health(self) -> str | None:
        """Why the engine cannot serve (its loop thread ended), or None."""
        if self._thread is not None and not self._thread.is_alive() and not self._stop:
            return "the engine thread has stopped"
        return None

    def submit(self, req: Request) -> None:
        check_servable(req, self.unfit)
        with self._cv:
            if len(self._inbox) + len(self.waiting) >= self.cfg.max_waiting:
                raise SSMQError(f"the queue is full ({self.cfg.max_waiting} requests waiting)")
            self._inbox.append(req)
            self._cv.notify()

    def abort(self, request_id: str) -> None:
        """Finish the request now (client gone): its slot is free for the next step."""
        with self._cv:
            self._aborts.add(request_id)
            self._cv.notify()

    def fail_all(self, message: str, status: int = 503) -> None:
        """Finish every request, queued or running, with an error (a drain past its deadline)."""
        with self._cv:
            self._fail_all = (message, status)
            self._cv.notify()

    def stats(self) -> dict:
        out = {"waiting": len(self.waiting) + len(self._inbox), "running": len(self.prefilling) + len(self.decoding),
               "slots_used": self.cfg.max_batch - len(self.free_slots), "slots_total": self.cfg.max_batch,
               "steps": self.steps, "prefill_forwards": self.prefill_forwards, "prefill_rows": self.prefill_rows,
               "prefill_ms": round(self.prefill_s * 1e3), "busy_ms": round(self.busy_s * 1e3)}
        if self.blocks is not None:
            out.update(kv_blocks_used=self.blocks.used, kv_blocks_total=self.blocks.total)
        return out

    # ---------------------------------------------------------------- engine thread
    def _loop(self) -> None:
        torch.set_num_threads(self._threads)
        with torch.inference_mode():
            while True:
                with self._cv:
                    if (not self._inbox and not self._aborts and not self._busy() and not self._stop
                            and self._fail_all is None):
                        self._cv.wait(timeout=0.1)
                    if self._stop:
                        break
                    new, self._inbox = list(self._inbox), collections.deque()
                    aborts, self._aborts = self._aborts, set()
                    fail, self._fail_all = self._fail_all, None
                try:
                    if fail is not None:
                        self.waiting.extend(new)
                        new = []
                        self._finish_all(*fail)
                    self._tick(new, aborts)
                except Exception as e:  # a bug outside any one request: fail who is here, keep the loop alive
                    log.exception("engine turn failed")
                    self._finish_all(f"engine error: {type(e).__name__}: {e}", 500)
                    self._flush()
                if self.on_turn is not None:
                    self.on_turn()
        self._finish_all("server shutting down", 503)
        self._flush()
        if hasattr(self.runner, "stop"):
            self.runner.stop()

    def _finish_all(self, message: str, status: int) -> None:
        for r in list(self.waiting) + self.prefilling + self.decoding:
            self._finish(r, "error", message, status)
        self.waiting.clear()
        self._behind = None

    def _tick(self, new: list[Request], aborts: set[str]) -> None:
        """One turn of the loop, with the requests and aborts that arrived since the last."""
        self.waiting.extend(new)
        self._drop(aborts)
        self._expire()
        self._admit()
        if self.prefilling or self.decoding:
            start = time.perf_counter()
            try:
                self._step()
            except Exception as e:  # the batched decode call itself failed: no row to blame, fail its rows
                log.exception("engine step failed")
                for r in self.decoding:
                    self._finish(r, "error", f"engine error in the batched decode step: {type(e).__name__}: {e}",
                                 500)
                self._behind = None
            self.busy_s += time.perf_counter() - start
        if not (self.decoding and self._defer_flush):
            self._flush()

    def _busy(self) -> bool:
        return bool(self.prefilling or self.decoding or (self.waiting and self.free_slots))

    def _drop(self, ids: set[str]) -> None:
        if not ids:
            return
        for r in [r for r in self.waiting if r.id in ids]:
            self.waiting.remove(r)
            self._finish(r, "abort")
        for r in [r for r in self.prefilling + self.decoding if r.id in ids]:
            self._finish(r, "abort")

    def _expire(self) -> None:
        now = time.monotonic()
        for r in [r for r in list(self.waiting) + self.prefilling + self.decoding
                  if r.timeout is not None and now - r.arrival > r.timeout]:
            if r in self.waiting:
                self.waiting.remove(r)
            self._finish(r, "error", f"request timed out after {r.timeout:g} s", 408)

    def _admit(self) -> None:
        admitted = []
        while self.waiting and self.free_slots:  # first come, first served: the head waits for room
            r = self.waiting[0]
            if self.blocks is not None and not self.blocks.can_admit(len(r.prompt) + r.max_tokens):
                break
            self.waiting.popleft()
            r.slot = self.free_slots.pop()
            if self.metrics is not None:
                self.metrics.queue.observe(time.monotonic() - r.arrival)
            try:
                if self.blocks is not None:
                    self.blocks.admit(r.slot, len(r.prompt) + r.max_tokens)
                if r.params.seed is not None:
                    r.generator = torch.Generator(device=self.device).manual_seed(r.params.seed)
            except Exception as e:  # this request's alone
                self._fail(r, "admission", e)
                continue
            admitted.append(r)
        if not admitted:
            return
        # the slots of a turn's admissions are cleared together: one index and two writes a layer for all of them
        # (a reset a request cost a launch a layer state and, for its index, a wait for the step in flight)
        try:
            self.runner.reset([r.slot for r in admitted])
            self.prefilling.extend(admitted)
            return
        except Exception:
            log.warning("resetting %d slots together failed; resetting them one by one", len(admitted))
        for r in admitted:  # no row to blame: each alone, so that a fault fails its request only
            try:
                self.runner.reset([r.slot])
            except Exception as e:
                self._fail(r, "admission", e)
                continue
            self.prefilling.append(r)

    def _step(self) -> None:
        start = time.perf_counter()
        self.steps += 1
        rows = list(self.prefilling)
        keys = [(r.prompt_logprobs, r.id if r.alone else None) for r in rows]
        for n, group in prefill_groups([len(r.prompt) - r.pos for r in rows], self.cfg.prefill_tokens,
                                       self.cfg.prefill_chunk, keys):
            self._prefill([rows[i] for i in group], n)
        if rows:
            self.prefill_s += time.perf_counter() - start
        # (overlap) a row whose last token is still on the device and ends it by length is not decoded again
        rows = [r for r in self.decoding if len(r.output) + r.ahead < r.max_tokens]
        launched = None
        if rows:
            for r in rows:  # the token fed now sits at position len(prompt) + len(output) + ahead - 1
                self._grow(r, len(r.prompt) + len(r.output) + r.ahead)
            slots = self._slots_of(rows)
            launched = self._sample(rows, self.runner.decode(self._last[slots], slots), slots)
        if not self._overlap:
            if launched is not None:
                self._flush()
                self._read(launched)
            return
        behind, self._behind = self._behind, launched
        self._flush()
        if behind is not None:
            self._read(behind)

    def _fail(self, r: Request, stage: str, e: Exception) -> None:
        log.exception("request %s failed in %s", r.id, stage)
        self._finish(r, "error", f"engine error in {stage}: {type(e).__name__}: {e}", 500)

    def _slots_of(self, rows: list[Request]) -> torch.Tensor:
        """The rows' slots (b,) on the device, built anew (a host -> device copy) only when the batch changed."""
        key = [r.slot for r in rows]
        if key != self._slots_key:
            self._slots_key, self._slots = key, self._to_device(key)
        return self._slots

    def _to_device(self, ids: list) -> torch.Tensor:
        return ids_on_device(ids, self.device)

    def _prefill(self, rows: list[Request], n: int) -> None:
        """Prefill the next n prompt tokens of each of ``rows`` in one forward; sample the first token of those
        whose prompt is then whole."""
        ids = self._to_device([r.prompt[r.pos:r.pos + n] for r in rows])
        try:
            for r in rows:
                self._grow(r, r.pos + n)
            logits = self.runner.prefill(ids, [r.slot for r in rows], rows[0].prompt_logprobs)
            self.prefill_forwards += 1
            self.prefill_rows += len(rows)
        except Exception as e:
            if len(rows) == 1:  # a prefill of one request: fail it alone, the others go on
                self._fail(rows[0], "prefill", e)
            else:
                self._restart_alone(rows, e)
            return
        done = []
        for i, r in enumerate(rows):
            if r.prompt_logprobs:
                try:
                    self._emit_prompt_logprobs(r, ids[i], logits[i])
                except Exception as e:
                    self._fail(r, "prefill", e)
                    continue
            if self.metrics is not None:
                self.metrics.prompt_tokens.inc(n)
            r.pos += n
            if r.pos < len(r.prompt):
                continue
            self.prefilling.remove(r)
            if r.max_tokens == 0:
                self._finish(r, "length")
                continue
            done.append(i)
        if not done:
            return
        last = logits[:, -1] if rows[0].prompt_logprobs else logits
        finished = [rows[i] for i in done]
        try:
            first = self._sample(finished, last[self._to_device(done)] if len(done) < len(rows) else last,
                                 self._to_device([r.slot for r in finished]))
        except Exception as e:  # past sample_rows' own per-row isolation: these rows' first tokens are lost
            for r in finished:
                self._fail(r, "sampling", e)
            return
        self.decoding.extend(finished)
        self._flush()
        self._read(first)

    def _restart_alone(self, rows: list[Request], e: Exception) -> None:
        """A forward of several rows raised: no row to blame. Each restarts its prompt from an empty state, prefilled
        alone from now on (a fault of one request then fails it alone); a row whose prompt logprobs were already
        reported cannot take them back and fails."""
        log.warning("a batched prefill of %d requests failed (%s: %s); prefilling them one by one", len(rows),
                    type(e).__name__, e)
        for r in rows:
            if r.carry is not None:
                self._fail(r, "prefill", e)
                continue
            try:
                self.runner.reset([r.slot])  # states, and (paged KV) the slot's block table: its blocks are taken anew
                if self.blocks is not None:
                    self.blocks.release(r.slot)
                    self.blocks.admit(r.slot, len(r.prompt) + r.max_tokens)
            except Exception as e2:
                self._fail(r, "prefill", e2)
                continue
            r.pos, r.alone = 0, True

    def _grow(self, r: Request, length: int) -> None:
        """KV blocks for the first ``length`` tokens of r's sequence (hybrids), taken as it grows."""
        if self.blocks is not None:
            start, new = self.blocks.grow(r.slot, length)
            if new:
                self.runner.assign_blocks(r.slot, start, new)

    def _emit_prompt_logprobs(self, r: Request, ids: torch.Tensor, logits: torch.Tensor) -> None:
        """Logprob (and top-k) of each prompt token in this chunk given the tokens before it; the first prompt
        token has none. ids: (n,), logits: (n, vocab)."""
        logp = torch.log_softmax(logits.float(), dim=-1)
        if r.carry is None:  # first chunk: the first prompt token has no logprob
            prev, targets = logp[:-1], ids[1:]
        else:
            prev, targets = torch.cat([r.carry[None], logp[:-1]]), ids
        r.carry = logp[-1]
        if targets.numel() == 0:
            return
        chosen = prev.gather(1, targets[:, None]).squeeze(1).tolist()
        if not all(math.isfinite(c) for c in chosen):
            raise FloatingPointError("numerical error: the model's logits for this prompt are not finite (NaN or inf)")
        top = prev.topk(r.top_k(), dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(top.indices.tolist(), top.values.tolist())]
        self._emit(r, Event("prompt", prompt=list(zip(chosen, tops))))

    def _sample(self, rows: list[Request], logits: torch.Tensor, slots) -> _Sampled:
        """One token per row from logits (b, vocab), left on the device (no sync). ``slots``: the rows' slots, a (b,)
        device tensor or one int, where the tokens are kept for the next decode step to read."""
        for r in rows:
            if r.params.penalized and r.counts is None:
                r.counts = torch.zeros(logits.shape[-1], device=logits.device)
        toks, failed = sample_rows(logits, [r.params for r in rows], [r.generator for r in rows],
                                   [r.counts for r in rows])
        for i, why in failed.items():
            rows[i].failure = why
        fed = toks.clamp(min=0)  # a failed row's -1 is reported, never fed to the model
        self._last[slots] = fed if isinstance(slots, torch.Tensor) else fed[0]
        for i, r in enumerate(rows):
            if r.counts is not None:
                count_tokens(r.counts[None], toks[i:i + 1])
        out = _Sampled(rows, toks, [i for i, r in enumerate(rows) if r.logprobs is not None])
        if out.want:
            idx = self._to_device(out.want)
            out.lp = top_logprobs(logits[idx], toks[idx], max(rows[i].top_k() for i in out.want))
        for r in rows:
            r.ahead += 1
        out.send_to_host()
        return out

    def _read(self, s: _Sampled) -> None:
        """Read a step's tokens back, report them, finish rows that stop. Call ``_flush()`` first: the previous
        step's events go to the server while the device runs this step, so its event loop thread takes the GIL
        while the engine waits on the device here, not while the engine launches the step. Under overlap the
        wait ends with the step read (``_Sampled.on_host``), while the step launched after it still runs."""
        rows, want = s.rows, s.want
        toks, lps = s.on_host()  # the step's one wait for the device
        lp = {}
        if want:
            chosen, values, indices = lps
            for j, i in enumerate(want):
                kk = rows[i].top_k()
                lp[i] = (chosen[j], list(zip(indices[j][:kk], values[j][:kk])))
        now = time.monotonic()
        for i, (r, tok) in enumerate(zip(rows, toks)):
            r.ahead -= 1
            if r.slot < 0:  # (overlap) finished while this step ran: its token is not wanted
                continue
            if tok < 0:  # this row alone failed: its sampler raised, or the model's logits are not finite
                self._finish(r, "error", r.failure or "numerical error: the model's logits for this sequence are "
                                                      "not finite (NaN or inf)", 500)
                continue
            if self.metrics is not None:
                self.metrics.generated_tokens.inc()
                if r.output:
                    self.metrics.tpot.observe(now - r.last_time)
                else:
                    self.metrics.ttft.observe(now - r.arrival)
            r.last_time = now
            r.output.append(tok)
            logprob, top = lp.get(i, (None, None))
            self._emit(r, Event("token", token=tok, logprob=logprob, top=top))
            if r.params.stop_at_eos and tok == r.params.eos_id:
                self._finish(r, "stop")
            elif len(r.output) >= r.max_tokens:
                self._finish(r, "length")
        if not self._defer_flush:
            self._flush()

    def _finish(self, r: Request, reason: str, message: str | None = None, status: int = 500) -> None:
        for queue in (self.prefilling, self.decoding):
            if r in queue:
                queue.remove(r)
        if r.slot >= 0:
            if self.blocks is not None:
                self.blocks.release(r.slot)
            self.free_slots.append(r.slot)
            r.slot = -1
        if self.metrics is not None:
            self.metrics.requests.labels(outcome=reason).inc()
        self._emit(r, Event("error", message=message, status=status) if reason == "error"
                   else Event("done", reason=reason))

    def _emit(self, r: Request, event: Event) -> None:
        try:
            r.emit(event)
        except Exception:  # the client side is gone (e.g. its event loop closed): nothing left to tell
            log.debug("could not report to request %s", r.id)
        if r.flush is not None:
            self._flushes.add(r.flush)

    def _flush(self) -> None:
        for flush in self._flushes:
            try:
                flush()
            except Exception:  # as in _emit: the event loop is gone
                log.debug("could not hand events over", exc_info=True)
        self._flushes.clear()

