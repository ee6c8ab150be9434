"""Online Hadamard transform on the GPU (Quamba2 rotates out_proj's input every decode step): the CPU reference's
butterflies vs the two-GEMM Kronecker form at a few factorizations and compute dtypes, n = 5120 (Mamba2-2.7B's
d_inner), fp16 activations, batch 1 / 32 / 128; µs per call inside a CUDA graph (as decode runs it: 20 calls a
graph, CUDA events, median) and the max error vs float64.

    python benchmarks/bench_hadamard.py [--n 5120] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_e2e import time_ms  # noqa: E402

from ssmq.quant.hadamard import _sylvester, base_matrix, hadamard_matrix, hadamard_transform, split_order  # noqa: E402


def kron_gemm(n: int, t1: int, dtype: torch.dtype):
    """y = H_t1 X R^T (X = x as (t1, n / t1)), factors in ``dtype``, 1/sqrt(n) folded into R."""
    two, b = split_order(n)
    right = _sylvester(two // t1)
    if b > 1:
        right = torch.kron(right, base_matrix(b))
    left = _sylvester(t1).to("cuda", dtype)
    right = (right.double() / math.sqrt(n)).to("cuda", dtype)

    def f(x):
        y = torch.matmul(left, x.to(dtype).reshape(-1, t1, right.shape[0])) @ right.T
        return y.reshape(x.shape).to(x.dtype)
    return f


def graph_us(f, x, calls: int = 20) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            f(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            f(x)
    return time_ms(graph.replay, warmup=2, reps=20) * 1e3 / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=5120)
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--json")
    args = ap.parse_args()
    n = args.n
    two = split_order(n)[0]
    variants = {"shipped (hadamard_transform)": hadamard_transform}
    for t1 in sorted({1 << (two.bit_length() - 1) // 2, two, 16, 64}):
        if two % t1 == 0:
            for dt in (torch.float32, torch.float16):
                variants[f"gemm t1={t1} {str(dt)[6:]}"] = kron_gemm(n, t1, dt)
    H = hadamard_matrix(n).double().cuda() / math.sqrt(n)
    rows = []
    for b in map(int, args.batches.split(",")):
        x = torch.randn(b, n, device="cuda").half()
        ref = x.double() @ H.T
        for name, f in variants.items():
            us = graph_us(f, x)
            err = (f(x).double() - ref).abs().max().item()
            rows.append({"batch": b, "variant": name, "us": us, "max_err": err})
            print(f"b{b:<4} {name:<32} {us:8.1f} us  max err {err:.2e}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "n": n, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
