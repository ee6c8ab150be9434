"""Batched and chunked prefill of the serving engine, and its thread: exact against offline ``generate``.

The engine is driven directly (``submit`` with an ``emit`` that collects events) or through the HTTP server; every
expected token comes from the offline eager ``generate`` of the same model, which prefills each prompt whole.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
import torch

from char_tokenizer import CharTokenizer
from tiny_ssm import tiny_model

pytest.importorskip("fastapi", reason="ssmq serve needs fastapi (pip install -e '.[dev]')")

from ssmq.runtime.engine import Engine, EngineConfig, Request, prefill_groups  # noqa: E402
from ssmq.runtime.generate import generate  # noqa: E402
from ssmq.runtime.sampling import SamplingParams  # noqa: E402
from ssmq.runtime.server import BackgroundServer, ServerConfig  # noqa: E402

TOK = CharTokenizer()
NAME = "tiny"


def params(max_tokens: int, eos: int = TOK.eos_id, vocab: int = len(TOK)) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_tokens, eos_id=eos, vocab_limit=vocab)


def offline(model, prompt: list[int], max_tokens: int, eos: int = TOK.eos_id, vocab: int = len(TOK)) -> list[int]:
    return generate(model, [prompt], params(max_tokens, eos, vocab))[0]


class Calls:
    """Wraps an engine's runner: records each model call as ("prefill", slots, n) or ("decode", slots)."""

    def __init__(self, engine: Engine, before_prefill=None):
        self.log: list[tuple] = []
        self.lock = threading.Lock()
        prefill, decode = engine.runner.prefill, engine.runner.decode

        def recorded_prefill(ids, slots, all_logits):
            with self.lock:
                self.log.append(("prefill", list(slots), ids.shape[1]))
            if before_prefill is not None:
                before_prefill(ids, slots)
            return prefill(ids, slots, all_logits)

        def recorded_decode(tokens, slots):
            with self.lock:
                self.log.append(("decode", slots.tolist()))
            return decode(tokens, slots)

        engine.runner.prefill, engine.runner.decode = recorded_prefill, recorded_decode


def run_engine(engine: Engine, prompts: list[list[int]], max_tokens: list[int], eos: int = TOK.eos_id,
               vocab: int = len(TOK), timeout: float = 120) -> list[list[int] | str]:
    """Submit every prompt at once; each request's tokens (EOS included when it stopped), or its error message."""
    out: list = [[] for _ in prompts]
    done = [threading.Event() for _ in prompts]

    def emitter(i):
        def emit(ev):
            if ev.kind == "token":
                out[i].append(ev.token)
            elif ev.kind == "error":
                out[i] = ev.message
                done[i].set()
            elif ev.kind == "done":
                done[i].set()
        return emit

    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        engine.submit(Request(p, params(m, eos, vocab), m, emitter(i)))
    for d in done:
        assert d.wait(timeout), "a request did not finish"
    return out


def test_prefill_groups_share_forwards_by_chunk_length():
    # budget 20, chunk 8: 8 + 8 (two long prompts' chunks, one forward), 3 + 1 after them
    assert prefill_groups([30, 12, 3, 1, 9], 20, 8) == [(8, [0, 1]), (3, [2]), (1, [3])]
    assert prefill_groups([5, 5, 5], 100, 8) == [(5, [0, 1, 2])]
    assert prefill_groups([5, 5, 5], 100, 8, keys=[0, 1, 0]) == [(5, [0, 2]), (5, [1])]
    assert prefill_groups([50], 7, 8) == [(7, [0])]  # the budget is the smaller bound
    assert prefill_groups([4, 4], 4, 8) == [(4, [0])]  # the step's budget is spent: the next waits
    assert prefill_groups([], 10, 8) == []


def test_graph_row_pieces_split_a_chunk_into_graph_served_forwards():
    from ssmq.runtime.cuda_graph import graph_row_pieces

    # graphs of up to 512 tokens: 128-token chunks take 4 rows a forward, the rest last
    assert graph_row_pieces(6, 128, 512, 512, 64) == [4, 2]
    assert graph_row_pieces(18, 128, 512, 512, 64) == [4, 4, 4, 4, 2]
    assert graph_row_pieces(3, 100, 512, 512, 64) == [3]  # the longest piece (64) sets the rows: 8 fit
    assert graph_row_pieces(8, 100, 512, 512, 2) == [2, 2, 2, 2]  # at most max_rows
    assert graph_row_pieces(5, 600, 512, 4096, 64) == []  # longer than a graph's piece
    assert graph_row_pieces(5, 512, 512, 256, 64) == []  # one row alone exceeds max_tokens


