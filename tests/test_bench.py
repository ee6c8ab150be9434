"""``ssmq bench``: the timing helper, each benchmark's JSON on the CPU (a one-layer published architecture with random
weights; CPU numbers only test the plumbing), the kernel registry, and the serving client against a stub server."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from ssmq.bench import kernels as kb
from ssmq.bench.timing import time_fn


def run(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "ssmq.cli", "bench", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_time_fn_runs_warmup_then_reps_with_setup_before_each():
    calls = []
    t = time_fn(lambda: calls.append("fn"), "cpu", warmup=2, reps=3, setup=lambda: calls.append("setup"))
    assert calls == ["setup", "fn"] * 5
    assert t.reps == 3 and 0 <= t.min_ms <= t.median_ms
    with pytest.raises(ValueError):
        time_fn(lambda: None, "cpu", reps=0)


def test_latency_writes_rows_for_each_recipe(tmp_path):
    r = run("latency", "--model", "mamba2-130m", "--layers", "1", "--recipes", "float,rtn-w8a16", "--batch-size",
            "1,2", "--input-len", "8", "--steps", "2", "--warmup", "1", "--reps", "1", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "latency.json").read_text())
    assert res["command"].startswith("ssmq bench latency") and res["gpu"].startswith("CPU") and res["date"]
    by = {(row["impl"], row["batch"], "ttft_ms" in row) for row in res["rows"]}
    assert by == {(i, b, False) for i in ("float", "rtn-w8a16") for b in (1, 2)} | \
        {(i, 1, True) for i in ("float", "rtn-w8a16")}
    assert all(row.get("tpot_ms", 1) > 0 and row.get("ttft_ms", 1) > 0 for row in res["rows"])
    weights = {row["impl"]: row["weights_GB"] for row in res["rows"] if "tpot_ms" in row}
    assert 0 < weights["rtn-w8a16"] < weights["float"]  # int8 codes in the layer's linears
    state = {row["batch"]: row["state_GB"] for row in res["rows"] if row["impl"] == "float" and "tpot_ms" in row}
    assert state[2] == 2 * state[1] > 0  # read and written, per sequence
    assert "copy_bandwidth_GBps" not in res and not any("share" in row for row in res["rows"])  # CUDA only
    pytest.importorskip("matplotlib")
    assert (tmp_path / "latency.png").stat().st_size > 0


def test_state_bytes_is_one_sequences_states():
    from ssmq.bench.latency import state_bytes
    from tiny_ssm import tiny_model

    model = tiny_model("mamba2")
    c = model.config
    conv = (c.d_inner + 2 * c.ngroups * c.d_state) * (c.d_conv - 1)
    ssm = c.nheads * c.headdim * c.d_state
    assert state_bytes(model) == c.n_layer * (conv + ssm) * 4  # float32 states of a float32 model


def test_weight_bytes_counts_each_storage_once():
    from ssmq.bench.latency import weight_bytes

    m = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(8, 4))
    m[1].weight = m[0].weight  # tied: one storage
    m.register_buffer("codes", torch.zeros(10, dtype=torch.int8))
    assert weight_bytes(m) == 4 * 8 * 4 + 4 * 4 + 4 * 4 + 10


def test_profile_accounts_for_each_step_once():
    """The profile's rows per step: the listed ones sum to 'kernels (sum)', which with 'between kernels' is the
    profiled step's time that every share is of; the step's matrix products appear once a step for each linear layer (aten::mm on the CPU)."""
    from ssmq.bench.latency import tpot_ms
    from ssmq.bench.models import build

    model, _ = build("mamba2-130m", "float", torch.device("cpu"), torch.float32, layers=1)
    ms, rows = tpot_ms(model, 2, steps=3, warmup=1, reps=2, profile=True)
    by = {r["kernel"]: r for r in rows}
    listed = [r for r in rows if r["kernel"] not in ("kernels (sum)", "between kernels")]
    assert sum(r["us"] for r in listed) == pytest.approx(by["kernels (sum)"]["us"])
    step_us = by["kernels (sum)"]["us"] + by["between kernels"]["us"]  # the profiled step's own timing
    assert step_us > 0 and ms > 0
    assert all(r["us"] / r["share"] == pytest.approx(step_us) for r in rows)
    mm = [r for r in listed if r["kernel"] in ("aten::mm", "aten::addmm")]
    assert mm and sum(r["calls"] for r in mm) == pytest.approx(len([m for m in model.modules()
                                                                     if isinstance(m, torch.nn.Linear)]))


def test_prefill_profile_shares_out_the_prefill_and_runs_each_scan_once():
    """--profile on the prefill: the listed rows sum to 'kernels (sum)', shares are of the profiled prefill's time,
    and each call runs the prompt from an empty slot (one linear product per linear layer per call, not more)."""
    from ssmq.bench.latency import ttft_ms
    from ssmq.bench.models import build

    model, _ = build("mamba2-130m", "float", torch.device("cpu"), torch.float32, layers=2)
    ms, rows = ttft_ms(model, 24, warmup=1, reps=2, profile=True)
    by = {r["kernel"]: r for r in rows}
    listed = [r for r in rows if r["kernel"] not in ("kernels (sum)", "between kernels")]
    assert ms > 0 and sum(r["us"] for r in listed) == pytest.approx(by["kernels (sum)"]["us"])
    step_us = by["kernels (sum)"]["us"] + by["between kernels"]["us"]
    assert all(r["us"] / r["share"] == pytest.approx(step_us) for r in rows)
    mm = [r for r in listed if r["kernel"] in ("aten::mm", "aten::addmm")]
    assert mm and sum(r["calls"] for r in mm) == pytest.approx(len([m for m in model.modules()
                                                                     if isinstance(m, torch.nn.Linear)]))


def test_results_name_the_commit_and_whether_the_tree_differs_from_it(tmp_path):
    from ssmq.bench.output import _commit

    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git[:3] + ["init", "-q"], check=True)
    (tmp_path / "a.py").write_text("x = 1\n")
    subprocess.run(git + ["add", "a.py"], check=True)
    subprocess.run(git + ["commit", "-qm", "a"], check=True)
    head = subprocess.run(git[:3] + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert _commit(tmp_path) == head
    (tmp_path / "untracked.txt").write_text("results\n")  # untracked files are not the measured code
    assert _commit(tmp_path) == head
    (tmp_path / "a.py").write_text("x = 2\n")
    assert _commit(tmp_path) == head + "-dirty"
    assert _commit(tmp_path / "no-repo") is None


def test_throughput_counts_every_generated_token(tmp_path):
    r = run("throughput", "--layers", "1", "--num-prompts", "3", "--input-len", "4", "--output-len", "3",
            "--max-batch", "2", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    row = json.loads((tmp_path / "throughput.json").read_text())["rows"][0]
    assert row["requests"] == 3
    assert row["output_tok_s"] * row["seconds"] == pytest.approx(9)  # 3 prompts x 3 tokens, no early stop


def test_bad_arguments_are_one_line_errors():
    r = run("latency", "--layers", "1", "--recipes", "no-such-recipe", "--batch-size", "1", "--steps", "1")
    assert r.returncode == 1 and r.stderr.startswith("ssmq: error:") and r.stderr.count("\n") == 1, r.stderr
    r = run("kernels", "--only", "nope")
    assert r.returncode == 1 and "unknown kernel benchmark 'nope'" in r.stderr
    r = run("latency", "--batch-size", "0")
    assert r.returncode == 2 and "positive integers" in r.stderr


def test_kernel_registry_cases_agree_with_their_baselines():
    """Each case's implementations compute the same thing (float32, CPU): the registry times like with like."""
    from ssmq.bench.models import published_config

    ctx = kb.KernelContext(torch.device("cpu"), torch.float32, published_config("mamba2-130m"), rows=(2,))
    for case in kb.KERNEL_BENCHES["linear"].fn(ctx):  # (the state update writes its state in place)
        a, b = (fn() for fn in case.fns.values())
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="twice"):
        kb.register("linear", "again")(lambda ctx: [])


