"""Where the KVQuant decode kernel's outlier time goes (one GPU): the dispatch (``kernels.quant_kv_decode``) timed on
``bench_kvquant``'s 4-bit cache and layer shape without outliers, with 1% key and value outliers, with key
outliers only and with value outliers only (CUDA-graph replays, L2 flushed: ``bench_kvquant.timeit``).

    python benchmarks/time_kv_outlier_parts.py [--length 131072]
"""

from __future__ import annotations

import argparse

import torch

import bench_kvquant as b
from ssmq.kernels import quant_kv_decode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=131072)
    L = ap.parse_args().length
    ko, vo = b.ONE_PCT
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, b.HQ, b.E, generator=gen, device="cuda", dtype=torch.float16)
    slots, lens = torch.arange(1, device="cuda"), torch.full((1,), L, device="cuda")
    for name, slots_kv in (("no outliers", (0, 0)), ("1% keys + values", (ko, vo)), ("1% keys only", (ko, 0)),
                           ("1% values only", (0, vo))):
        K, V = b.quant_cache(1, L, *slots_kv, gen, 4)
        ms = b.timeit(lambda: quant_kv_decode(q, slots, lens, K, V, b.E, 10000.0))  # noqa: B023
        print(f"{L} tokens, 4-bit, {name:18s} {ms:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
