"""ssmq serve beyond plain completions: one failing request among many, penalties and logit_bias, chat completions,
the API key, slots freed on disconnect, header and connection limits, the drain, OpenMetrics.

Real HTTP on 127.0.0.1 against the tiny models and character tokenizer of tests/test_serve.py; every expected text
comes from the offline ``generate``.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from _server_proc import raw_completion, wait_until_serving

pytest.importorskip("fastapi", reason="ssmq serve needs fastapi (pip install -e '.[dev]')")

from test_serve import NAME, TOK, offline_text, random_prompts, run_concurrently, start  # noqa: E402
from tiny_ssm import tiny_model  # noqa: E402

from ssmq.runtime import sampling  # noqa: E402
from ssmq.runtime.engine import Engine, EngineConfig  # noqa: E402
from ssmq.runtime.generate import generate  # noqa: E402
from ssmq.runtime.sampling import SamplingError, SamplingParams, check_sampling, sample_next  # noqa: E402
from ssmq.runtime.server import BackgroundServer, ServerConfig  # noqa: E402

CHAT = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def mamba2():
    return tiny_model("mamba2", seed=3)


def _slow(engine: Engine, seconds: float) -> Engine:
    """Every decode step takes at least ``seconds`` (a step of any speed: the behaviour must not depend on it)."""
    decode = engine.runner.decode

    def slow(tokens, slots):
        time.sleep(seconds)
        return decode(tokens, slots)

    engine.runner.decode = slow
    return engine


def _engine(model, **kw) -> Engine:
    return Engine(model, EngineConfig(**{"max_batch": 8, "max_model_len": 96, "prefill_tokens": 16, **kw}))


# ------------------------------------------------------------------ isolation
def test_a_sampler_failure_in_one_row_fails_that_request_alone(mamba2, monkeypatch):
    """The sampler raises for one request's row mid-batch (from its 4th token on): that request gets a 500 naming
    the cause; greedy and seeded neighbours, streaming or not, get exactly their offline text."""
    calls = {}

    def faulty(logits, params, generator, counts):
        if params.seed == 666:
            calls[666] = calls.get(666, 0) + 1
            if calls[666] > 3:
                raise RuntimeError("injected fault")
        return sampling.sample_next(logits, params, generator, counts)

    monkeypatch.setattr(sampling, "sample_row", faulty)
    prompts = random_prompts(8, seed=21)
    bodies = [{"prompt": p, "max_tokens": 20, "temperature": 0, "stream": i % 2 == 0} for i, p in enumerate(prompts)]
    seeded = {"prompt": prompts[0], "max_tokens": 12, "temperature": 0.9, "seed": 7, "ignore_eos": True}
    with BackgroundServer(_slow(_engine(mamba2), 0.005), TOK, ServerConfig((NAME,))) as url:
        def poisoned(out):
            out["r"] = httpx.post(f"{url}/v1/completions", json={"prompt": prompts[1][:20], "max_tokens": 60,
                                                                 "temperature": 0.5, "seed": 666,
                                                                 "ignore_eos": True}, timeout=60)
        out = {}
        t = threading.Thread(target=poisoned, args=(out,))
        t.start()
        texts = run_concurrently(url, bodies + [seeded], [False] * (len(bodies) + 1))
        t.join(60)
        health = httpx.get(f"{url}/health").json()
    assert out["r"].status_code == 500, out["r"].text
    assert "sampling failed: RuntimeError: injected fault" in out["r"].json()["error"]["message"]
    for i, (p, text) in enumerate(zip(prompts, texts)):
        assert text == offline_text(mamba2, p, 20), f"request {i}"
    params = SamplingParams(max_new_tokens=12, temperature=0.9, seed=7, stop_at_eos=False, eos_id=TOK.eos_id,
                            vocab_limit=len(TOK))
    assert texts[-1] == TOK.decode(generate(mamba2, [prompts[0]], params)[0])
    assert health["slots_used"] == 0 and health["running"] == 0


def test_non_finite_logits_in_one_row_fail_that_request_alone(mamba2):
    """The model's logits turn NaN for one sequence of a running batch (a numerical fault in its row): a 500 that
    says so for that request; the others are unchanged, and its slot serves the next request."""
    engine = _engine(mamba2)
    poison = random_prompts(1, seed=99)[0] + [5, 5, 5]
    decode = engine.runner.decode
    steps = {"n": 0}

    def faulty(tokens, slots):
        logits = decode(tokens, slots)
        bad = [r.slot for r in engine.decoding if r.prompt == poison]
        steps["n"] += 1
        if bad and steps["n"] > 4:
            logits[slots == bad[0]] = float("nan")
        return logits

    engine.runner.decode = faulty
    prompts = random_prompts(8, seed=22)
    bodies = [{"prompt": p, "max_tokens": 16, "temperature": 0, "stream": i % 2 == 1} for i, p in enumerate(prompts)]
    bodies.insert(3, {"prompt": poison, "max_tokens": 40, "temperature": 0.7, "ignore_eos": True})
    with BackgroundServer(engine, TOK, ServerConfig((NAME,))) as url:
        import asyncio

        async def post(body):
            async with httpx.AsyncClient(base_url=url, timeout=60) as c:
                return await c.post("/v1/completions", json=body)

        async def main():
            return await asyncio.gather(*[post(b) for b in bodies])

        replies = asyncio.run(main())
        again = httpx.post(f"{url}/v1/completions", json={"prompt": prompts[0], "max_tokens": 16, "temperature": 0},
                           timeout=60)
    bad = replies.pop(3)
    assert bad.status_code == 500 and "not finite" in bad.json()["error"]["message"]
    for i, (p, r) in enumerate(zip(prompts, replies)):
        if not r.headers["content-type"].startswith("text/event-stream"):
            text = r.json()["choices"][0]["text"]
        else:
            text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in r.text.splitlines()
                           if line.startswith("data: {"))
        assert text == offline_text(mamba2, p, 16), f"request {i}"
    assert again.json()["choices"][0]["text"] == offline_text(mamba2, prompts[0], 16)


def test_a_fault_outside_any_request_fails_who_is_there_and_the_engine_goes_on(mamba2, monkeypatch):
    """An exception in the engine's own bookkeeping (here: admission, once) fails the requests of that turn with a
    500 naming it; the engine thread lives on and serves the next request."""
    engine = _engine(mamba2)
    admit, fired = engine._admit, []

    def faulty():
        if engine.waiting and not fired:
            fired.append(1)
            raise RuntimeError("injected bookkeeping fault")
        admit()

    monkeypatch.setattr(engine, "_admit", faulty)
    with BackgroundServer(engine, TOK, ServerConfig((NAME,))) as url:
        first = httpx.post(f"{url}/v1/completions", json={"prompt": "ab", "max_tokens": 4}, timeout=30)
        again = httpx.post(f"{url}/v1/completions", json={"prompt": "ab", "max_tokens": 4, "temperature": 0},
                           timeout=30)
    assert first.status_code == 500 and "injected bookkeeping fault" in first.json()["error"]["message"]
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == offline_text(mamba2, TOK.encode("ab"), 4)


def test_sampling_is_finite_for_every_accepted_value():
    """Temperatures down to the smallest float act as greedy (no inf / inf); penalties and bias at their limits
    stay finite; a NaN row gives -1 while the other rows sample as alone; what check_sampling refuses it names."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 64, generator=g) * 30
    for t in (5e-324, 1e-300, 1e-12, 1e-5):
        out = sample_next(logits, SamplingParams(temperature=t), torch.Generator().manual_seed(1))
        assert out.tolist() == logits.argmax(-1).tolist()
    extreme = SamplingParams(temperature=2.0, top_k=10 ** 9, top_p=5e-324, frequency_penalty=-2, presence_penalty=2,
                             logit_bias={"3": 100, "4": -100})
    counts = torch.full((4, 64), 1e6)
    assert ((sample_next(logits, extreme, g, counts) >= 0) & (sample_next(logits, extreme, g, counts) < 64)).all()
    bad = logits.clone()
    bad[2, 7] = float("nan")
    bad[3, 0] = float("inf")
    p = SamplingParams(temperature=0.8)
    assert sample_next(bad, p, torch.Generator().manual_seed(2))[2:].tolist() == [-1, -1]
    assert sample_next(bad, SamplingParams())[2:].tolist() == [-1, -1]
    alone = [sample_next(logits[i:i + 1], p, torch.Generator().manual_seed(3)).item() for i in range(2)]
    assert [sample_next(bad[i:i + 1], p, torch.Generator().manual_seed(3)).item() for i in range(2)] == alone
    for kw, param in ((dict(temperature=float("nan")), "temperature"), (dict(temperature=2.5), "temperature"),
                      (dict(top_p=0.0), "top_p"), (dict(frequency_penalty=float("inf")), "frequency_penalty"),
                      (dict(presence_penalty=-3), "presence_penalty"), (dict(logit_bias={"64": 1}), "logit_bias"),
                      (dict(logit_bias={"x": 1}), "logit_bias"), (dict(logit_bias={"1": 101}), "logit_bias"),
                      (dict(top_k=-1), "top_k"), (dict(temperature=True), "temperature")):
        with pytest.raises(SamplingError) as e:
            check_sampling(**kw, vocab_size=64)
        assert e.value.param == param and param in str(e.value)