def test_moe_kernel_bench_times_each_expert_format():
    """The moe cases run the grouped experts at the model's MoE shape in every format (the reference on the CPU);
    a shape without MoE blocks is refused in one line."""
    from ssmq.bench.models import published_config
    from ssmq.errors import SSMQError

    ctx = kb.KernelContext(torch.device("cpu"), torch.float32, published_config("granite-4.0-h-tiny"), rows=(1,))
    cases = kb.KERNEL_BENCHES["moe"].fn(ctx)
    assert [c.label.split()[-3].rstrip(",") for c in cases] == ["float", "w8a16", "w4a16-g128", "fp8-w8a8"]
    for case in cases:
        out = case.fns["ssmq"]()
        assert out.shape == (1, 1536) and torch.isfinite(out).all() and case.nbytes > 0
    ctx = kb.KernelContext(torch.device("cpu"), torch.float32, published_config("mamba2-130m"), rows=(1,))
    with pytest.raises(SSMQError, match="has none"):
        kb.KERNEL_BENCHES["moe"].fn(ctx)


def test_kernels_writes_one_row_per_implementation(tmp_path):
    r = run("kernels", "--only", "linear,state-update", "--shape", "mamba2-130m", "--rows", "1", "--warmup", "0",
            "--reps", "1", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    rows = json.loads((tmp_path / "kernels.json").read_text())["rows"]
    assert {(row["bench"], row["impl"]) for row in rows} == {("linear", "ssmq"), ("linear", "torch"),
                                                              ("state-update", "ssmq"), ("state-update", "reference")}
    assert len(rows) == 3 * 2 + 3 * 2  # three linears and three state formats at one row count, two impls each
    assert all("us" in row for row in rows), [row.get("error") for row in rows]


class _StubServer(BaseHTTPRequestHandler):
    """An OpenAI-style server that streams ``max_tokens`` one-token chunks."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        body = json.dumps({"data": [{"id": "stub"}]}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["content-length"])))
        assert req["stream"] and req["ignore_eos"] and req["model"] == "stub"
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        for i in range(req["max_tokens"]):
            self.wfile.write(f"data: {json.dumps({'choices': [{'text': f' t{i}'}]})}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")


def test_serve_load_against_a_server(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StubServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        r = run("serve", "--url", url, "--concurrency", "1,3", "--num-prompts", "5", "--input-len", "4",
                "--output-len", "6", "--out", str(tmp_path))
    finally:
        server.shutdown()
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "serve.json").read_text())
    assert res["served_model"] == "stub"
    assert [(row["concurrency"], row["requests"], row["failed"]) for row in res["rows"]] == [(1, 5, 0), (3, 5, 0)]
    assert all(row["output_tok_s"] > 0 and row["tpot_ms_p50"] is not None for row in res["rows"])
    assert not any("engine_steps" in row for row in res["rows"])  # not an ssmq server: no engine counts


def test_serve_a_model_here_reports_the_share_of_the_decode_step_bound(tmp_path):
    """--model: the model served here (the engine in a thread of this process, then in a process of its own), the
    clients in a child; each level's row carries the decode step timed at its batch, the bound (batch / step) and
    the measured throughput's share of it."""
    pytest.importorskip("fastapi", reason="ssmq serve needs fastapi")
    r = run("serve", "--model", "mamba2-130m", "--layers", "1", "--recipes", "float", "--concurrency", "1,2",
            "--num-prompts", "3", "--input-len", "5", "--output-len", "4", "--prefill-chunk", "4", "--steps", "2",
            "--warmup", "1", "--reps", "1", "--engine", "process,thread", "--quiet", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "serve.json").read_text())
    assert res["model"] == "mamba2-130m" and res["gpu"].startswith("CPU") and res["prefill_chunk"] == 4
    assert [(row["recipe"], row["engine"], row["concurrency"], row["requests"], row["failed"])
            for row in res["rows"]] == [("float", e, c, 3, 0) for e in ("thread", "process") for c in (1, 2)]
    for row in res["rows"]:
        assert row["step_ms"] > 0 and row["bound_tok_s"] == pytest.approx(row["concurrency"] / row["step_ms"] * 1e3)
        assert row["bound_share"] == pytest.approx(row["output_tok_s"] / row["bound_tok_s"])
        # the work bound adds each client's prompt at the batched prefill rate to the decode steps: lower
        c, step, pre = row["concurrency"], row["step_ms"], row["prefill_ms_per_prompt"]
        assert pre > 0 and row["work_bound_tok_s"] == pytest.approx(c * 4 / (c * pre + 4 * step) * 1e3)
        assert row["work_bound_tok_s"] < row["bound_tok_s"] and row["work_share"] > row["bound_share"]
        # ignore_eos: every request gives its 4 tokens (from the usage the server reports)
        assert row["output_tok_s"] * row["seconds"] == pytest.approx(3 * 4)
        # the engine's own counts over the level (/health): 3 prompts of 5 tokens in chunks of 4 + 1, 4 tokens each
        assert row["prefill_forwards"] * row["rows_per_prefill"] == pytest.approx(3 * 2)
        assert row["engine_steps"] >= 2 + 3
        # the engine thread's time: prefill inside its steps, both inside the level's wall time
        assert 0 <= row["prefill_ms"] <= row["engine_busy_ms"] <= row["seconds"] * 1e3 + 50
        assert 0 <= row["prefill_share"] and row["prefill_share"] + row["idle_share"] <= 1 + 1e-9
    assert "bound_share" in r.stdout


