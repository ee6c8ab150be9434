"""Serving prefill: the CUDA-graph prefill forward (what ``ssmq serve`` and ``ssmq generate`` replay) of ``rows``
prompts of ``length`` tokens each into cache slots, per rows x length, and optionally its kernel profile.

    python benchmarks/prefill_graph.py --model mamba2-2.7b --rows 1,2,4,8,16,32,64,128 --lengths 128 --out F.json

Random weights at the published config, float16, on a CUDA GPU. Each time is the median of 10 graph replays (CUDA
events) after 2 warm-ups, the rows' cache slots reset before each. ``--profile`` adds the torch-profiler kernel table
of one replay of the largest rows x the first length. ``--states split,fused`` times each of the SSD scan's state
paths (``configs/ssd.json``'s ``STATES``: chunk states and their passing as two kernels, or one, or by the chunks a
sequence spans), graphs captured afresh for each.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import ssmq.kernels.ssd as ssd
from ssmq.bench.models import build
from ssmq.bench.timing import time_fn
from ssmq.runtime.cuda_graph import CudaGraphPrefill


def profile_replay(graphs, cache, vocab: int, rows: int, length: int, dev) -> None:
    """Print the torch-profiler kernel table of one replay of rows x length (after one untimed replay)."""
    from torch.profiler import ProfilerActivity, profile

    ids = torch.randint(0, vocab, (rows, length), device=dev)
    slots = list(range(rows))
    cache.reset(slots)
    graphs(ids, slots, check_fit=False)
    torch.cuda.synchronize()
    cache.reset(slots)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graphs(ids, slots, check_fit=False)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=60))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mamba2-2.7b")
    ap.add_argument("--recipe", default="float")
    ap.add_argument("--rows", default="1,4,16,64")
    ap.add_argument("--lengths", default="128")
    ap.add_argument("--states", default=None, help="comma-separated SSD state paths to time (default: the config's)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", default=None, help="JSON file for the rows")
    args = ap.parse_args()
    paths = args.states.split(",") if args.states else [ssd.CFG["STATES"]]
    if not set(paths) <= {"split", "fused", "by_chunks"}:
        ap.error(f"--states takes split, fused and by_chunks, got {args.states}")
    dev = torch.device("cuda")
    rows_list = [int(r) for r in args.rows.split(",")]
    lengths = [int(n) for n in args.lengths.split(",")]
    model, vocab = build(args.model, args.recipe, dev, torch.float16, gptq_as_rtn=True)
    model.eval()
    cache = model.allocate_cache(max(rows_list) + 1, 2 * max(lengths) + 1)
    result = {"command": "python " + " ".join(sys.argv), "gpu": torch.cuda.get_device_name(), "model": args.model,
              "recipe": args.recipe, "rows": []}
    for states in paths:
        ssd.CFG["STATES"] = states
        with torch.inference_mode():
            graphs = CudaGraphPrefill(model, cache, max_len=max(lengths), max_tokens=max(rows_list) * max(lengths))
            for length in lengths:
                for rows in rows_list:
                    ids = torch.randint(0, vocab, (rows, length), device=dev)
                    slots = list(range(rows))
                    ms = time_fn(lambda: graphs(ids, slots, check_fit=False), dev, 2, 10,
                                 setup=lambda: cache.reset(slots)).median_ms
                    us = ms * 1e3 / (rows * length)
                    result["rows"].append({"states": states, "rows": rows, "length": length, "ms": ms,
                                           "us_per_token": us})
                    print(f"{states:6s} {rows:5d} x {length:5d}: {ms:9.3f} ms  {us:7.2f} us/token", flush=True)
            if args.profile:
                profile_replay(graphs, cache, vocab, max(rows_list), lengths[0], dev)
        graphs = None  # the next state path captures its own graphs
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