# ------------------------------------------------------------------ penalties and logit_bias
def test_penalties_and_logit_bias_are_honoured_and_equal_offline(mamba2):
    prompts = random_prompts(4, seed=23)
    kinds = [dict(frequency_penalty=1.5), dict(presence_penalty=2.0, frequency_penalty=-0.5),
             dict(logit_bias={"5": 8.0, "9": -100}), dict(temperature=0.8, seed=11, frequency_penalty=0.7,
                                                           logit_bias={"12": 3})]
    bodies = [{"model": NAME, "prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
               "stream": i % 2 == 0, **k}
              for i, (p, k) in enumerate(zip(prompts, kinds))]
    with start(mamba2) as url:
        texts = run_concurrently(url, bodies, [False] * len(bodies))
        forced = httpx.post(f"{url}/v1/completions", json={"prompt": prompts[0], "max_tokens": 8, "temperature": 0,
                                                           "logit_bias": {"7": 100}}, timeout=60).json()
    assert forced["choices"][0]["text"] == TOK.decode([7]) * 8
    for i, (p, k, text) in enumerate(zip(prompts, kinds, texts)):
        params = SamplingParams(max_new_tokens=24, stop_at_eos=False, eos_id=TOK.eos_id, vocab_limit=len(TOK),
                                **{"temperature": 0, **k})
        assert text == TOK.decode(generate(mamba2, [p], params)[0]), f"request {i}"
        plain = SamplingParams(max_new_tokens=24, stop_at_eos=False, vocab_limit=len(TOK),
                               temperature=k.get("temperature", 0), seed=k.get("seed"))
        assert text != TOK.decode(generate(mamba2, [p], plain)[0]), f"request {i}: the field changed nothing"


