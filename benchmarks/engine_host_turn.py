"""Host time of one serving-engine turn, without a model: the engine's scheduling, sampling and reporting of a
decode step for a batch of rows, its runner stubbed (prefill and decode return logits of zeros at once), on the CPU.

    python benchmarks/engine_host_turn.py --rows 1,64,256 --out FILE

On a GPU the engine launches step n+1 before it reads step n back (``EngineConfig.overlap``), so this host time is
hidden while it stays under the device's step time; it is what a GPU server's turn costs beyond the model. Requests
of 3 prompt tokens and ``--tokens`` greedy tokens each (a vocabulary of 1000), all submitted before the engine
starts; the time a turn is the wall time over the engine's steps (prefill and admission included, once a request).
The engine runs in a thread of this process, as ``--engine thread`` (the engine process adds its pipe's pickling).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from types import SimpleNamespace

import torch

from ssmq.runtime.engine import Engine, EngineConfig, Request
from ssmq.runtime.sampling import SamplingParams

VOCAB = 1000


class StubRunner:
    """The runner interface of ``ssmq.runtime.engine.LocalRunner``, answering at once."""

    device, kv_blocks = torch.device("cpu"), None

    def reset(self, slots):
        pass

    def prefill(self, ids, slots, all_logits):
        return torch.zeros(ids.shape[0], VOCAB)

    def decode(self, tokens, slots):
        return torch.zeros(tokens.shape[0], VOCAB)


def turn_ms(rows: int, tokens: int) -> tuple[float, int]:
    model = SimpleNamespace(config=SimpleNamespace(vocab_size=VOCAB))
    engine = Engine(model, EngineConfig(max_batch=rows, max_model_len=tokens + 8), runner=StubRunner())
    done = threading.Semaphore(0)

    def emit(ev):
        if ev.kind in ("done", "error"):
            done.release()

    params = SamplingParams(max_new_tokens=tokens, stop_at_eos=False, vocab_limit=VOCAB)
    for _ in range(rows):
        engine.submit(Request([1, 2, 3], params, tokens, emit))
    start = time.perf_counter()
    engine.start()
    for _ in range(rows):
        done.acquire()
    wall = time.perf_counter() - start
    engine.shutdown()
    return wall / engine.steps * 1e3, engine.steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,64,256")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for b in map(int, args.rows.split(",")):
        runs = [turn_ms(b, args.tokens) for _ in range(args.runs)]
        ms = [r[0] for r in runs]
        rows.append({"rows": b, "steps": runs[0][1], "ms_a_turn": ms, "us_a_row": [m * 1e3 / b for m in ms]})
        print(f"{b} rows: {' / '.join(f'{m:.3f}' for m in ms)} ms a turn")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
