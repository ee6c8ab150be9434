"""ssmq serve through real HTTP on 127.0.0.1: httpx and the openai client against uvicorn in a thread.

Tiny random models (tests/tiny_ssm.py) and a 64-symbol character tokenizer; every expected output comes from the
offline ``generate`` or the ``ssmq eval`` scorer on the same model.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import socket
import time

import httpx
import pytest
import torch

from char_tokenizer import CharTokenizer
from tiny_ssm import tiny_model

pytest.importorskip("fastapi", reason="ssmq serve needs fastapi (pip install -e '.[dev]')")

from ssmq.runtime.engine import Engine, EngineConfig  # noqa: E402
from ssmq.runtime.generate import generate
from ssmq.runtime.sampling import SamplingParams
from ssmq.runtime.server import BackgroundServer, ServerConfig

TOK = CharTokenizer()
NAME = "tiny"


def start(model, max_batch=8, max_model_len=96, prefill_tokens=64, kv_blocks=None, overlap=None, prefill_chunk=8,
          **server):
    """A server over a fresh engine; by default prompts go in chunks of 8, several in one forward (64 a step)."""
    engine = Engine(model, EngineConfig(max_batch=max_batch, max_model_len=max_model_len,
                                        prefill_tokens=prefill_tokens, prefill_chunk=prefill_chunk, kv_block_size=4,
                                        kv_blocks=kv_blocks, overlap=overlap))
    return BackgroundServer(engine, TOK, ServerConfig((NAME,), **server))


@pytest.fixture(scope="module")
def mamba2():
    return tiny_model("mamba2", seed=3)


@pytest.fixture(scope="module")
def server(mamba2):
    with start(mamba2, max_body_bytes=20_000, body_timeout_s=1.0) as url:
        yield url


def offline_text(model, prompt_ids: list[int], max_tokens: int, **kwargs) -> str:
    """What the server should answer for a greedy request: offline generate (``kwargs`` to it), the final EOS
    hidden."""
    out = generate(model, [prompt_ids], SamplingParams(max_new_tokens=max_tokens, eos_id=TOK.eos_id,
                                                       vocab_limit=len(TOK)), **kwargs)[0]
    return TOK.decode(out[:-1] if out[-1] == TOK.eos_id else out)


def random_prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, len(TOK), (int(k),), generator=g).tolist() for k in torch.randint(1, 60, (n,), generator=g)]


async def _httpx_call(url, body):
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        if not body.get("stream"):
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]
        text, done = "", False
        async with c.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    text += json.loads(line[6:])["choices"][0]["text"]
        assert done, "the stream did not end with data: [DONE]"
        return text


async def _openai_call(client, body):
    body = dict(body)
    if not body.pop("stream", False):
        return (await client.completions.create(**body)).choices[0].text
    text = ""
    async for chunk in await client.completions.create(stream=True, **body):
        text += chunk.choices[0].text
    return text


def run_concurrently(url, bodies, via_openai):
    """Send every body at once (httpx or the openai client per ``via_openai``); texts in order."""
    import openai

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        calls = [_openai_call(client, b) if o else _httpx_call(url, b) for b, o in zip(bodies, via_openai)]
        try:
            return await asyncio.gather(*calls)
        finally:
            await client.close()

    return asyncio.run(main())


def test_32_concurrent_greedy_requests_equal_offline_generate(server, mamba2):
    prompts = random_prompts(32)
    max_tokens = [4 + (7 * i) % 17 for i in range(32)]
    bodies = []
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        # token-id and string prompts, streaming and not, through both clients
        prompt = p if i % 3 else TOK.decode(p)
        bodies.append({"model": NAME, "prompt": prompt, "max_tokens": m, "temperature": 0, "stream": i % 2 == 0})
    texts = run_concurrently(server, bodies, [i % 4 < 2 for i in range(32)])
    for i, (p, m, text) in enumerate(zip(prompts, max_tokens, texts)):
        assert text == offline_text(mamba2, p, m), f"request {i}"


@pytest.mark.parametrize("arch", ["hybrid", "llama"])
def test_attention_models_through_the_block_kv_cache_equal_offline(arch):
    """20 blocks of 4 tokens: requests of up to 20 blocks wait for blocks as well as for slots (max batch 4)."""
    model = tiny_model(arch, seed=5)
    prompts = random_prompts(10, seed=1)
    with start(model, max_batch=4, max_model_len=96, prefill_tokens=24, kv_blocks=20) as url:
        bodies = [{"prompt": p, "max_tokens": 12 + i, "temperature": 0, "stream": i % 2 == 1}
                  for i, p in enumerate(prompts)]
        texts = run_concurrently(url, bodies, [False] * len(bodies))
        stats = httpx.get(f"{url}/health").json()
        assert _metric(url, "ssmq_kv_blocks_total") == 20
        too_big = httpx.post(f"{url}/v1/completions", json={"prompt": [1] * 90, "max_tokens": 6}, timeout=30)
        assert too_big.status_code == 400 and "KV blocks" in too_big.json()["error"]["message"]
    for i, (p, text) in enumerate(zip(prompts, texts)):
        assert text == offline_text(model, p, 12 + i), f"request {i}"
    assert stats["slots_used"] == 0 and stats["kv_blocks_used"] == 0 and stats["kv_blocks_total"] == 20


@pytest.mark.parametrize("arch", ["hybrid", "llama"])
def test_quantized_kv_models_through_a_paged_cache_equal_offline(arch):
    """A KVQuant model (kvquant-nuq4-1%): its quantized KV cache in blocks (pools of codes, scales, outlier slots),
    admission by free blocks (max batch 3, 30 blocks of 4 tokens, 8 requests), with chunked prefill and overlap: the
    greedy text of offline generate, streaming or not; blocks reported and all freed; a cancelled request frees its
    slot; a prompt longer than max_model_len gets a 400."""
    from ssmq.quant import quantize
    from tiny_ssm import synthetic_calibration

    model = quantize(tiny_model(arch, seed=5), "kvquant-nuq4-1%", synthetic_calibration(64, 4, 32), progress=False)
    prompts = random_prompts(8, seed=6)
    server = start(model, max_batch=3, max_model_len=96, prefill_tokens=24, kv_blocks=30, overlap=arch == "hybrid")
    with server as url:
        bodies = [{"model": NAME, "prompt": p, "max_tokens": 6 + 2 * i, "temperature": 0, "stream": i % 2 == 0}
                  for i, p in enumerate(prompts)]
        texts = run_concurrently(url, bodies, [i % 4 == 1 for i in range(len(bodies))])
        stats = httpx.get(f"{url}/health").json()
        assert _metric(url, "ssmq_kv_blocks_total") == 30
        too_long = httpx.post(f"{url}/v1/completions", json={"prompt": [1] * 97, "max_tokens": 1}, timeout=30)
        assert too_long.status_code == 400 and "maximum context length" in too_long.json()["error"]["message"]
        _cancel_one_and_wait_for_its_slot(url)
    for i, (p, text) in enumerate(zip(prompts, texts)):
        assert text == offline_text(model, p, 6 + 2 * i), f"request {i}"
    assert stats["slots_used"] == 0 and stats["kv_blocks_used"] == 0 and stats["kv_blocks_total"] == 30


@pytest.mark.parametrize("arch", ["mamba2", "hybrid"])
def test_overlapped_steps_equal_offline(arch):
    """EngineConfig(overlap=True) (the default on CUDA) on CPU: each decode step launched before the previous one's
    tokens are read, rows that stop decode one token more (dropped), slots and KV blocks go to the next request while
    that stale step is queued: the same greedy text as offline, and seeded sampling as without overlap."""
    model = tiny_model(arch, seed=6)
    prompts = random_prompts(12, seed=4)
    bodies = [{"prompt": p, "max_tokens": 6 + i, "temperature": 0, "stream": i % 2 == 0} for i, p in enumerate(prompts)]
    sampled = {"prompt": prompts[0], "max_tokens": 12, "temperature": 0.9, "seed": 7, "ignore_eos": True}
    texts = {}
    for overlap in (True, False):
        with start(model, max_batch=3, max_model_len=96, prefill_tokens=24, kv_blocks=30 if arch == "hybrid" else None,
                   overlap=overlap) as url:
            texts[overlap] = run_concurrently(url, bodies + [sampled], [False] * (len(bodies) + 1))
            stats = httpx.get(f"{url}/health").json()
        assert stats["slots_used"] == 0 and stats.get("kv_blocks_used", 0) == 0
    for i, (p, text) in enumerate(zip(prompts, texts[True])):
        assert text == offline_text(model, p, 6 + i), f"request {i}"
    assert texts[True][-1] == texts[False][-1]


def test_overlapped_engine_reports_each_token_once_then_done(mamba2):
    """Without HTTP: with overlap each request still gets exactly its offline tokens, then one "done" (the token a
    stopped row computed one step too many is never reported)."""
    import threading

    from ssmq.runtime.engine import Request

    prompts = random_prompts(10, seed=5)
    engine = Engine(mamba2, EngineConfig(max_batch=3, max_model_len=96, prefill_tokens=8, overlap=True)).start()
    events = [[] for _ in prompts]
    done = threading.Semaphore(0)

    def emitter(i):
        def emit(ev):
            events[i].append(ev)
            if ev.kind != "token":
                done.release()
        return emit

    # EOS: a token the model does make, so rows stop on it while their next step is already queued
    probe = SamplingParams(max_new_tokens=3, stop_at_eos=False, vocab_limit=len(TOK))
    eos = generate(mamba2, [prompts[0]], probe)[0][-1]
    params = SamplingParams(eos_id=eos, vocab_limit=len(TOK))
    try:
        for i, p in enumerate(prompts):
            engine.submit(Request(p, params, 5 + i, emitter(i)))
        for _ in prompts:
            assert done.acquire(timeout=60)
    finally:
        engine.shutdown()
    for i, (p, evs) in enumerate(zip(prompts, events)):
        want = generate(mamba2, [p], SamplingParams(max_new_tokens=5 + i, eos_id=eos, vocab_limit=len(TOK)))[0]
        assert [e.kind for e in evs] == ["token"] * len(want) + ["done"], f"request {i}"
        assert [e.token for e in evs[:-1]] == want, f"request {i}"
    assert sum(e.reason == "stop" for evs in events for e in evs) >= 2  # the case above did happen


def test_state_checkpoint_engine_equals_offline(mamba2):
    """EngineConfig(state_checkpoint=4): the states written once every 4 steps and replayed between (ReplaySSM),
    with slots joining and leaving mid-ring and chunked prefills: the greedy text of the plain offline generate."""
    prompts = random_prompts(10, seed=2)
    engine = Engine(mamba2, EngineConfig(max_batch=4, max_model_len=96, prefill_tokens=8, state_checkpoint=4))
    assert all(st.checkpoint_every == 4 for st in engine.runner.cache.states)
    with BackgroundServer(engine, TOK, ServerConfig((NAME,))) as url:
        bodies = [{"prompt": p, "max_tokens": 5 + 3 * i, "temperature": 0} for i, p in enumerate(prompts)]
        texts = run_concurrently(url, bodies, [False] * len(bodies))
    for i, (p, text) in enumerate(zip(prompts, texts)):
        assert text == offline_text(mamba2, p, 5 + 3 * i), f"request {i}"


def test_int8_state_engine_equals_offline():
    """A model quantized with ``int8-state`` (the SSM state cache in int8, row scales) serves on its int8 state: the
    engine's slots hold int8 codes and row scales, and the greedy text equals offline generate's (which decodes on the
    same format); prompts prefilled whole, so both quantize the state at the same points."""
    from ssmq.quant import quantize

    model = quantize(tiny_model("mamba2", seed=5), "int8-state", None, progress=False)
    prompts = random_prompts(8, seed=6)
    engine = Engine(model, EngineConfig(max_batch=3, max_model_len=96, prefill_tokens=64))
    assert all(st.ssm.dtype == torch.int8 and st.row_scale is not None for st in engine.runner.cache.states)
    with BackgroundServer(engine, TOK, ServerConfig((NAME,))) as url:
        bodies = [{"prompt": p, "max_tokens": 4 + 2 * i, "temperature": 0} for i, p in enumerate(prompts)]
        texts = run_concurrently(url, bodies, [False] * len(bodies))
    for i, (p, text) in enumerate(zip(prompts, texts)):
        assert text == offline_text(model, p, 4 + 2 * i), f"request {i}"


def test_seeded_sampling_does_not_depend_on_the_batch(server, mamba2):
    prompt = random_prompts(1, seed=7)[0]
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0.9, "top_k": 20, "top_p": 0.95, "seed": 1234,
            "ignore_eos": True}
    alone = run_concurrently(server, [body], [False])[0]
    crowd = [dict(body, seed=s) for s in range(6)] + [body]
    amid = run_concurrently(server, crowd, [False] * len(crowd))[-1]
    params = SamplingParams(max_new_tokens=12, temperature=0.9, top_k=20, top_p=0.95, seed=1234, stop_at_eos=False,
                            eos_id=TOK.eos_id, vocab_limit=len(TOK))
    assert alone == amid == TOK.decode(generate(mamba2, [prompt], params)[0])


def test_n_choices_multiple_prompts_stop_strings_and_usage(server, mamba2):
    prompts = random_prompts(2, seed=11)
    full = [offline_text(mamba2, p, 20) for p in prompts]
    stop = full[0][3:5]
    r = httpx.post(f"{server}/v1/completions", json={"prompt": prompts, "n": 2, "max_tokens": 20, "temperature": 0,
                                                      "stop": [stop]}, timeout=60).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    for c in r["choices"]:
        want = full[c["index"] // 2]
        cut = want.find(stop)
        assert c["text"] == (want[:cut] if cut >= 0 else want)
        assert c["finish_reason"] == ("stop" if cut >= 0 else "length")
    assert r["usage"]["prompt_tokens"] == sum(map(len, prompts))
    assert r["usage"]["total_tokens"] == r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"]


def _metric(url: str, name: str, labels: dict | None = None) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in fam.samples:
            if s.name == name and (labels is None or all(s.labels.get(k) == v for k, v in labels.items())):
                return s.value
    return 0.0


def test_client_disconnect_frees_the_slot(server):
    _cancel_one_and_wait_for_its_slot(server)


def _cancel_one_and_wait_for_its_slot(server):
    """A streaming request whose client leaves after its first token: the engine aborts it and frees its slot."""
    aborted = _metric(server, "ssmq_requests_total", {"outcome": "abort"})
    with httpx.Client(base_url=server, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": "abc", "max_tokens": 90, "ignore_eos": True,
                                                        "temperature": 0, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            assert c.get("/health").json()["slots_used"] == 1
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        h = httpx.get(f"{server}/health").json()
        if h["slots_used"] == 0 and h["running"] == 0:
            break
        time.sleep(0.05)
    assert h["slots_used"] == 0 and h["running"] == 0
    assert _metric(server, "ssmq_requests_total", {"outcome": "abort"}) == aborted + 1


BAD = [  # (body, status, the error message contains)
    (b'{"prompt": "ab", "max_tokens": 3', 400, "malformed JSON"),
    (b'[1, 2]', 400, "JSON object"),
    (b'{"prompt": "ab", "model": "gpt-9"}', 400, "not served"),
    (b'{"prompt": "ab", "max_tokens": 0}', 400, "max_tokens"),
    (b'{"prompt": "ab", "max_tokens": -2}', 400, "max_tokens"),
    (b'{"prompt": "ab", "max_tokens": 95}', 400, "maximum context length"),
    (json.dumps({"prompt": [1] * 97, "max_tokens": 1}).encode(), 400, "maximum context length"),
    (b'{"prompt": "ab", "temperature": -0.5}', 400, "temperature"),
    (b'{"prompt": "ab", "top_p": 0}', 400, "top_p"),
    (b'{"prompt": "ab", "top_p": 1.5}', 400, "top_p"),
    (b'{"prompt": "ab", "n": 1000}', 400, "n must be"),
    (b'{"prompt": "ab", "n": "2"}', 400, "n:"),
    (b'{"prompt": "ab", "max_tokens": "8"}', 400, "max_tokens"),
    (b'{"prompt": 5}', 400, "prompt"),
    (b'{"prompt": ""}', 400, "empty"),
    (b'{"prompt": []}', 400, "empty"),
    (b'{"prompt": [[]]}', 400, "empty"),
    (b'{"prompt": [1, 999]}', 400, "vocabulary"),
    (b'{"max_tokens": 3}', 400, "prompt"),
    (b'{"prompt": "ab", "logprobs": 99}', 400, "logprobs"),
    (b'{"prompt": "ab", "stop": ["", "x"]}', 400, "stop"),
    (json.dumps({"prompt": "a" * 30_000}).encode(), 413, "exceeds the limit"),
    # every field is served or refused by name
    (b'{"prompt": "ab", "best_of": 2}', 400, "best_of"),
    (b'{"prompt": "ab", "suffix": "x"}', 400, "suffix"),
    (b'{"prompt": "ab", "min_tokens": 3}', 400, "min_tokens: this field is not supported"),
    (b'{"prompt": "ab", "frequency_penalty": 2.5}', 400, "frequency_penalty"),
    (b'{"prompt": "ab", "presence_penalty": -9}', 400, "presence_penalty"),
    (b'{"prompt": "ab", "logit_bias": {"64": 1}}', 400, "logit_bias"),
    (b'{"prompt": "ab", "logit_bias": {"1": 1000}}', 400, "logit_bias"),
    (b'{"prompt": "ab", "logit_bias": {"-1": 1}}', 400, "logit_bias"),
    # numbers and text the sampler or the encoder cannot hold
    (b'{"prompt": "ab", "temperature": NaN}', 400, "NaN"),
    (b'{"prompt": "ab", "top_p": Infinity}', 400, "Infinity"),
    (b'{"prompt": "ab", "temperature": 1e400}', 400, "temperature"),
    (b'{"prompt": "ab", "temperature": 3}', 400, "temperature"),
    (b'{"prompt": "a\\ud800b"}', 400, "surrogate"),
    (b'{"prompt": "ab", "stop": "\\udfff"}', 400, "surrogate"),
    (b'{"prompt": "ab", "seed": 99999999999999999999999}', 400, "seed"),
    (b'{"prompt": "ab", "top_k": -7}', 400, "top_k"),
    (b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", 413, "exceeds the limit"),
    (b"[" * 9_000 + b"]" * 9_000, 400, "nested too deeply"),
]


@pytest.mark.parametrize("body,status,words", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(server, body, status, words):
    r = httpx.post(f"{server}/v1/completions", content=body, headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["type"]
    ok = httpx.post(f"{server}/v1/completions", json={"prompt": "ab", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 1


def test_slow_and_vanishing_clients_do_not_hold_the_server(server):
    host, port = server.removeprefix("http://").split(":")
    head = (f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
            f"content-length: 200\r\n\r\n").encode()
    slow, gone = socket.create_connection((host, int(port))), socket.create_connection((host, int(port)))
    slow.sendall(head + b'{"prompt": "a')  # and never the rest
    gone.sendall(head + b'{"prompt"')
    gone.close()
    ok = httpx.post(f"{server}/v1/completions", json={"prompt": "ab", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200  # served while both bodies are pending
    slow.settimeout(10)
    reply = b""
    while chunk := slow.recv(4096):  # the server closes the connection after its answer
        reply += chunk
    slow.close()
    reply = reply.decode()
    assert reply.startswith("HTTP/1.1 408") and "not received within" in reply


def test_request_timeout(mamba2):
    with start(mamba2, max_model_len=4096, request_timeout_s=0.3) as url:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "ab", "max_tokens": 4000, "ignore_eos": True},
                       timeout=60)
        assert r.status_code == 408 and "timed out" in r.json()["error"]["message"]
        assert httpx.get(f"{url}/health").json()["slots_used"] == 0


def test_metrics_parse_as_prometheus_text(server):
    from prometheus_client.parser import text_string_to_metric_families

    httpx.post(f"{server}/v1/completions", json={"prompt": "abc", "max_tokens": 3}, timeout=30)
    text = httpx.get(f"{server}/metrics", headers={"accept": "text/plain"}).text  # what a plain scraper asks for
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("ssmq_queue_length", "ssmq_running_sequences", "ssmq_cache_slots_used", "ssmq_kv_blocks_used",
                 "ssmq_prompt_tokens", "ssmq_generation_tokens", "ssmq_time_to_first_token_seconds",
                 "ssmq_time_per_output_token_seconds"):
        assert name in families, name
    assert families["ssmq_time_to_first_token_seconds"].type == "histogram"
    assert _metric(server, "ssmq_generation_tokens_total") >= 3
    assert _metric(server, "ssmq_cache_slots_total") == 8


def test_models_tokenize_detokenize(server):
    models = httpx.get(f"{server}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [NAME]
    ids = httpx.post(f"{server}/tokenize", json={"prompt": "Hello, world"}).json()["tokens"]
    assert ids == TOK.encode("Hello, world")
    assert httpx.post(f"{server}/detokenize", json={"tokens": ids}).json()["prompt"] == "Hello, world"
    assert httpx.post(f"{server}/detokenize", json={"tokens": [1, 10_000]}).status_code == 400
    assert httpx.get(f"{server}/tokenizer_info").json()["eos_token"] == TOK.decode([TOK.eos_id])


def test_lm_eval_local_completions_scores_as_ssmq_eval(server, mamba2):
    """lm-evaluation-harness's own ``local-completions`` client (remote tokenizer: /tokenize, echo + logprobs)."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from ssmq.eval.scoring import loglikelihood

    requests = [("The cat sat on the", " mat"), ("Hello", ", world!"), ("", "abc def"), ("a b c d e f", " g h"),
                ("Why, ", "because.")]
    lm = LocalCompletionsAPI(base_url=f"{server}/v1/completions", model=NAME, tokenizer_backend="remote",
                             max_length=96, batch_size=2, max_retries=1)
    got = lm.loglikelihood([Instance("loglikelihood", {}, r, i) for i, r in enumerate(requests)],
                           disable_tqdm=True)
    want = loglikelihood(mamba2, TOK, requests, progress=False)
    for (ll, greedy), (ll_ref, greedy_ref) in zip(got, want):
        assert ll == pytest.approx(ll_ref, rel=1e-5, abs=1e-5)
        assert greedy == greedy_ref