# ------------------------------------------------------------------ chat completions
def test_chat_completions_equal_offline_generation_of_the_templated_prompt(mamba2):
    from ssmq.runtime.chat import ChatTemplate

    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": " there"}]}]
    rendered = "system: Be brief.\nuser: Hello there\nassistant:"
    assert ChatTemplate(CHAT).render([{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "Hello there"}]) == rendered
    want = offline_text(mamba2, TOK.encode(rendered), 12)
    import openai

    with start(mamba2, chat_template=ChatTemplate(CHAT)) as url:
        whole = httpx.post(f"{url}/v1/chat/completions", json={"model": NAME, "messages": messages, "max_tokens": 12,
                                                               "temperature": 0}, timeout=60).json()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=12,
                                                     temperature=0, stream=True,
                                                     stream_options={"include_usage": True}))
        lp = client.chat.completions.create(model=NAME, messages=messages, max_tokens=3, temperature=0,
                                            logprobs=True, top_logprobs=2)
        refused = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "tools": []}, timeout=30)
    assert whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": want}
    assert whole["usage"]["prompt_tokens"] == len(TOK.encode(rendered))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == whole["usage"]["completion_tokens"]
    content = lp.choices[0].logprobs.content
    assert "".join(t.token for t in content) == lp.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools"


