"""Decode over a quantized KV cache whose rows are shorter than its capacity (a serving slot: max_model_len tokens
of room, a few hundred used), with 1% outliers: the outlier passes' programs used to cover the capacity.

One attention layer of Llama-3.1-8B's shape (32 query / 8 KV heads x 128), random codes and 1% outlier slots
(``bench_kvquant.quant_cache``), ``kernels.quant_kv_decode`` timed as CUDA-graph replays with the L2 flushed
(``bench_kvquant.timeit``). A case is BATCH:CAPACITY:LENGTH:BITS. Prints a JSON line a case (``--tag`` in each).

    python benchmarks/bench_kv_short_rows.py --tag new
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kvquant import E, HQ, ONE_PCT, quant_cache, timeit  # noqa: E402

from ssmq import kernels  # noqa: E402

CASES = "64:32768:1024:4,64:8192:512:4,1:131072:4096:4,1:4096:4096:4,1:131072:131072:4,8:32768:32768:3"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=CASES, help="BATCH:CAPACITY:LENGTH:BITS,...")
    ap.add_argument("--tag", default="", help="a label written in each row (e.g. the tree measured)")
    args = ap.parse_args()
    for case in args.cases.split(","):
        b, cap, n, bits = (int(x) for x in case.split(":"))
        gen = torch.Generator(device="cuda").manual_seed(0)
        k, v = quant_cache(b, cap, *ONE_PCT, gen, bits)
        q = torch.randn(b, HQ, E, device="cuda", dtype=torch.float16, generator=gen)
        slots = torch.arange(b, device="cuda")
        lens = torch.full((b,), n, device="cuda")
        ms = timeit(lambda: kernels.quant_kv_decode(q, slots, lens, k, v, E, 5e5))
        print(json.dumps({"tag": args.tag, "batch": b, "capacity": cap, "length": n, "bits": bits, "ms": ms}),
              flush=True)
        del k, v
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