def test_serve_without_a_server_is_one_line():
    r = run("serve", "--url", "http://127.0.0.1:9")
    assert r.returncode == 1 and "no OpenAI-compatible server answers" in r.stderr and r.stderr.count("\n") == 1


def test_accuracy_float_row_is_the_baseline(tmp_path):
    from conftest import shared_or_skip

    shared_or_skip("models", "mamba2")
    text = tmp_path / "t.txt"
    text.write_text("The song was released as a single in 2008 . " * 40)
    r = run("accuracy", "--recipes", "float,rtn-w8a16", "--text", str(text), "--seqlen", "64", "--limit", "2",
            "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    rows = json.loads((tmp_path / "accuracy.json").read_text())["rows"]
    assert [row["recipe"] for row in rows] == ["float", "rtn-w8a16"] and rows[0]["delta_pct"] == 0
    assert abs(rows[1]["delta_pct"]) < 5  # int8 weights barely move perplexity


def test_accuracy_decode_path_scores_the_same_windows_token_by_token(tmp_path):
    """--paths forward,decode: a row per recipe and path; in float32 the decode path (model.step over the cache)
    predicts the windows as the forward does, so their perplexities agree; a quantized state format moves only the
    decode path's."""
    from conftest import shared_or_skip

    shared_or_skip("models", "mamba2")
    text = tmp_path / "t.txt"
    text.write_text("The song was released as a single in 2008 . It reached number one in the charts . " * 30)
    r = run("accuracy", "--recipes", "float,int8-state", "--paths", "forward,decode", "--text", str(text),
            "--seqlen", "48", "--limit", "2", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    rows = {(row["recipe"], row["path"]): row for row in json.loads((tmp_path / "accuracy.json").read_text())["rows"]}
    assert set(rows) == {(a, b) for a in ("float", "int8-state") for b in ("forward", "decode")}
    assert rows["float", "decode"]["ppl"] == pytest.approx(rows["float", "forward"]["ppl"], rel=1e-4)
    assert rows["int8-state", "forward"]["ppl"] == pytest.approx(rows["float", "forward"]["ppl"], rel=1e-6)
    assert rows["int8-state", "decode"]["ppl"] != rows["float", "decode"]["ppl"]
    assert rows["float", "decode"]["delta_pct"] == 0 and rows["float", "decode"]["windows"] == 2


@pytest.mark.parametrize("argv,msg", [
    (["--against-reference", "--device", "cpu"], "--against-reference compares the GPU kernels"),
    (["--paths", "forward,prefill"], "--paths: prefill is not a path"),
])
def test_accuracy_bad_options_are_one_line(argv, msg):
    r = run("accuracy", "--recipes", "float", *argv)
    assert r.returncode == 1 and msg in r.stderr and r.stderr.count("\n") == 1


def _param_count(model) -> int:
    """Values of the model's parameters and persistent buffers, each tensor once (a router's bias is either, by
    implementation; tied embeddings are one tensor)."""
    return sum(t.numel() for t in {id(t): t for t in model.state_dict(keep_vars=True).values()}.values())


@pytest.mark.parametrize("name", ["falcon-mamba-7b", "nemotron-h-8b", "nemotron-3-nano-30b-a3b", "granite-4.0-h-tiny",
                                  "granite-4.0-h-1b", "jamba-mini", "zamba2-7b", "falcon-h1-7b"])
def test_transformers_peer_is_the_same_architecture(name):
    """The peer's model, built by transformers from the config.json fields ssmq's config is read from, has the
    parameters of ssmq's model of that config, count for count (both on the meta device)."""
    pytest.importorskip("transformers")
    from ssmq.bench.models import transformers_model
    from ssmq.models.lm import SSMLM
    from ssmq.models.published import PUBLISHED

    peer = transformers_model(name, torch.device("meta"), torch.float16)
    with torch.device("meta"):
        ours = SSMLM(PUBLISHED[name])
    assert _param_count(peer) == _param_count(ours)
    assert transformers_model("mamba2-2.7b", torch.device("meta"), torch.float16) is None  # mamba_ssm's, not a family


def test_transformers_peer_rows(monkeypatch):
    """The peer's TTFT and TPOT rows for a tiny Granite-4.0-H (MoE, attention and Mamba-2 layers) on the CPU."""
    pytest.importorskip("transformers")
    from ssmq.bench import latency
    from ssmq.models import published

    tiny = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 32, "shared_intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2,
            "vocab_size": 128, "tie_word_embeddings": True, "mamba_d_state": 16, "mamba_n_groups": 1,
            "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_expand": 2, "mamba_chunk_size": 16,
            "position_embedding_type": "nope", "layer_types": ["mamba", "attention"]}
    monkeypatch.setitem(published.PUBLISHED_HF, "tiny-granite", ("granitemoehybrid", tiny))
    rows, short = latency.transformers_rows("tiny-granite", torch.device("cpu"), torch.float32, [8], [1, 2], 2, 0, 1)
    assert short == []
    assert [(r["impl"], r["batch"], "ttft_ms" in r) for r in rows] == \
        [("transformers", 1, True), ("transformers", 1, False), ("transformers", 2, False)]
    assert all(r.get("ttft_ms", 1) > 0 for r in rows) and all(r["tok_s"] == r["batch"] / r["tpot_ms"] * 1e3
                                                               for r in rows if "tpot_ms" in r)


def test_transformers_peer_out_of_memory_leaves_the_other_measurements(monkeypatch):
    pytest.importorskip("transformers")
    from ssmq.bench import latency
    from ssmq.models import published

    tiny = {"hidden_size": 32, "num_hidden_layers": 1, "intermediate_size": 64, "vocab_size": 64, "state_size": 8,
            "conv_kernel": 4, "time_step_rank": 4, "expand": 2}
    monkeypatch.setitem(published.PUBLISHED_HF, "tiny-falcon-mamba", ("falcon_mamba", tiny))
    real, calls = latency.time_fn, []

    def prefill_out_of_memory(fn, *args, **kwargs):
        calls.append(fn)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 96.00 GiB. GPU 0 has ...")
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(latency, "time_fn", prefill_out_of_memory)
    rows, short = latency.transformers_rows("tiny-falcon-mamba", torch.device("cpu"), torch.float32, [8], [1], 2, 0, 1)
    assert short == ["TTFT at 8 tokens: out of memory (asked for 96.00 GiB)"]
    assert [(r["batch"], "tpot_ms" in r) for r in rows] == [(1, True)]


@pytest.mark.gpu
def test_graph_us_is_the_time_of_one_call():
    """graph_us: per call of the callables it replays (two copies time as one), and the GPU time CUDA events give an
    eager call of the same copy."""
    if not torch.cuda.is_available():
        pytest.skip("graph timing needs CUDA")
    from ssmq.bench.timing import copy_bandwidth, graph_us

    dev = torch.device("cuda")
    a = torch.empty(1 << 29, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)

    def copy():
        b.copy_(a)

    one = graph_us([copy])
    assert graph_us([copy, copy]) == pytest.approx(one, rel=0.15)
    assert time_fn(copy, dev, warmup=2, reps=10).median_ms * 1e3 == pytest.approx(one, rel=0.3)
    assert copy_bandwidth(dev) > 0