def test_a_turns_admissions_reset_their_slots_together_and_a_reset_fault_fails_one_request():
    """Requests admitted in one turn have their slots cleared by one runner call; when that call raises, each slot
    is reset alone, the request whose reset fails gets an error naming it and the others their offline tokens."""
    model = tiny_model("mamba2", seed=3)
    engine = Engine(model, EngineConfig(max_batch=4, max_model_len=64, prefill_chunk=32, prefill_tokens=64))
    reset, resets = engine.runner.reset, []
    bad = {"slot": None, "faults": 0}

    def recorded(slots):
        resets.append(list(slots))
        # the bad slot's resets fail twice: the turn's call and the one-slot retry (then the slot is usable again,
        # whether the next request takes it in the same turn or, freed, in a later one)
        if bad["slot"] in slots and bad["faults"] > 0:
            bad["faults"] -= 1
            raise RuntimeError("injected reset fault")
        return reset(slots)

    engine.runner.reset = recorded
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, len(TOK), (n,), generator=g).tolist() for n in (5, 9, 3)]
    threading.Timer(0.3, engine.start).start()  # every request is in the inbox before the loop's first turn
    out = run_engine(engine, prompts, [6, 6, 6])
    assert out == [offline(model, p, 6) for p in prompts]
    assert len(resets) == 1 and sorted(resets[0]) == sorted(set(resets[0])) and len(resets[0]) == 3
    resets.clear()
    bad.update(slot=engine.free_slots[-1], faults=2)  # the slot the next admission takes
    out = run_engine(engine, prompts[:2], [6, 6])
    engine.shutdown()
    assert isinstance(out[0], str) and "injected reset fault" in out[0] and "admission" in out[0]
    assert out[1] == offline(model, prompts[1], 6)
    assert engine.stats()["slots_used"] == 0


def test_stats_split_the_engine_threads_time_into_steps_and_their_prefills():
    """/health's time tallies: a prefill forward made to take 0.2 s and decode steps 0.02 s each show up as at least
    that much prefill time, and busy time that holds the prefill and the decode steps too."""
    model = tiny_model("mamba2", seed=3)
    engine = Engine(model, EngineConfig(max_batch=2, max_model_len=64, prefill_chunk=32, prefill_tokens=32))
    Calls(engine, before_prefill=lambda ids, slots: time.sleep(0.2))
    decode, decodes = engine.runner.decode, []

    def slow(tokens, slots):
        decodes.append(1)
        time.sleep(0.02)
        return decode(tokens, slots)

    engine.runner.decode = slow
    engine.start()
    try:
        run_engine(engine, [[5, 6, 7]], [6])
    finally:
        engine.shutdown()
    stats = engine.stats()  # after the thread ends: a request's last token is delivered before its step is tallied
    assert stats["prefill_forwards"] == 1 and decodes
    assert 200 <= stats["prefill_ms"] < 2000
    assert stats["busy_ms"] >= stats["prefill_ms"] + len(decodes) * 20 - 1  # (each tally rounded to a ms)


@pytest.mark.parametrize("arch", ["mamba2", "hybrid"])
def test_batched_and_chunked_prefill_equal_offline(arch):
    """Eight prompts at once, equal and different lengths, some longer than the chunk (8 tokens): several rows share
    prefill forwards, long prompts go in chunks interleaved with decode steps, and every request's greedy tokens
    equal the offline generate's, which prefills each prompt whole."""
    model = tiny_model(arch, seed=5)
    kv = {"kv_blocks": 80, "kv_block_size": 4} if arch == "hybrid" else {}
    engine = Engine(model, EngineConfig(max_batch=8, max_model_len=96, prefill_chunk=8, prefill_tokens=64, **kv))
    calls = Calls(engine)
    engine.start()
    g = torch.Generator().manual_seed(11)
    lengths = [5, 5, 5, 13, 13, 30, 41, 2]
    prompts = [torch.randint(1, len(TOK), (n,), generator=g).tolist() for n in lengths]
    max_tokens = [12, 7, 15, 10, 12, 9, 14, 11]
    try:
        got = run_engine(engine, prompts, max_tokens)
    finally:
        engine.shutdown()
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        assert got[i] == offline(model, p, m), f"request {i} ({len(p)} prompt tokens)"
    prefills = [c for c in calls.log if c[0] == "prefill"]
    assert max(len(c[1]) for c in prefills) >= 3, "equal chunks were not batched"
    assert max(c[2] for c in prefills) <= 8, "a chunk exceeded --prefill-chunk"
    # the 41-token prompt took 6 chunks; decode steps of the other requests ran between its first and last
    chunks = [k for k, c in enumerate(calls.log) if c[0] == "prefill" and c[2] == 1]
    assert chunks, "the 41-token prompt's last 1-token chunk is missing"
    assert any(c[0] == "decode" for c in calls.log[:chunks[-1]])
    assert engine.stats()["slots_used"] == 0


