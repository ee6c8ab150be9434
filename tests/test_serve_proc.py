"""The engine in a process of its own (``ProcessEngine``) behind the real HTTP server: the same answers as offline
``generate``, a fault of one request fails it alone, a disconnect frees its slot, a crash of the engine process
fails what is in flight with 500 and turns /health unhealthy, and no child process outlives the server.

The engine processes build their models from tests/engine_proc_models.py (faults injected there by seed). Starting
one costs seconds (a fresh interpreter imports torch): the tests share one where they can.
"""

from __future__ import annotations

import functools
import json
import multiprocessing
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
import engine_proc_models as loaders
from char_tokenizer import CharTokenizer
from tiny_ssm import tiny_model

pytest.importorskip("fastapi", reason="ssmq serve needs fastapi (pip install -e '.[dev]')")

from ssmq.errors import SSMQError  # noqa: E402
from ssmq.runtime.engine import EngineConfig  # noqa: E402
from ssmq.runtime.engine_proc import ProcessEngine  # noqa: E402
from ssmq.runtime.server import BackgroundServer, ServerConfig  # noqa: E402
from test_serve import _metric, offline_text, random_prompts, run_concurrently  # noqa: E402

TOK = CharTokenizer()
NAME = "tiny"
CFG = EngineConfig(max_batch=8, max_model_len=96, prefill_tokens=64, prefill_chunk=8)


def _engine(load=loaders.tiny, cfg=CFG, **kw) -> ProcessEngine:
    return ProcessEngine(functools.partial(load, **kw), cfg, log_level="warning").start()


@pytest.fixture(scope="module")
def mamba2():
    return tiny_model("mamba2", seed=3)


@pytest.fixture(scope="module")
def served():
    """(url, engine): one engine process for the module, decode steps of >= 10 ms, faults by seed."""
    engine = _engine(step_sleep=0.01, faults=True)
    with BackgroundServer(engine, TOK, ServerConfig((NAME,))) as url:
        yield url, engine
    assert not engine._proc.is_alive() and engine._proc.exitcode == 0


