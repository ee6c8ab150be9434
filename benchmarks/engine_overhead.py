"""Host time of one engine step (a turn of its loop), model excluded: scheduling, sampling, hand-off.

    python benchmarks/engine_overhead.py --batch 1,16,64 [--profile]

A stub runner answers every model call at once with fixed logits, so what is timed is what the engine thread
spends around the model: on a GPU this is the time a decode step adds to the CUDA-graph replay. Each request
reports through the server's own emitter into an asyncio loop in another thread, as under ``ssmq serve``.
Also counts, per decode step, the calls that would be a host <-> device transfer (and so a sync) on a GPU:
``.tolist()``, ``.item()``, ``.cpu()`` and tensors built from Python data.

    python benchmarks/engine_overhead.py --serve 1:3,16:5.4,64:8

serves the stub over HTTP, its decode sleeping the given ms (the GIL free, as in a CUDA sync), to C streaming
clients: throughput and TPOT against the C / step and step a model of that speed would allow, on a CPU-only host.
The stub runs on the CPU, so the engine hands events over as on CPU (at each step's end, not deferred as on CUDA).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import cProfile
import pstats
import statistics
import threading
import time

import torch
from torch.overrides import TorchFunctionMode

from ssmq.runtime.engine import Engine, EngineConfig, Request
from ssmq.runtime.metrics import ServerMetrics
from ssmq.runtime.sampling import SamplingParams
from ssmq.runtime.server import _emitter

TRANSFERS = {"tolist", "item", "cpu", "tensor", "as_tensor"}


class StubRunner:
    """Fixed logits for every call: the engine's own work is all that is left."""

    def __init__(self, max_batch: int, vocab: int, step_s: float = 0.0):
        g = torch.Generator().manual_seed(0)
        self.logits = torch.randn(max_batch, vocab, generator=g)
        self.device, self.kv_blocks = torch.device("cpu"), None
        self.step_s = step_s  # a decode step's GPU time to stand in for: slept, the GIL free as in a CUDA sync

    def reset(self, slot):
        pass

    def prefill(self, ids, slot, all_logits):
        return self.logits[:ids.shape[1]] if all_logits else self.logits[:1]

    def decode(self, tokens, slots):
        if self.step_s:
            time.sleep(self.step_s)
        return self.logits[:tokens.shape[0]]


class CountTransfers(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in TRANSFERS:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def measure(batch: int, vocab: int, steps: int, profile: bool) -> dict:
    engine = Engine(None, EngineConfig(max_batch=batch, max_model_len=10**6), metrics=ServerMetrics(),
                    runner=StubRunner(batch, vocab))
    loop = asyncio.new_event_loop()
    wakeups, call_soon_threadsafe = [0], loop.call_soon_threadsafe

    def counted(*a):  # each is a write to the loop's self-pipe
        wakeups[0] += 1
        return call_soon_threadsafe(*a)

    loop.call_soon_threadsafe = counted
    events: asyncio.Queue = asyncio.Queue()
    received = [0]

    async def drain():
        while True:
            await events.get()
            received[0] += 1

    loop.create_task(drain())
    threading.Thread(target=loop.run_forever, daemon=True).start()
    params = SamplingParams(stop_at_eos=False, vocab_limit=vocab - 16)
    for i in range(batch):
        emit, flush = _emitter(loop, events, i)
        engine.waiting.append(Request([1, 2, 3], params, max_tokens=10**6, emit=emit, flush=flush))
    with torch.inference_mode():
        for _ in range(6):  # the first prefills every prompt (and samples the first token)
            engine._tick([], set())
        with CountTransfers() as count:
            engine._tick([], set())
        prof = cProfile.Profile() if profile else None
        if prof:
            prof.enable()
        times, wakeups[0] = [], 0
        for _ in range(steps):
            t = time.perf_counter()
            engine._tick([], set())
            times.append(time.perf_counter() - t)
        # the median: the 2-core box is shared; the mean also holds the steps where the loop thread took the GIL
        dt, mean = statistics.median(times), statistics.mean(times)
        if prof:
            prof.disable()
            pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    loop.call_soon_threadsafe(loop.stop)
    return {"batch": batch, "us_per_step": round(dt * 1e6, 1), "us_per_row": round(dt * 1e6 / batch, 2),
            "us_per_step_mean": round(mean * 1e6, 1), "wakeups_per_step": wakeups[0] / steps,
            "transfers": dict(count.counts)}


def serve(clients: int, step_ms: float, vocab: int, requests: int, output_len: int) -> dict:
    """``ssmq serve`` (uvicorn, the engine) over the stub runner whose decode sleeps ``step_ms``, under the closed-loop
    streaming clients of bench_serve.py in another process: what the Python serving path leaves of C / step."""
    import multiprocessing as mp
    import types

    from bench_serve import IdTokenizer, _client_proc, pct

    from ssmq.runtime.server import BackgroundServer, ServerConfig

    model = types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=vocab))
    engine = Engine(model, EngineConfig(max_batch=clients, max_model_len=64 + output_len),
                    runner=StubRunner(clients, vocab, step_ms / 1e3))
    body = {"model": "bench", "prompt": list(range(1, 33)), "max_tokens": output_len, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with BackgroundServer(engine, IdTokenizer(vocab), ServerConfig(("bench",), request_timeout_s=None)) as url:
        with mp.get_context("spawn").Pool(1) as pool:
            recs = pool.starmap(_client_proc, [(url, clients, clients * requests, 120, body)])[0]
    wall = max(r["end"] for r in recs) - min(r["start"] for r in recs)
    tpot = sorted((r["end"] - r["first"]) / (output_len - 1) for r in recs)
    ttft = sorted(r["first"] - r["start"] for r in recs)
    return {"clients": clients, "step_ms": step_ms, "tok_s": round(len(recs) * output_len / wall),
            "ideal_tok_s": round(clients / step_ms * 1e3), "tpot_ms_p50": round(pct(tpot, 50) * 1e3, 2),
            "ttft_ms_p50": round(pct(ttft, 50) * 1e3, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", default="1,16,64")
    p.add_argument("--serve", help="clients:step_ms,... e.g. 1:3,16:5.4,64:8: serve the stub over HTTP instead")
    p.add_argument("--requests", type=int, default=4, help="--serve: requests per client")
    p.add_argument("--output-len", type=int, default=128, help="--serve: tokens per request")
    p.add_argument("--vocab", type=int, default=512, help="small: CPU tensor math stays negligible")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--profile", action="store_true", help="cProfile the timed steps")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.serve:
        for level in args.serve.split(","):
            c, ms = level.split(":")
            print(serve(int(c), float(ms), args.vocab, args.requests, args.output_len), flush=True)
        return
    for b in [int(x) for x in args.batch.split(",")]:
        print(measure(b, args.vocab, args.steps, args.profile), flush=True)


if __name__ == "__main__":
    main()