def test_a_long_prompt_does_not_stall_a_running_stream():
    """A running request keeps getting a token every step while a prompt of 20 chunks is prefilled: decode steps
    are interleaved with its chunks (one chunk per step), and both equal offline."""
    model = tiny_model("mamba2", seed=3)
    engine = Engine(model, EngineConfig(max_batch=4, max_model_len=256, prefill_chunk=8, prefill_tokens=8))
    calls = Calls(engine)
    engine.start()
    g = torch.Generator().manual_seed(2)
    short, long = (torch.randint(1, len(TOK), (n,), generator=g).tolist() for n in (6, 160))
    first_token = threading.Event()
    out = {"short": [], "long": []}
    done = {k: threading.Event() for k in out}

    def emitter(key):
        def emit(ev):
            if ev.kind == "token":
                out[key].append(ev.token)
                first_token.set()
            elif ev.kind in ("done", "error"):
                assert ev.kind == "done", ev.message
                done[key].set()
        return emit

    nope = SamplingParams(max_new_tokens=60, eos_id=TOK.eos_id, vocab_limit=len(TOK), stop_at_eos=False)
    try:
        engine.submit(Request(short, nope, 60, emitter("short")))
        assert first_token.wait(30)
        engine.submit(Request(long, params(8), 8, emitter("long")))
        assert done["short"].wait(60) and done["long"].wait(60)
    finally:
        engine.shutdown()
    assert out["short"] == generate(model, [short], nope)[0]
    assert out["long"] == offline(model, long, 8)
    long_chunks = [k for k, c in enumerate(calls.log) if c[0] == "prefill" and c[2] == 8]
    assert len(long_chunks) == 20
    for a, b in zip(long_chunks, long_chunks[1:]):
        assert any(c[0] == "decode" for c in calls.log[a:b]), "no decode step between two chunks"


def _server(engine):
    return BackgroundServer(engine, TOK, ServerConfig((NAME,)))


def test_health_and_metrics_answer_while_a_prefill_runs():
    """The engine thread is held inside a prefill forward: /health and /metrics answer at once (the HTTP side never
    waits on the engine), then the request completes with its offline text."""
    model = tiny_model("mamba2", seed=3)
    inside, release = threading.Event(), threading.Event()

    def hold(ids, slots):
        inside.set()
        assert release.wait(30)

    engine = Engine(model, EngineConfig(max_batch=4, max_model_len=96, prefill_chunk=16))
    Calls(engine, before_prefill=hold)
    prompt = torch.randint(1, len(TOK), (40,), generator=torch.Generator().manual_seed(4)).tolist()
    with _server(engine) as url:
        reply = {}
        t = threading.Thread(target=lambda: reply.update(r=httpx.post(
            f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0}, timeout=60)))
        t.start()
        assert inside.wait(30)
        health = httpx.get(f"{url}/health", timeout=5)
        metrics = httpx.get(f"{url}/metrics", timeout=5)
        models = httpx.get(f"{url}/v1/models", timeout=5)
        release.set()
        t.join(60)
    assert health.status_code == 200 and health.json()["running"] == 1
    assert metrics.status_code == 200 and "ssmq_running_sequences 1" in metrics.text
    assert models.status_code == 200
    out = offline(model, prompt, 6)
    assert reply["r"].json()["choices"][0]["text"] == TOK.decode(out[:-1] if out[-1] == TOK.eos_id else out)


def test_a_fault_in_one_request_s_prefill_fails_it_alone():
    """A request whose prefill raises (a fault in its row, seen only inside a forward it shares with others): the
    batched forward fails, each of its rows restarts alone from an empty state, the faulty request gets a 500 naming
    the cause, and every other request, sharing its forwards or not, gets exactly its offline text."""
    model = tiny_model("hybrid", seed=5)
    engine = Engine(model, EngineConfig(max_batch=8, max_model_len=96, prefill_chunk=8, prefill_tokens=64,
                                        kv_blocks=120, kv_block_size=4))
    poison = [7] * 12

    def fault(ids, slots):
        rows = [r for r in engine.prefilling if r.slot in slots]
        if any(r.prompt == poison for r in rows):
            raise RuntimeError("injected prefill fault")

    calls = Calls(engine, before_prefill=fault)
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(1, len(TOK), (n,), generator=g).tolist() for n in (12, 12, 20, 4, 12)]
    with _server(engine) as url:
        async def main():
            async with httpx.AsyncClient(base_url=url, timeout=60) as c:
                bodies = [{"prompt": p, "max_tokens": 10, "temperature": 0} for p in prompts]
                bodies.insert(2, {"prompt": poison, "max_tokens": 10, "temperature": 0})
                return await asyncio.gather(*[c.post("/v1/completions", json=b) for b in bodies])

        replies = asyncio.run(main())
        health = httpx.get(f"{url}/health").json()
    bad = replies.pop(2)
    assert bad.status_code == 500 and "injected prefill fault" in bad.json()["error"]["message"]
    for i, (p, r) in enumerate(zip(prompts, replies)):
        out = offline(model, p, 10)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == TOK.decode(
            out[:-1] if out[-1] == TOK.eos_id else out), f"request {i}"
    assert any(len(c[1]) > 1 for c in calls.log if c[0] == "prefill"), "no batched forward was tried"
    assert health["slots_used"] == 0 and health.get("kv_blocks_used", 0) == 0


