"""One client on the serving engine (no HTTP) against the decode step it runs: the time between the tokens it reports,
with a step's tokens read back after that step alone (the engine's way) and after the device's whole queue.

    python benchmarks/engine_readback.py --model mamba2-2.7b --out FILE

Under overlap the engine launches decode step n, then reads step n - 1's tokens back. Read as a device tensor
(``.tolist()``), they wait for the whole queue, i.e. for step n too, and the device then idles while the host reports
them and launches step n + 1; copied to pinned memory with an event after the copy (``_Sampled.send_to_host``), the
read waits for step n - 1 alone. One request of ``--input-len`` prompt tokens and ``--tokens`` greedy tokens a run,
runs alternating new, whole queue, new in one process; the step is timed as ``ssmq bench latency`` times it.
Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch

from ssmq.bench.latency import tpot_ms
from ssmq.bench.models import build
from ssmq.runtime import engine as engine_mod
from ssmq.runtime.engine import Engine, EngineConfig, Request
from ssmq.runtime.sampling import SamplingParams


def token_period_ms(engine: Engine, prompt: list[int], tokens: int, vocab: int) -> tuple[float, float]:
    """(p50, mean) ms between consecutive tokens of one request, the first two intervals left out."""
    times, done = [], threading.Event()

    def emit(ev):
        if ev.kind == "token":
            times.append(time.perf_counter())
        elif ev.kind in ("done", "error"):
            done.set()

    engine.submit(Request(prompt, SamplingParams(stop_at_eos=False, vocab_limit=vocab), tokens, emit))
    done.wait()
    gaps = [b - a for a, b in zip(times[1:], times[2:])]
    return statistics.median(gaps) * 1e3, statistics.fmean(gaps) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mamba2-2.7b")
    ap.add_argument("--recipe", default="float")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("engine_readback: needs a CUDA GPU")
    dev = torch.device("cuda")
    model, vocab = build(args.model, args.recipe, dev, torch.float16)
    step = tpot_ms(model, 1, 32, 2, 5)
    engine = Engine(model, EngineConfig(max_batch=1, max_model_len=args.input_len + args.tokens + 1)).start()
    prompt = list(range(100, 100 + args.input_len))
    token_period_ms(engine, prompt, 32, vocab)  # warm-up
    runs = []
    new = engine_mod._Sampled.send_to_host
    for kind in ("step alone", "whole queue", "step alone"):
        # without the host copy, on_host reads the device tensor: a wait for the whole queue
        engine_mod._Sampled.send_to_host = new if kind == "step alone" else (lambda self: None)
        p50, mean = token_period_ms(engine, prompt, args.tokens, vocab)
        runs.append({"read_back": kind, "period_p50_ms": p50, "period_mean_ms": mean, "over_step": p50 / step})
        print(f"{kind:12s} step {step:.3f} ms  period p50 {p50:.3f} mean {mean:.3f}  {p50 / step:.3f}x")
    engine_mod._Sampled.send_to_host = new
    engine.shutdown()
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "model": args.model,
                       "recipe": args.recipe, "step_ms": step, "runs": runs}, fh, indent=1)


if __name__ == "__main__":
    main()