def _post(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def test_concurrent_greedy_requests_equal_offline_generate(served, mamba2):
    url, _ = served
    prompts = random_prompts(16, seed=5)
    max_tokens = [4 + (7 * i) % 17 for i in range(16)]
    bodies = [{"model": NAME, "prompt": p if i % 3 else TOK.decode(p), "max_tokens": m, "temperature": 0,
               "stream": i % 2 == 0} for i, (p, m) in enumerate(zip(prompts, max_tokens))]
    texts = run_concurrently(url, bodies, [i % 4 < 2 for i in range(16)])
    for i, (p, m, text) in enumerate(zip(prompts, max_tokens, texts)):
        assert text == offline_text(mamba2, p, m), f"request {i}"


def test_logprobs_and_echo_cross_the_process_boundary(served, mamba2):
    """Events other than a bare token (prompt logprobs, top alternatives) arrive whole: the same numbers as the
    engine thread's server computes from the same model."""
    url, _ = served
    body = {"prompt": "hello", "max_tokens": 5, "temperature": 0, "logprobs": 2, "echo": True}
    got = _post(url, body).json()["choices"][0]
    from test_serve import start

    with start(mamba2) as thread_url:
        want = _post(thread_url, body).json()["choices"][0]
    assert got["text"] == want["text"] and got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
    assert got["logprobs"]["token_logprobs"][1:] == pytest.approx(want["logprobs"]["token_logprobs"][1:], abs=1e-5)


def test_a_fault_in_one_request_fails_it_alone(served, mamba2):
    """The sampler raises in the engine process for one request's row, mid-batch: that request gets a 500 naming
    the cause; its neighbours get their offline text; every slot is free afterwards."""
    url, _ = served
    out = {}
    t = threading.Thread(target=lambda: out.update(r=_post(url, {
        "prompt": "xyz", "max_tokens": 60, "temperature": 0.5, "seed": loaders.FAULT_SEED, "ignore_eos": True})))
    t.start()
    prompts = random_prompts(6, seed=21)
    texts = run_concurrently(url, [{"prompt": p, "max_tokens": 20, "temperature": 0, "stream": i % 2 == 0}
                                   for i, p in enumerate(prompts)], [False] * 6)
    t.join(60)
    assert out["r"].status_code == 500
    assert "sampling failed: RuntimeError: injected fault" in out["r"].json()["error"]["message"]
    for i, (p, text) in enumerate(zip(prompts, texts)):
        assert text == offline_text(mamba2, p, 20), f"request {i}"
    health = httpx.get(f"{url}/health").json()
    assert health["status"] == "ok" and health["slots_used"] == 0 and health["running"] == 0


def test_a_client_that_disconnects_frees_its_slot_within_a_second(served):
    """Non-streaming: the client goes away while its tokens arrive every 10 ms; the abort crosses to the engine
    process and frees the slot at its next step."""
    url, _ = served
    aborted = _metric(url, "ssmq_requests_total", {"outcome": "abort"})
    sock = raw_completion(url, {"prompt": "abc", "max_tokens": 90, "ignore_eos": True, "temperature": 0})
    deadline = time.monotonic() + 30
    while httpx.get(f"{url}/health").json()["slots_used"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    sock.close()
    gone = time.monotonic()
    while httpx.get(f"{url}/health").json()["slots_used"]:
        assert time.monotonic() - gone < 1.0, "the slot was not freed within 1 s of the disconnect"
        time.sleep(0.01)
    deadline = time.monotonic() + 5
    while _metric(url, "ssmq_requests_total", {"outcome": "abort"}) != aborted + 1:
        assert time.monotonic() < deadline, "the abort was not counted"
        time.sleep(0.02)


def test_metrics_from_both_processes(served):
    """Queue times and prompt tokens come from the engine process, TTFT/TPOT and token counts from this one; all
    in one OpenMetrics-valid page."""
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    url, _ = served

    def counts() -> dict:
        r = httpx.get(f"{url}/metrics", headers={"accept": "application/openmetrics-text; version=1.0.0"})
        fams = {f.name: f for f in text_string_to_metric_families(r.text)}
        get = {s.name: s.value for f in fams.values() for s in f.samples if not s.labels or "le" not in s.labels}
        return {k: get[k] for k in ("ssmq_queue_time_seconds_count", "ssmq_time_to_first_token_seconds_count",
                                    "ssmq_time_per_output_token_seconds_count", "ssmq_prompt_tokens_total",
                                    "ssmq_generation_tokens_total")}

    before = counts()
    for prompt in ("abc", "hello"):
        assert _post(url, {"prompt": prompt, "max_tokens": 4, "ignore_eos": True}).status_code == 200
    after = counts()
    delta = {k: after[k] - before[k] for k in before}
    assert delta == {"ssmq_queue_time_seconds_count": 2, "ssmq_time_to_first_token_seconds_count": 2,
                     "ssmq_time_per_output_token_seconds_count": 6, "ssmq_prompt_tokens_total": 8,
                     "ssmq_generation_tokens_total": 8}


def test_a_crash_of_the_engine_process_fails_what_is_in_flight_and_health_says_so():
    """The engine process dies mid-batch (exit code 7): the requests in flight, streaming or not, end with 500,
    /health answers 503 "unhealthy", new requests 503; nothing hangs, and no child process is left."""
    engine = _engine(step_sleep=0.01, faults=True)
    with BackgroundServer(engine, TOK, ServerConfig((NAME,))) as url:
        out = {}
        long = {"prompt": "abc", "max_tokens": 90, "ignore_eos": True, "temperature": 0}
        plain = threading.Thread(target=lambda: out.update(plain=_post(url, long)))
        plain.start()
        with httpx.Client(base_url=url, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json={**long, "stream": True}) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: {")
                crash = _post(url, {"prompt": "ab", "max_tokens": 5, "temperature": 0.5, "seed": loaders.CRASH_SEED})
                rest = list(lines)
        plain.join(60)
        health = httpx.get(f"{url}/health")
        refused = _post(url, {"prompt": "ab", "max_tokens": 3})
    assert crash.status_code == 500 and "engine process died (exit code 7)" in crash.json()["error"]["message"]
    assert out["plain"].status_code == 500 and "engine process died" in out["plain"].json()["error"]["message"]
    errors = [json.loads(x[6:]) for x in rest if x.startswith("data: {") and '"error"' in x]
    assert errors and "engine process died" in errors[0]["error"]["message"]
    assert health.status_code == 503 and health.json()["status"] == "unhealthy"
    assert refused.status_code == 503 and "not running" in refused.json()["error"]["message"]
    assert not engine._proc.is_alive() and engine._proc.exitcode == 7
    assert engine._proc not in multiprocessing.active_children()


def test_a_load_that_fails_in_the_engine_process_is_one_line():
    """... and the engine process runs under the kernel policy of the process that started it."""
    from ssmq.kernels.policy import KernelPolicy, using

    before = multiprocessing.active_children()
    with pytest.raises(SSMQError) as e, using(KernelPolicy(pdl=False)):
        ProcessEngine(loaders.failing, CFG, log_level="error").start()
    assert str(e.value) == "the engine process failed to start: ValueError: no weights here (pdl=False)"
    assert multiprocessing.active_children() == before


def test_engine_kind_is_decided_by_the_flags(capsys):
    from ssmq.cli import main

    before = multiprocessing.active_children()
    assert main(["serve", "--engine", "process", "--tp", "2"]) == 1
    assert "--engine process serves one rank" in capsys.readouterr().err
    assert main(["serve", "--model", "/nonexistent/model", "--device", "cpu"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "/nonexistent/model" in err[0]
    assert multiprocessing.active_children() == before


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mamba2", "hybrid"])
def test_trained_models_through_the_engine_process_equal_offline(name):
    from conftest import shared_or_skip
    from ssmq.quant import load_model
    from ssmq.tokenizer import load_tokenizer

    path = shared_or_skip("models", name)
    model = load_model(path, dtype=torch.float32, device="cpu").eval()
    tok = load_tokenizer(path)
    cfg = EngineConfig(max_batch=6, max_model_len=160, prefill_chunk=16, prefill_tokens=128, kv_block_size=8)
    prompts = [tok.encode(t) for t in ("The history of the", "In 1998 , the band released", "Robert Boulter is",
                                       "The game 's battle system", "It was the first", "Valkyria")]
    bodies = [{"prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": i % 2 == 0}
              for i, p in enumerate(prompts)]
    engine = _engine(loaders.trained, cfg, name=name)
    with BackgroundServer(engine, tok, ServerConfig((name,))) as url:
        texts = run_concurrently(url, bodies, [False] * len(bodies))
    from ssmq.runtime.generate import generate
    from ssmq.runtime.sampling import SamplingParams

    for i, (p, text) in enumerate(zip(prompts, texts)):
        want = generate(model, [p], SamplingParams(max_new_tokens=24, stop_at_eos=False, eos_id=tok.eos_id))[0]
        assert text == tok.decode(want), f"request {i}"


@pytest.mark.slow
def test_ssmq_serve_drains_on_sigterm_to_its_process_group_and_leaves_no_child(tmp_path):
    """``ssmq serve`` (the engine in its own process by default) sent SIGTERM as a service manager sends it, to
    every process of the group: the engine process ignores it, the request in flight finishes, exit code 0, and
    the engine process is gone."""
    from conftest import shared_or_skip

    path = shared_or_skip("models", "mamba2")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "ssmq", "serve", "--model", str(path), "--device", "cpu",
                             "--port", str(port), "--max-batch", "2", "--max-model-len", "256",
                             "--log-level", "warning"], env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(url, proc, 180, poll=0.2)
        children = _children(proc.pid)  # the engine process (and multiprocessing's resource tracker)
        assert any("spawn_main" in Path(f"/proc/{c}/cmdline").read_text() for c in children), children
        out = {}
        t = threading.Thread(target=lambda: out.update(r=httpx.post(
            f"{url}/v1/completions", json={"prompt": "The history of", "max_tokens": 60, "ignore_eos": True},
            timeout=120)))
        t.start()
        while httpx.get(f"{url}/health").json()["running"] == 0:
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGTERM)
        rc = proc.wait(120)
        t.join(60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert rc == 0
    assert out["r"].status_code == 200 and out["r"].json()["usage"]["completion_tokens"] == 60
    deadline = time.monotonic() + 10  # multiprocessing's resource tracker exits once its pipe closes
    while (left := [c for c in children if _alive(c)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, [Path(f"/proc/{c}/cmdline").read_text() for c in left]


def _alive(pid: int) -> bool:
    """Running (a zombie, exited but not yet reaped by its new parent, is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


ORPHAN_MAIN = """
import functools, os, sys
sys.path.insert(0, {tests!r})
import engine_proc_models
from ssmq.runtime.engine import EngineConfig
from ssmq.runtime.engine_proc import ProcessEngine
if __name__ == "__main__":
    engine = ProcessEngine(engine_proc_models.tiny, EngineConfig(max_batch=2, max_model_len=32)).start()
    print(engine._proc.pid, flush=True)
    os.kill(os.getpid(), 9)
"""


@pytest.mark.slow
def test_the_engine_process_exits_when_the_server_process_is_killed(tmp_path):
    """SIGKILL leaves the server's process no time to stop its engine: the engine process sees its command pipe
    close and exits by itself (no orphan keeps the device)."""
    script = tmp_path / "main.py"
    script.write_text(ORPHAN_MAIN.format(tests=str(Path(__file__).parent)))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == -9, done.stderr
    pid = int(done.stdout.split()[0])
    deadline = time.monotonic() + 30
    while _alive(pid):
        assert time.monotonic() < deadline, "the engine process outlived the server's"
        time.sleep(0.1)
