"""Host time of one call on a GPU: torch ops, a bare Triton launch and ssmq's kernel wrappers, at tiny shapes (GPU
time about 2 us, so the host's time is what a back-to-back loop measures). What an eager forward pays per launch
where the host, not the device, sets its time (prefill of a thousand tokens).

    python benchmarks/launch_host_cost.py OUT.json
"""

from __future__ import annotations

import json
import sys
import time

import torch
import triton
import triton.language as tl

from ssmq import kernels
from ssmq.bench.output import provenance
from ssmq.kernels import gemv


@triton.jit
def _copy(p, n, B: tl.constexpr):
    o = tl.arange(0, B)
    tl.store(p + o, tl.load(p + o, mask=o < n), mask=o < n)


def host_us(fn, n: int = 2000) -> float:
    """Best of 3 loops of ``n`` calls, µs a call (the GPU never the bottleneck: each call's kernel takes ~2 µs)."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
        torch.cuda.synchronize()
    return best


def main(out: str) -> None:
    dev = torch.device("cuda")
    x = torch.randn(1, 64, device=dev, dtype=torch.float16)
    w = torch.randn(64, 64, device=dev, dtype=torch.float16)
    nw = torch.ones(64, device=dev, dtype=torch.float16)
    res = torch.randn(1, 64, device=dev)
    calls = {
        "torch.empty": lambda: torch.empty(64, device=dev),
        "torch.add": lambda: torch.add(x, x),
        "F.linear, 1 row (cuBLAS)": lambda: torch.nn.functional.linear(x, w),
        "a Triton kernel of 2 arguments": lambda: _copy[(1,)](res, 64, B=64),
        "kernels.gemv.linear_decode, 1 row": lambda: gemv.linear_decode(x, w),
        "kernels.linear (selection table, then the GEMV), 1 row": lambda: kernels.linear(x, w),
        "kernels.rms_norm with residual, 1 row": lambda: kernels.rms_norm(x, nw, 1e-5, res, True),
    }
    rows = [[name, f"{host_us(fn):.1f}"] for name, fn in calls.items()]
    doc = {
        "title": "Host time of one call: torch ops, a bare Triton launch, ssmq's kernel wrappers",
        "capability": "kernels",
        "command": "python benchmarks/launch_host_cost.py OUT.json",
        **provenance(dev),
        "setup": "Tiny shapes (64 features, one row: about 2 us of GPU time a call), 2000 calls back to back, the best "
                 "of 3 loops; PDL on (the wrappers' launches carry it). The host's CPU time a call, which sets an "
                 "eager forward's time where its kernels are short (prefill of about a thousand tokens).",
        "columns": ["call", "host us a call"],
        "rows": rows,
    }
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