def test_chat_without_a_template_is_a_clear_400(mamba2):
    with start(mamba2) as url:
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                       timeout=30)
    assert r.status_code == 400 and "--chat-template" in r.json()["error"]["message"]


SMOLLM2_TEMPLATE = (  # SmolLM2-Instruct's tokenizer_config.json chat_template
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def test_chat_template_renders_as_transformers_and_loads_from_tokenizer_files(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from ssmq.runtime.chat import ChatTemplate, ChatTemplateError, load_chat_template

    strict = ("{% for m in messages %}{% if m.role == 'assistant' and loop.first %}"
              "{{ raise_exception('the first message must not be the assistant') }}{% endif %}"
              "{{ bos_token }}[{{ m.role }}]{{ m.content | tojson }}{{ eos_token }}{% endfor %}")
    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
                                 bos_token="<s>", eos_token="</s>")
    for source in (SMOLLM2_TEMPLATE, strict, CHAT):
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": source, "bos_token": "<s>",
                                                                    "eos_token": {"content": "</s>"}}))
        ours = load_chat_template(tmp_path)
        for messages in ([{"role": "user", "content": "Hi \"there\" é"}],
                         [{"role": "system", "content": "S"}, {"role": "user", "content": "a\nb"},
                          {"role": "assistant", "content": "c"}, {"role": "user", "content": "d"}]):
            want = hf.apply_chat_template(messages, chat_template=source, tokenize=False, add_generation_prompt=True)
            assert ours.render(messages) == want
    with pytest.raises(ChatTemplateError, match="must not be the assistant"):
        ChatTemplate(strict).render([{"role": "assistant", "content": "x"}])
    (tmp_path / "t.jinja").write_text(CHAT)
    assert load_chat_template(tmp_path / "nowhere", tmp_path / "t.jinja").source == CHAT
    assert load_chat_template(tmp_path.parent) is None


# ------------------------------------------------------------------ API key
def test_api_key_is_required_on_the_api_routes(mamba2):
    with start(mamba2, api_key="s3cret") as url:
        body = {"prompt": "ab", "max_tokens": 2}
        missing = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        wrong = httpx.post(f"{url}/v1/completions", json=body, headers={"authorization": "Bearer s3cres"},
                           timeout=30)
        models = httpx.get(f"{url}/v1/models", timeout=30)
        ok = httpx.post(f"{url}/v1/completions", json=body, headers={"authorization": "Bearer s3cret"}, timeout=30)
        health = httpx.get(f"{url}/health", timeout=30)
    for r in (missing, wrong, models):
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    assert ok.status_code == 200 and health.status_code == 200


# ------------------------------------------------------------------ slots and connections
def test_a_non_streaming_client_that_disconnects_frees_its_slot_within_a_second(mamba2):
    """Tokens arrive every 20 ms, so the request is never idle: the slot (and its KV blocks) must still be free
    within 1 s of the client going away."""
    engine = _slow(_engine(tiny_model("hybrid", seed=5), kv_blocks=40, kv_block_size=4), 0.02)
    with BackgroundServer(engine, TOK, ServerConfig((NAME,))) as url:
        sock = raw_completion(url, {"prompt": "abc", "max_tokens": 90, "ignore_eos": True, "temperature": 0})
        deadline = time.monotonic() + 30
        while httpx.get(f"{url}/health").json()["steps"] < 5:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        busy = httpx.get(f"{url}/health").json()
        sock.close()
        gone = time.monotonic()
        while (h := httpx.get(f"{url}/health").json())["slots_used"] or h["kv_blocks_used"]:
            assert time.monotonic() - gone < 1.0, "the slot was not freed within 1 s of the disconnect"
            time.sleep(0.01)
    assert busy["slots_used"] == 1 and busy["kv_blocks_used"] > 0


