"""``ssmq bench serve``: load against an OpenAI-compatible server, and the share of the decode-step bound it reaches.

At each ``--concurrency`` level, that many closed-loop clients send streaming ``/v1/completions`` requests of
``--input-len`` random token ids for ``--output-len`` tokens (``ignore_eos``) until ``--num-prompts`` requests are
done: throughput (output tokens/s), TTFT and TPOT percentiles. The clients are the standard library's (threads,
urllib).

Against ``--url``: a running server (``ssmq serve``, or any other). With ``--model``: for each of ``--recipes``, the
model is built here, its decode step timed at each level's batch (``bench latency``'s timing: CUDA graphs on a
GPU), then served here (``ssmq serve``'s engine and server; ``--engine``: the engine in a process of its own, as
``ssmq serve`` runs it, or in a thread of the server's process) to clients in a child process (so they do not take
the server's interpreter lock). The decode-step bound of a level is its batch over the step's
time: the tokens/s the engine would give if every step were a decode step of every client and the host cost
nothing; ``bound_share`` is the output tokens/s measured over it. Against an ssmq server each level also reports
where its wall time went on the engine thread (``/health``'s tallies): ``prefill_share`` in steps' prefill forwards
(each waits for its first tokens, so on a GPU it holds the forward's device time) and ``idle_share`` outside any step
(waiting for requests: the HTTP side's intake and the clients).
"""

from __future__ import annotations

import functools
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch
from tqdm import tqdm

from ssmq.bench.output import lines_plot, record, table, write
from ssmq.errors import SSMQError
from ssmq.runtime.engine import TALLIES


def stream_request(url: str, body: dict, timeout: float) -> dict | None:
    """One streaming completion: {start, first, end, chunks, tokens} (perf_counter seconds; tokens: the usage the
    server reports, else the chunks with text), or None when it failed."""
    data = json.dumps(body).encode()
    req = urllib.request.Request(url.rstrip("/") + "/v1/completions", data=data,
                                 headers={"content-type": "application/json"})
    start = time.perf_counter()
    first = end = tokens = None
    chunks = 0
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return None if first is None else {"start": start, "first": first, "end": end, "chunks": chunks,
                                                   "tokens": tokens or chunks}
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"].get("completion_tokens")
            choices = chunk.get("choices") or []
            if choices and choices[0].get("text"):
                end = time.perf_counter()
                first = first or end
                chunks += 1
    return None


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


