"""Eager prefill: the time of one ``model(ids)`` forward (no CUDA graph: what evaluation and Python-API users run) per
recipe and prompt length, and how much of it the host's launches take.

    python benchmarks/eager_prefill.py --model mamba2-2.7b --recipes float,rtn-w4a16-g128,fp8-w8a8 --lengths 1024,8192

Random weights at the published config, float16, batch 1, on a CUDA GPU. ``wall_ms``: median of 15 forwards after 3
warm-ups, each synchronized; ``host_ms``: median of the same forwards' return on the host before synchronizing (the
launches alone). Where host_ms is close to wall_ms the host, not the GPU, sets the forward's time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from ssmq.bench.models import build
from ssmq.kernels.policy import set_policy
from ssmq.runtime.kernel_policy import policy_from_env


def time_forward(model, ids, reps: int = 15) -> tuple[float, float]:
    """(median wall ms, median host ms) of ``reps`` forwards of ``model(ids)`` after 3 warm-ups: wall up to the
    synchronize after each forward, host up to its return (the launches alone; the queue is empty at each start)."""
    walls, hosts = [], []
    with torch.inference_mode():
        for _ in range(3):
            model(ids)
        torch.cuda.synchronize()
        for _ in range(reps):
            t = time.perf_counter()
            model(ids)
            hosts.append(time.perf_counter() - t)
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - t)
    return statistics.median(walls) * 1e3, statistics.median(hosts) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mamba2-2.7b")
    ap.add_argument("--recipes", default="float,rtn-w4a16-g128,fp8-w8a8")
    ap.add_argument("--lengths", default="1024,8192")
    ap.add_argument("--out", default=None, help="JSON file for the rows")
    args = ap.parse_args()
    set_policy(policy_from_env())
    dev = torch.device("cuda")
    rows = []
    for recipe in args.recipes.split(","):
        model, vocab = build(args.model, recipe, dev, torch.float16, gptq_as_rtn=True)
        for n in map(int, args.lengths.split(",")):
            wall, host = time_forward(model, torch.randint(0, vocab, (1, n), device=dev))
            rows.append({"recipe": recipe, "tokens": n, "wall_ms": wall, "host_ms": host})
            print(f"{recipe:>16} {n:6d} tokens: {wall:8.2f} ms, host {host:8.2f} ms", flush=True)
        del model
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