def test_stalled_headers_and_silent_connections_are_closed(mamba2):
    with start(mamba2, header_timeout_s=0.5) as url:
        host, port = url.removeprefix("http://").split(":")
        stalled, silent = socket.create_connection((host, int(port))), socket.create_connection((host, int(port)))
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-ty")
        replies = []
        for s in (stalled, silent):
            s.settimeout(10)
            reply = b""
            while chunk := s.recv(4096):  # the server closes the connection
                reply += chunk
            s.close()
            replies.append(reply.decode())
        ok = httpx.post(f"{url}/v1/completions", json={"prompt": "ab", "max_tokens": 2}, timeout=30)
    assert replies[0].startswith("HTTP/1.1 408") and "headers not received within 0.5 s" in replies[0]
    assert replies[1] == ""
    assert ok.status_code == 200


def _received(sock: socket.socket) -> bytes:
    chunk = sock.recv(4096)
    assert chunk, "the server closed the connection"
    return chunk


def test_keep_alive_requests_are_not_timed_out(mamba2):
    """Requests one after another on one connection, each header block well within the header timeout, pauses
    between them longer than it: every one is answered (the timer runs only while a request's headers come in)."""
    with start(mamba2, header_timeout_s=0.3) as url:
        host, port = url.removeprefix("http://").split(":")
        sock = socket.create_connection((host, int(port)))
        sock.settimeout(10)
        codes, buf = [], b""
        for _ in range(3):  # one connection throughout: a closed one fails the test
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
            while b"\r\n\r\n" not in buf:
                buf += _received(sock)
            head, buf = buf.split(b"\r\n\r\n", 1)
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            while len(buf) < length:
                buf += _received(sock)
            buf = buf[length:]
            codes.append(int(head.split()[1]))
            time.sleep(0.5)
        sock.close()
    assert codes == [200, 200, 200]


def test_open_connections_are_bounded(mamba2):
    with start(mamba2, max_connections=2) as url:
        host, port = url.removeprefix("http://").split(":")
        idle = [socket.create_connection((host, int(port))) for _ in range(2)]
        time.sleep(0.2)
        over = httpx.get(f"{url}/v1/models", timeout=30)
        for s in idle:
            s.close()
        time.sleep(0.2)
        after = httpx.get(f"{url}/v1/models", timeout=30)
    assert over.status_code == 503 and after.status_code == 200


@pytest.mark.parametrize("body", [b"[" * 100_000 + b"]" * 100_000, b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
                                  b'{"prompt": "a", "stop": {"a": ' * 3000 + b"1" + b"}" * 3000])
def test_deeply_nested_json_is_a_400(mamba2, body, caplog):
    with start(mamba2, max_body_bytes=1 << 20) as url:
        r = httpx.post(f"{url}/v1/completions", content=body, headers={"content-type": "application/json"},
                       timeout=30)
    assert r.status_code == 400, r.text
    assert "Traceback" not in caplog.text


def test_drain_finishes_requests_in_flight_and_refuses_new_ones(mamba2):
    engine = _slow(_engine(mamba2), 0.01)
    bg = BackgroundServer(engine, TOK, ServerConfig((NAME,), drain_timeout_s=30))
    prompt = random_prompts(1, seed=31)[0]
    with bg as url:
        out = {}
        t = threading.Thread(target=lambda: out.update(r=httpx.post(
            f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 60, "temperature": 0, "ignore_eos": True},
            timeout=60)))
        t.start()
        while httpx.get(f"{url}/health").json()["running"] == 0:
            time.sleep(0.01)
        bg.drain()
        time.sleep(0.1)
        health = httpx.get(f"{url}/health")
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": "ab", "max_tokens": 2}, timeout=30)
        t.join(60)
        bg.thread.join(30)
        exited = not bg.thread.is_alive()
    assert health.status_code == 503 and health.json()["status"] == "draining"
    assert refused.status_code == 503 and "draining" in refused.json()["error"]["message"]
    ids = generate(mamba2, [prompt], SamplingParams(max_new_tokens=60, stop_at_eos=False, vocab_limit=len(TOK)))[0]
    assert out["r"].status_code == 200 and out["r"].json()["choices"][0]["text"] == TOK.decode(ids)
    assert exited