def engine_tallies(url: str) -> dict:
    """The engine's step and prefill counts from an ssmq server's ``/health`` ({} from another server)."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=10) as resp:
            health = json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError):
        return {}
    tallies = {k: health.get(k) for k in TALLIES}
    return tallies if all(isinstance(v, int) for v in tallies.values()) else {}


def run_level(url: str, concurrency: int, n_requests: int, body_of, timeout: float, bar=None) -> dict:
    """``concurrency`` closed-loop clients sharing ``n_requests`` requests; on an ssmq server, also the engine steps
    and prompt forwards (and their mean rows) the level took."""
    before = engine_tallies(url)
    budget = [n_requests]
    lock = threading.Lock()
    records, errors = [], []

    def client(i: int):
        while True:
            with lock:
                if budget[0] <= 0:
                    return
                budget[0] -= 1
                n = budget[0]
            try:
                rec = stream_request(url, body_of(i * 1000003 + n), timeout)
            except (urllib.error.URLError, OSError, ValueError) as e:
                rec, msg = None, str(e)
                errors.append(msg)
            with lock:
                if rec is not None:
                    records.append(rec)
                if bar is not None:
                    bar.update()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    row = {"concurrency": concurrency, "requests": len(records), "failed": n_requests - len(records)}
    after = engine_tallies(url)
    if before and after:
        d = {k: after[k] - before[k] for k in TALLIES}
        row.update(engine_steps=d["steps"], prefill_forwards=d["prefill_forwards"],
                   rows_per_prefill=d["prefill_rows"] / d["prefill_forwards"] if d["prefill_forwards"] else None,
                   engine_busy_ms=d["busy_ms"], prefill_ms=d["prefill_ms"])
    if errors:
        row["first_error"] = errors[0][:200]
    if not records:
        return row
    seconds = max(r["end"] for r in records) - min(r["start"] for r in records)
    out_tokens = sum(r["tokens"] for r in records)
    ttft = [(r["first"] - r["start"]) * 1e3 for r in records]
    # the last token's arrival: a stream behind the engine carries several tokens in a chunk
    tpot = [(r["end"] - r["first"]) * 1e3 / (r["tokens"] - 1) for r in records if r["tokens"] > 1]
    if "engine_busy_ms" in row and seconds > 0:  # where the level's wall time went on the engine thread
        row.update(prefill_share=row["prefill_ms"] / 1e3 / seconds,
                   idle_share=max(0.0, 1 - row["engine_busy_ms"] / 1e3 / seconds))
    row.update({"seconds": seconds, "output_tok_s": out_tokens / seconds if seconds > 0 else None,
                "ttft_ms_p50": percentile(ttft, 50), "ttft_ms_p99": percentile(ttft, 99),
                "tpot_ms_p50": percentile(tpot, 50), "tpot_ms_p99": percentile(tpot, 99)})
    return row


LOAD_COLUMNS = ["concurrency", "requests", "failed", "output_tok_s", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50",
                "tpot_ms_p99", "engine_steps", "prefill_forwards", "rows_per_prefill", "prefill_share", "idle_share"]
BOUND_COLUMNS = ["recipe", "engine", "concurrency", "requests", "failed", "step_ms", "bound_tok_s", "output_tok_s",
                 "bound_share", "work_bound_tok_s", "work_share", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50",
                 "tpot_ms_p99", "tpot_over_step", "engine_steps", "prefill_forwards", "rows_per_prefill",
                 "prefill_share", "idle_share"]


def run(args) -> dict:
    if getattr(args, "model", None):
        return run_model(args)
    url = args.url.rstrip("/")
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=10) as resp:
            models = json.loads(resp.read()).get("data") or []
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise SSMQError(f"no OpenAI-compatible server answers at {url} ({e}); start one with `ssmq serve`") from None
    served = args.served_model or (models[0]["id"] if models else None)
    result = record("serve", torch.device("cpu"), url=url, served_model=served, input_len=args.input_len,
                    output_len=args.output_len)
    result["gpu"] = "the server's (see its --device)"

    def body_of(seed: int) -> dict:
        rng = random.Random(seed)
        return {"model": served, "prompt": [rng.randrange(1, args.vocab_limit) for _ in range(args.input_len)],
                "max_tokens": args.output_len, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}

    for c in args.concurrency:
        n = args.num_prompts or 2 * c
        with tqdm(total=n, desc=f"serve {c} clients", unit="req", disable=args.quiet) as bar:
            result["rows"].append(run_level(url, c, n, body_of, args.timeout, bar))
    return _report(result, LOAD_COLUMNS, args.out, f"every request to {url} failed")


class IdTokenizer:
    """The server's tokenizer for a model without one (random weights): token i is the text " i"."""

    def __init__(self, vocab: int):
        self.vocab, self.eos_id = vocab, 0

    def encode(self, text: str) -> list[int]:
        return [int(t) % self.vocab for t in text.split() if t.isdigit()]

    def decode(self, ids: list[int]) -> str:
        return "".join(f" {i}" for i in ids)

    def __len__(self) -> int:
        return self.vocab