def test_shutdown_joins_the_engine_thread_and_fails_what_is_left():
    model = tiny_model("mamba2", seed=3)
    engine = Engine(model, EngineConfig(max_batch=2, max_model_len=96, prefill_chunk=8)).start()
    inside, release = threading.Event(), threading.Event()
    Calls(engine, before_prefill=lambda ids, slots: (inside.set(), release.wait(30)))
    events = []
    engine.submit(Request([1, 2, 3], params(4), 4, events.append))
    assert inside.wait(30)
    stopper = threading.Thread(target=engine.shutdown)
    stopper.start()
    release.set()
    stopper.join(30)
    assert not engine._thread.is_alive()
    assert events[-1].kind == "error" and events[-1].status == 503


def _shared_model(name):
    from conftest import shared_or_skip

    folder = shared_or_skip("models", name)
    from ssmq.quant import load_model
    from ssmq.tokenizer import load_tokenizer

    return load_model(folder, dtype=torch.float32, device="cpu").eval(), load_tokenizer(folder)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mamba2", "hybrid"])
def test_trained_models_batched_and_chunked_prefill_equal_offline(name):
    """The trained reference models: prompts of WikiText-like text of 3..70 tokens, six at once, chunks of 16."""
    model, tok = _shared_model(name)
    texts = ["The history of the city", "In 1998, the band released", "The history of the river",
             "It was the first time that the team had won the championship since the war, and the crowd of "
             "supporters in the stadium", "A", "The song was"]
    prompts = [tok.encode(t) for t in texts]
    kv = {"kv_blocks": 200, "kv_block_size": 16} if name == "hybrid" else {}
    engine = Engine(model, EngineConfig(max_batch=6, max_model_len=160, prefill_chunk=16, prefill_tokens=128, **kv))
    engine.start()
    try:
        got = run_engine(engine, prompts, [24] * len(prompts), eos=tok.eos_id, vocab=len(tok))
    finally:
        engine.shutdown()
    for i, p in enumerate(prompts):
        assert got[i] == offline(model, p, 24, tok.eos_id, len(tok)), texts[i]


@pytest.mark.gpu
def test_overlap_reads_a_step_back_while_the_step_launched_after_it_runs():
    """Under overlap the engine launches decode step n, then reads step n - 1's tokens back: that read waits for
    step n - 1 alone (an event after its copy to pinned memory), so it returns while the device still runs step n
    (here each decode step keeps the device busy ~50 ms after its logits) and the host's turn overlaps the device's;
    the tokens are the runner's, in order."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (the overlap reads back from the device)")
    from types import SimpleNamespace

    vocab = 32

    class SlowRunner:  # next token = the last one + 1; every decode step ends with ~50 ms of device time
        device, kv_blocks = torch.device("cuda"), None

        def reset(self, slots):
            pass

        def prefill(self, ids, slots, all_logits):
            return torch.nn.functional.one_hot((ids[:, -1] + 1) % vocab, vocab).float()

        def decode(self, tokens, slots):
            logits = torch.nn.functional.one_hot((tokens + 1) % vocab, vocab).float()
            torch.cuda._sleep(100_000_000)
            return logits

    engine = Engine(SimpleNamespace(config=SimpleNamespace(vocab_size=vocab)),
                    EngineConfig(max_batch=2, max_model_len=32), runner=SlowRunner())
    busy, read = [], engine._read

    def spy(s):  # was the device still busy when a read returned?
        read(s)
        busy.append(not torch.cuda.current_stream(engine.device).query())

    engine._read = spy
    out, done = [], threading.Event()

    def emit(ev):
        if ev.kind == "token":
            out.append(ev.token)
        elif ev.kind in ("done", "error"):
            done.set()

    engine.start()
    try:
        engine.submit(Request([3], SamplingParams(stop_at_eos=False), 5, emit))
        assert done.wait(30)
    finally:
        engine.shutdown()
    assert out == [4, 5, 6, 7, 8]
    # the prefill's first token and the last step are read with nothing launched after them; the 3 reads between
    # returned while the next step ran
    assert busy == [False, True, True, True, False]