SERVE_MAIN = """
import sys, torch
sys.path.insert(0, {tests!r})
torch.set_num_threads(1)
from char_tokenizer import CharTokenizer
from tiny_ssm import tiny_model
from ssmq.runtime.engine import Engine, EngineConfig
from ssmq.runtime.server import ServerConfig, run_server
engine = Engine(tiny_model("mamba2", seed=3), EngineConfig(max_batch=4, max_model_len=4096, prefill_tokens=16))
decode = engine.runner.decode
def slow(tokens, slots):
    import time
    time.sleep(0.01)
    return decode(tokens, slots)
engine.runner.decode = slow
sys.exit(run_server(engine, CharTokenizer(), ServerConfig(("tiny",), drain_timeout_s={drain}), port={port},
                    log_level="warning"))
"""


@pytest.mark.parametrize("signals", [1, 2])
def test_sigterm_drains_then_exits_0_and_a_second_sigterm_forces_exit(signals):
    """A real process: one SIGTERM lets the request in flight finish, then exit code 0; a second SIGTERM ends it
    at once (the request in flight gets its 503), exit code 1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = SERVE_MAIN.format(tests=str(Path(__file__).parent), port=port, drain=60)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(url, proc, 120)
        out = {}
        max_tokens = 40 if signals == 1 else 4000
        t = threading.Thread(target=lambda: out.update(r=httpx.post(
            f"{url}/v1/completions", json={"prompt": "ab", "max_tokens": max_tokens, "ignore_eos": True},
            timeout=120)))
        t.start()
        while httpx.get(f"{url}/health").json()["running"] == 0:
            time.sleep(0.01)
        for _ in range(signals):
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
        rc = proc.wait(60)
        t.join(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    if signals == 1:
        assert rc == 0
        assert out["r"].status_code == 200 and len(out["r"].json()["choices"][0]["text"]) == 40
    else:
        assert rc == 1
        assert "r" not in out or out["r"].status_code == 503


def test_serve_refuses_bad_server_flags(capsys):
    from ssmq.cli import main

    for flags, message in ((["--drain-timeout", "0"], "--drain-timeout must be"),
                           (["--header-timeout", "nan"], "--header-timeout must be"),
                           (["--max-connections", "0"], "--max-connections must be"),
                           (["--chat-template", "/nonexistent.jinja"], "--chat-template: no file")):
        assert main(["serve", *flags]) == 1
        assert message in capsys.readouterr().err


# ------------------------------------------------------------------ metrics
def test_metrics_are_valid_openmetrics_with_latency_histograms(mamba2):
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    with start(mamba2) as url:
        httpx.post(f"{url}/v1/completions", json={"prompt": "abc", "max_tokens": 3}, timeout=30)
        r = httpx.get(f"{url}/metrics", headers={"accept": "application/openmetrics-text; version=1.0.0"})
    assert r.headers["content-type"].startswith("application/openmetrics-text")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    for name in ("ssmq_time_to_first_token_seconds", "ssmq_time_per_output_token_seconds", "ssmq_queue_time_seconds"):
        assert families[name].type == "histogram"
        bounds = [float(s.labels["le"]) for s in families[name].samples if s.name.endswith("_bucket")]
        assert bounds[0] <= 0.002 and math.isinf(bounds[-1])  # GPU latencies are milliseconds
    count = [s for s in families["ssmq_queue_time_seconds"].samples if s.name.endswith("_count")]
    assert count[0].value == 1