def load_in_child(url: str, args, out: str) -> list[dict]:
    """The load levels of ``args`` against ``url``, run by ``ssmq bench serve --url`` in a child process."""
    cmd = [sys.executable, "-m", "ssmq", "bench", "serve", "--url", url, "--quiet", "--out", out,
           "--concurrency", ",".join(map(str, args.concurrency)), "--input-len", str(args.input_len),
           "--output-len", str(args.output_len), "--vocab-limit", str(args.vocab_limit),
           "--timeout", str(args.timeout)]
    if args.num_prompts:
        cmd += ["--num-prompts", str(args.num_prompts)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SSMQError(f"the load generator failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads((Path(out) / "serve.json").read_text())["rows"]


ENGINES = ("thread", "process")  # --engine values, in the order they run


def engine_model(cfg, model_name: str, recipe: str, device: str, dtype, layers, gptq_as_rtn: bool):
    """The engine process's model under ``--engine process`` (``ProcessEngine``'s ``load``)."""
    from ssmq.bench.models import build

    return build(model_name, recipe, torch.device(device), dtype, layers, gptq_as_rtn)[0]


@torch.inference_mode()
def prefill_ms_per_prompt(model, prompt_len: int, rows: int, warmup: int, reps: int) -> float:
    """The GPU time one prompt's prefill costs at its best batched rate: ``rows`` prompts of ``prompt_len`` tokens
    in one eager forward from empty slots (as many as the engine's per-forward token budget and batch allow), over
    ``rows``, ms."""
    from ssmq.bench.timing import time_fn

    dev = model.device
    ids = torch.randint(0, min(model.config.vocab_size, 50000), (rows, prompt_len), device=dev)
    cache = model.allocate_cache(rows, prompt_len + 1)
    slots = torch.arange(rows, device=dev)
    return time_fn(lambda: model(ids, cache, slots, num_last_tokens=1), dev, warmup, reps,
                   setup=cache.reset).median_ms / rows


def work_bound(clients: int, step_ms: float, prefill_ms: float, output_len: int) -> float:
    """Output tokens/s if the GPU did nothing but the work: each client's prompt prefilled at the best batched rate
    (``prefill_ms`` a prompt) and ``output_len`` decode steps of the whole batch (``step_ms`` each), no host cost."""
    return clients * output_len / (clients * prefill_ms + output_len * step_ms) * 1e3


def run_model(args) -> dict:
    """Serve ``--model`` here under each recipe: the load levels beside the decode step's bound at each batch."""
    from ssmq.bench.latency import _free, tpot_ms
    from ssmq.bench.models import build, device_and_dtype
    from ssmq.runtime.engine import Engine, EngineConfig
    from ssmq.runtime.engine_proc import ProcessEngine
    from ssmq.runtime.server import BackgroundServer, ServerConfig

    device, dtype = device_and_dtype(args.device, args.dtype)
    result = record("serve", device, model=args.model, dtype=str(dtype).removeprefix("torch."),
                    input_len=args.input_len, output_len=args.output_len, prefill_chunk=args.prefill_chunk,
                    prefill_tokens=args.prefill_tokens, graph_prefill_tokens=args.graph_prefill_tokens,
                    graph_prefill_pieces=args.graph_prefill_pieces,
                    engine=args.engine)
    for recipe in args.recipes:
        _free(device)
        model, vocab = build(args.model, recipe, device, dtype, args.layers, args.gptq_as_rtn)
        args.vocab_limit = min(args.vocab_limit, vocab)
        steps = {c: tpot_ms(model, c, args.steps, args.warmup, args.reps) for c in args.concurrency}
        # as many prompts in one forward as the engine may batch
        prefill_rows = max(1, min(max(args.concurrency), args.prefill_tokens // args.input_len))
        prefill = prefill_ms_per_prompt(model, args.input_len, prefill_rows, args.warmup, args.reps)
        _free(device)
        batch, length = max(args.concurrency), args.input_len + args.output_len + 1
        # hybrids: KV blocks for every client at once, so admission never waits on the pool (the bound does not)
        blocks = batch * -(-length // EngineConfig.kv_block_size)
        cfg = EngineConfig(max_batch=batch, max_model_len=length, prefill_chunk=args.prefill_chunk,
                           prefill_tokens=args.prefill_tokens, graph_prefill_tokens=args.graph_prefill_tokens,
                           graph_prefill_pieces=args.graph_prefill_pieces, kv_blocks=blocks)
        # the thread engine serves the model built here; the engine process builds its own, so it goes last, after
        # this one has left the device
        for kind in sorted(set(args.engine), key=ENGINES.index):
            if kind == "process":
                model = None
                _free(device)
                load = functools.partial(engine_model, model_name=args.model, recipe=recipe, device=str(device),
                                         dtype=dtype, layers=args.layers, gptq_as_rtn=args.gptq_as_rtn)
                engine = ProcessEngine(load, cfg, log_level="warning").start()
            else:
                engine = Engine(model, cfg)
            server = BackgroundServer(engine, IdTokenizer(vocab),
                                      ServerConfig((recipe,), request_timeout_s=args.timeout))
            with server as url, tempfile.TemporaryDirectory() as out:
                rows = load_in_child(url, args, out)
            for row in rows:
                step = steps[row["concurrency"]]
                bound = row["concurrency"] / step * 1e3
                work = work_bound(row["concurrency"], step, prefill, args.output_len)
                tok_s, tpot = row.get("output_tok_s"), row.get("tpot_ms_p50")
                result["rows"].append({"recipe": recipe, "engine": kind, **row, "step_ms": step,
                                       "bound_tok_s": bound, "bound_share": None if tok_s is None else tok_s / bound,
                                       "prefill_ms_per_prompt": prefill, "work_bound_tok_s": work,
                                       "work_share": None if tok_s is None else tok_s / work,
                                       "tpot_over_step": None if tpot is None else tpot / step})
            del engine, server
        del model
    return _report(result, BOUND_COLUMNS, args.out, "every request failed")


def _report(result: dict, columns, out, failed: str) -> dict:
    """Print the table and write the JSON + PNG; a run where no request got through is an error, not a result."""
    print(table(result["rows"], columns))
    for path in write(result, out, plot=_plot):
        print(f"wrote {path}")
    if all(r["requests"] == 0 for r in result["rows"]):
        raise SSMQError(f"{failed}: {result['rows'][0].get('first_error', 'no tokens')}")
    return result


def _plot(pyplot, result):
    rows = [{**r, "series": "".join(f"{r[k]} " for k in ("recipe", "engine") if k in r)} for r in result["rows"]
            if r.get("output_tok_s")]
    rows = [{**r, "series": r["series"] + "output tok/s"} for r in rows] + [
        {**r, "series": r["series"] + "decode-step bound", "output_tok_s": r["bound_tok_s"]} for r in rows
        if r.get("bound_tok_s")]
    return lines_plot(pyplot, {**result, "rows": rows}, "concurrency", "output_tok_s", "series", "clients",
                      "output tokens/s")
