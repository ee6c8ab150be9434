"""Property-based fuzzing of ssmq serve (bounded: fixed example counts, derandomized, well under a minute).

Request bodies from hypothesis (types, extremes, non-finite numbers, huge and tiny values, unicode, unknown fields)
and from schemathesis over the server's own OpenAPI schema, against a real server, while greedy requests run beside
them: no answer is a 5xx, every answer is well-formed, the server stays up, and every greedy request gets exactly
its offline text.
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest

pytest.importorskip("fastapi", reason="ssmq serve needs fastapi (pip install -e '.[dev]')")
hypothesis = pytest.importorskip("hypothesis", reason="the fuzz tests need hypothesis (pip install -e '.[dev]')")

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402
from test_serve import NAME, offline_text, random_prompts, start  # noqa: E402
from tiny_ssm import tiny_model  # noqa: E402

from ssmq.runtime.chat import ChatTemplate  # noqa: E402

FUZZ = settings(max_examples=90, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

anything = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6)
numbers = (st.floats(allow_nan=True, allow_infinity=True) | st.floats(-3, 3) | st.sampled_from(
    [0, 0.0, -0.0, 5e-324, 1e-300, 1e-45, 1e-38, 2, 2.0000001, 1e308, -1e308]) | st.integers(-2 ** 65, 2 ** 65))
ints = st.integers(-3, 130) | st.sampled_from([2 ** 31, 2 ** 63 - 1, 2 ** 63, 2 ** 64, -2 ** 63]) | anything
texts = st.text(max_size=40) | st.text(st.characters(codec="utf-8"), max_size=20) | st.sampled_from(
    ["", "\x00", "\ufffd", "é" * 30, "🙂", "a\u0301", "\u202e", "abc ~ def"])
prompts = texts | st.lists(st.integers(-2, 70), max_size=12) | st.lists(texts, max_size=3) | st.lists(
    st.lists(st.integers(0, 63), max_size=6), max_size=3) | anything
sampling = {
    "temperature": numbers, "top_p": numbers, "top_k": ints, "seed": ints, "n": st.integers(-1, 20) | anything,
    "max_tokens": ints, "stop": texts | st.lists(texts, max_size=5) | anything, "stream": st.booleans() | anything,
    "frequency_penalty": numbers, "presence_penalty": numbers, "ignore_eos": st.booleans(),
    "logit_bias": st.dictionaries(st.sampled_from(["0", "1", "63", "64", "-1", "x", "1.5", "99999999999999999999"]),
                                  numbers, max_size=4) | anything,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | anything}) | anything,
    "user": texts, "model": st.sampled_from([NAME, "other"]) | anything,
}


def _body(extra: dict, required: dict):
    return st.fixed_dictionaries(required, optional={**sampling, **extra}).flatmap(
        lambda d: st.tuples(st.just(d), st.dictionaries(st.sampled_from(["best_of", "suffix", "min_p", "tools",
                                                                         "\u00e9", "response_format"]),
                                                        anything, max_size=1))).map(lambda t: {**t[0], **t[1]})


completions = _body({"echo": st.booleans() | anything, "logprobs": ints}, {"prompt": prompts})
roles = st.sampled_from(["system", "user", "assistant", "developer", "tool", ""]) | anything
messages = st.lists(st.fixed_dictionaries({"role": roles, "content": texts | st.lists(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": texts}), max_size=2) | anything}),
    max_size=3) | anything
chats = _body({"logprobs": st.booleans() | anything, "top_logprobs": ints, "max_completion_tokens": ints},
              {"messages": messages})


class Greedy:
    """Greedy requests, streaming and not, sent one after another while the fuzz runs; their texts kept."""

    def __init__(self, url: str, prompts: list[list[int]]):
        self.url, self.prompts, self.texts, self.stop = url, prompts, [], threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=60) as c:
            i = 0
            while not self.stop.is_set():
                p = self.prompts[i % len(self.prompts)]
                body = {"prompt": p, "max_tokens": 24, "temperature": 0, "stream": i % 2 == 0}
                if i % 2:
                    self.texts.append((p, c.post("/v1/completions", json=body).json()["choices"][0]["text"]))
                else:
                    with c.stream("POST", "/v1/completions", json=body) as r:
                        text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines()
                                       if line.startswith("data: {"))
                    self.texts.append((p, text))
                i += 1
                self.stop.wait(0.05)  # beside the fuzz, not instead of it


class Fuzzed:
    def __init__(self, url, model, greedy):
        self.url, self.model, self.greedy = url, model, greedy
        self.client = httpx.Client(base_url=url, timeout=60)


@pytest.fixture(scope="module")
def fuzzed():
    """A server (max model len 96, chat template, 20 kB bodies) with greedy requests running beside the fuzz."""
    model = tiny_model("mamba2", seed=3)
    template = ChatTemplate("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")
    with start(model, max_body_bytes=20_000, chat_template=template) as url:
        greedy = Greedy(url, random_prompts(4, seed=41))
        greedy.thread.start()
        fuzz = Fuzzed(url, model, greedy)
        yield fuzz
        fuzz.client.close()
        greedy.stop.set()
        greedy.thread.join(60)


def _send(c: httpx.Client, path: str, body) -> None:
    raw = json.dumps(body, allow_nan=True)  # NaN and Infinity as JSON extensions: refused with a 400
    with c.stream("POST", path, content=raw, headers={"content-type": "application/json"}) as r:
        payload = r.read().decode()
    assert r.status_code < 500, f"{r.status_code} for {raw[:500]}: {payload[:500]}"
    if r.status_code != 200:
        err = json.loads(payload)["error"]
        assert err["message"] and err["type"], payload
    elif r.headers["content-type"].startswith("text/event-stream"):
        lines = [line for line in payload.split("\n") if line]
        assert lines[-1] == "data: [DONE]", payload[-500:]
        for line in lines[:-1]:
            event = json.loads(line.removeprefix("data: "))
            assert "error" not in event, line
    else:
        assert json.loads(payload)["choices"]


@FUZZ
@given(body=completions)
def test_fuzzed_completions_never_5xx(fuzzed, body):
    _send(fuzzed.client, "/v1/completions", body)


@FUZZ
@given(body=chats)
def test_fuzzed_chat_completions_never_5xx(fuzzed, body):
    _send(fuzzed.client, "/v1/chat/completions", body)


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(body=anything | st.binary(max_size=64).map(lambda b: b.decode("latin-1")))
def test_fuzzed_bodies_of_any_shape_never_5xx(fuzzed, body):
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        _send(fuzzed.client, path, body)


# ------------------------------------------------------------------ schemathesis over the OpenAPI schema
def test_openapi_schema_fuzz_never_5xx(fuzzed):
    """Every operation of /openapi.json (request bodies from the pydantic models the routes parse with), fuzzed by
    schemathesis: no 5xx."""
    schemathesis = pytest.importorskip("schemathesis", reason="the schema fuzz needs schemathesis (pip install -e "
                                                              "'.[dev]')")
    schema = schemathesis.openapi.from_url(f"{fuzzed.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/tokenize"}
    for op in operations:
        @settings(max_examples=15, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy())
        def run(case):
            response = case.call(timeout=60)
            assert response.status_code < 500, f"{op.path}: {response.status_code}: {response.text[:500]}"

        run()


def test_the_greedy_requests_beside_the_fuzz_are_unchanged(fuzzed):
    """(after the fuzz tests above, in file order) the server is up and every greedy request got its offline text."""
    fuzzed.greedy.stop.set()
    fuzzed.greedy.thread.join(60)
    assert httpx.get(f"{fuzzed.url}/health").json()["status"] == "ok"
    assert fuzzed.greedy.texts
    want = {tuple(p): offline_text(fuzzed.model, p, 24) for p in fuzzed.greedy.prompts}
    for i, (p, text) in enumerate(fuzzed.greedy.texts):
        assert text == want[tuple(p)], f"greedy request {i} changed under the fuzz"