TP_TIMEOUT_S = 4.0


def _tp_rank(rank, world, init_file, port, ready, stop):
    """One rank of a CPU (gloo) tensor-parallel server: rank 0 serves on ``port``, rank 1 follows."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from ssmq.runtime.engine import LocalRunner
    from ssmq.runtime.tp import apply_tp
    from ssmq.runtime.tp_comm import Communicator
    from ssmq.runtime.tp_launch import init_tp
    from ssmq.runtime.tp_serve import BroadcastRunner, follow

    torch.set_num_threads(1)
    # a short timeout: a follower that waited for the next call on the model's group would fail while idle
    init_tp(world, "cpu", init_method=f"file://{init_file}", rank=rank, world=world, timeout_s=TP_TIMEOUT_S)
    model = apply_tp(tiny_model("mamba2", seed=3), Communicator(device="cpu"))
    cfg = EngineConfig(max_batch=4, max_model_len=96, prefill_tokens=48, prefill_chunk=8)  # batched prefill
    local = LocalRunner(model, cfg)
    if rank:
        follow(local)
    else:
        engine = Engine(model, cfg, runner=BroadcastRunner(local))
        with BackgroundServer(engine, TOK, ServerConfig((NAME,)), port=port):
            ready.set()
            stop.wait(600)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()  # a group left to the interpreter's exit can abort the process


def test_tensor_parallel_server_equals_offline(tmp_path, mamba2):
    """Two gloo ranks on CPU (as torchrun starts ``ssmq serve --tp 2``): rank 0 serves, rank 1 follows; the server
    idles longer than the process group's timeout and still answers."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ready, stop = ctx.Event(), ctx.Event()
    procs = [ctx.Process(target=_tp_rank, args=(r, 2, tmp_path / "pg", port, ready, stop), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        assert ready.wait(240), "the tensor-parallel server did not start"
        prompts = random_prompts(6, seed=2)
        bodies = [{"prompt": p, "max_tokens": 10, "temperature": 0, "stream": i % 2 == 0}
                  for i, p in enumerate(prompts)]
        texts = run_concurrently(f"http://127.0.0.1:{port}", bodies[:4], [False] * 4)
        time.sleep(TP_TIMEOUT_S + 2)
        texts += run_concurrently(f"http://127.0.0.1:{port}", bodies[4:], [False] * 2)
    finally:
        stop.set()
        for p in procs:
            p.join(120)
            if p.is_alive():
                p.kill()
                p.join()
    assert [p.exitcode for p in procs] == [0, 0], "a rank failed or hung (exit codes above)"
    for i, (p, text) in enumerate(zip(prompts, texts)):
        assert text == offline_text(mamba2, p, 10), f"request {i}"


def test_serve_refuses_a_bad_tp():
    from ssmq.cli import main

    assert main(["serve", "--tp", "0"]) == 1


@pytest.mark.parametrize("flags,message", [(["--kv-blocks", "0"], "--kv-blocks must be >= 1"),
                                           (["--kv-cache-memory", "-1"], "--kv-cache-memory must be a positive"),
                                           (["--kv-block-size", "0"], "--kv-block-size must be >= 1"),
                                           (["--prefill-chunk", "0"], "--prefill-chunk must be >= 1"),
                                           (["--prefill-tokens", "0"], "--prefill-tokens must be >= 1")])
def test_serve_refuses_bad_kv_cache_flags(flags, message, capsys):
    from ssmq.cli import main

    assert main(["serve", *flags]) == 1
    assert message in capsys.readouterr().err


def test_prefill_flags_reach_the_engine_config():
    import argparse

    from ssmq.errors import SSMQError
    from ssmq.runtime.command import add_arguments, engine_config

    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = engine_config(p.parse_args(["--prefill-chunk", "64", "--prefill-tokens", "256",
                                      "--graph-prefill-tokens", "128"]))
    assert (cfg.prefill_chunk, cfg.prefill_tokens, cfg.graph_prefill_tokens) == (64, 256, 128)
    default = engine_config(p.parse_args([]))
    d = EngineConfig()
    assert (default.prefill_chunk, default.prefill_tokens, default.graph_prefill_tokens) == (
        d.prefill_chunk, d.prefill_tokens, d.graph_prefill_tokens) == (512, 8192, 512)
    with pytest.raises(SSMQError, match="--graph-prefill-tokens must be >= 1"):
        engine_config(p.parse_args(["--graph-prefill-tokens", "0"]))


def test_kv_cache_memory_sizes_the_block_pools_in_the_model_s_kv_format():
    """--kv-cache-memory: as many blocks as the budget holds at the bytes a token takes in the cache as allocated
    (float or quantized: the pools' bytes a token equal ``kv_bytes_per_token``) and in the decode workspace that
    grows with the pools (with outliers: the outlier passes' float32 scores, as the kernel allocates them over the
    pools); a KVQuant model gets several times the float16 blocks of the same memory; a budget below one block is
    refused in one line."""
    from ssmq.errors import SSMQError
    from ssmq.quant import quantize
    from ssmq.runtime.engine import kv_block_count, kv_bytes_per_token, kv_pool_bytes_per_token
    from tiny_ssm import synthetic_calibration

    fp = tiny_model("hybrid", seed=5).half()
    kvq = quantize(tiny_model("hybrid", seed=5), "kvquant-nuq4-1%", synthetic_calibration(64, 4, 32),
                   progress=False).half()
    cfg = EngineConfig(max_batch=2, max_model_len=64, kv_block_size=8, kv_cache_bytes=1 << 20)
    counts, cache_bytes = {}, {}
    for name, model in (("fp16", fp), ("nuq4-1%", kvq)):
        cache_bytes[name] = per_token = kv_bytes_per_token(model)
        workspace = kv_pool_bytes_per_token(model) - per_token
        counts[name] = n = kv_block_count(model, cfg)
        assert n == (1 << 20) // (8 * (per_token + workspace)) - 1
        cache = model.allocate_cache(2, 64, kv_blocks=n + 1, kv_block_size=8)
        states = [st for st in cache.states if hasattr(st, "table")]
        pools = sum(t.numel() * t.element_size() for st in states
                    for t in ([st.k, st.v] if isinstance(st.k, torch.Tensor) else
                              [t for side in (st.k, st.v) for t in side.buffers() if t is not side.sink]))
        assert pools == (n + 1) * 8 * per_token
        if name == "fp16":
            assert workspace == 0
        else:
            hq = model.config.attn_heads
            assert workspace == 4 * hq
            if importlib.util.find_spec("triton") is not None:  # the decode kernel's own sizing agrees
                from ssmq.kernels.kv_decode_fast import outlier_workspace_shape

                shape = outlier_workspace_shape(states[0].k.codes, 2, hq, paged=True)
                assert math.prod(shape) * 4 == (n + 1) * 8 * workspace
    # the workspace, hq float32 a token, is a fifth of this 2-layer toy's quantized cache; 1/294 of Llama-3.1-8B's
    assert cache_bytes["fp16"] > 3 * cache_bytes["nuq4-1%"] and counts["nuq4-1%"] > 2 * counts["fp16"]
    with pytest.raises(SSMQError, match="holds no block"):
        kv_block_count(fp, EngineConfig(kv_block_size=8, kv_cache_bytes=100))


@pytest.mark.gpu
@pytest.mark.parametrize("state_checkpoint", [None, 16])
@pytest.mark.parametrize("arch", ["mamba2", "hybrid", "hybrid+kvquant", "mamba2+int8-state"])
def test_cuda_graph_engine_equals_offline_on_gpu(arch, state_checkpoint):
    """On CUDA the engine decodes from CUDA graphs (and prefills through graph pieces): the same greedy text as
    the offline eager ``generate``, hybrids through the block KV cache, a KVQuant hybrid through its paged
    quantized KV cache, an ``int8-state`` model on its int8 state (prompts of power-of-two lengths: the graph
    prefill takes a prompt in binary pieces and an int8 state is re-quantized between pieces, where eager offline
    prefills it whole; such prompts are one piece, so both quantize the state at the same points)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (the interpreter does not capture graphs)")
    model = tiny_model(arch.split("+")[0], seed=4)
    if arch.endswith("+kvquant"):
        from ssmq.quant import quantize
        from tiny_ssm import synthetic_calibration

        quantize(model, "kvquant-nuq4-1%", synthetic_calibration(64, 4, 32), progress=False)
    int8_state = arch.endswith("+int8-state")
    if int8_state:
        from ssmq.quant import quantize

        quantize(model, "int8-state", None, progress=False)
    model = model.cuda()
    prompts = random_prompts(12, seed=3)
    if int8_state:
        prompts = [p[:1 << (len(p).bit_length() - 1)] for p in prompts]
    # the KVQuant hybrid at the default block size (32: whole tiles, the fast kernel's one table entry a tile)
    engine = Engine(model, EngineConfig(max_batch=4, max_model_len=96, prefill_tokens=64 if int8_state else 16,
                                        kv_block_size=32 if arch.endswith("+kvquant") else 4,
                                        state_checkpoint=state_checkpoint))
    with BackgroundServer(engine, TOK, ServerConfig((NAME,))) as url:
        bodies = [{"model": NAME, "prompt": p, "max_tokens": 16, "temperature": 0, "stream": i % 2 == 0}
                  for i, p in enumerate(prompts)]  # the openai client requires the model name
        texts = run_concurrently(url, bodies, [i % 3 == 0 for i in range(len(bodies))])
    # an int8 state is rounded where it is written: offline decodes with the same checkpointing (a float state
    # replays exactly, so the plain offline text is the reference there)
    offline = dict(state_checkpoint=state_checkpoint) if int8_state else {}
    for i, (p, text) in enumerate(zip(prompts, texts)):
        assert text == offline_text(model, p, 16, **offline), f"request {i}"
