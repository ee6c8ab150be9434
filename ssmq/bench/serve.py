"""``ssmq bench serve``: load against a running OpenAI-compatible server (``ssmq serve``, or any other).

At each ``--concurrency`` level, that many closed-loop clients send streaming ``/v1/completions`` requests of
``--input-len`` random token ids for ``--output-len`` tokens (``ignore_eos``) until ``--num-prompts`` requests are
done: throughput (output tokens/s), TTFT and TPOT percentiles. Standard library only (threads, urllib)."""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.error
import urllib.request

import torch
from tqdm import tqdm

from ssmq.bench.output import lines_plot, record, table, write
from ssmq.errors import SSMQError


def stream_request(url: str, body: dict, timeout: float) -> dict | None:
    """One streaming completion: {start, first, end, chunks} (perf_counter seconds), or None when it failed."""
    data = json.dumps(body).encode()
    req = urllib.request.Request(url.rstrip("/") + "/v1/completions", data=data,
                                 headers={"content-type": "application/json"})
    start = time.perf_counter()
    first = end = None
    chunks = 0
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return None if first is None else {"start": start, "first": first, "end": end, "chunks": chunks}
            choices = json.loads(line[6:]).get("choices") or []
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


def run_level(url: str, concurrency: int, n_requests: int, body_of, timeout: float, bar=None) -> dict:
    """``concurrency`` closed-loop clients sharing ``n_requests`` requests."""
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
    if errors:
        row["first_error"] = errors[0][:200]
    if not records:
        return row
    seconds = max(r["end"] for r in records) - min(r["start"] for r in records)
    out_tokens = sum(r["chunks"] for r in records)
    ttft = [(r["first"] - r["start"]) * 1e3 for r in records]
    tpot = [(r["end"] - r["first"]) * 1e3 / (r["chunks"] - 1) for r in records if r["chunks"] > 1]
    row.update({"seconds": seconds, "output_tok_s": out_tokens / seconds if seconds > 0 else None,
                "ttft_ms_p50": percentile(ttft, 50), "ttft_ms_p99": percentile(ttft, 99),
                "tpot_ms_p50": percentile(tpot, 50), "tpot_ms_p99": percentile(tpot, 99)})
    return row


def run(args) -> dict:
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
                "max_tokens": args.output_len, "temperature": 0, "ignore_eos": True, "stream": True}

    for c in args.concurrency:
        n = args.num_prompts or 2 * c
        with tqdm(total=n, desc=f"serve {c} clients", unit="req") as bar:
            result["rows"].append(run_level(url, c, n, body_of, args.timeout, bar))
    print(table(result["rows"], ["concurrency", "requests", "failed", "output_tok_s", "ttft_ms_p50", "ttft_ms_p99",
                                 "tpot_ms_p50", "tpot_ms_p99"]))
    for path in write(result, args.out, plot=_plot):
        print(f"wrote {path}")
    if all(r["requests"] == 0 for r in result["rows"]):
        raise SSMQError(f"every request to {url} failed: {result['rows'][0].get('first_error', 'no tokens')}")
    return result


def _plot(pyplot, result):
    rows = [{**r, "series": "output tok/s"} for r in result["rows"] if r.get("output_tok_s")]
    return lines_plot(pyplot, {**result, "rows": rows}, "concurrency", "output_tok_s", "series", "clients",
                      "output tokens/s")
