"""The fused quantize-and-append kernel (``ssmq.kernels.kv_append``) alone: microseconds a launch, one new token a
row, for a Llama-3.1-8B attention layer's sides (8 KV heads x 128), as a decode step writes them.

A CUDA graph of 32 layers x (keys, values) appends is replayed (``bench_kvquant.timeit`` without its L2 flush:
median of --reps replays, divided by 64), so that launch gaps do not count. The per-channel key thresholds are drawn at two spreads: "tight" (most tokens have more
key-outlier candidates than slots: the kernel takes them one at a time) and "wide" (fewer: one pass); per-token
values always take the slow path. --warps overrides ``kv_append.NUM_WARPS`` (several: a sweep).

    python benchmarks/bench_kv_append.py --out DIR [--warps 4,8] [--batch 1,8]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kvquant import timeit  # noqa: E402

from ssmq.kernels import kv_append  # noqa: E402
from ssmq.models.kv_quantizer import KVQuantizer  # noqa: E402
from ssmq.models.quant_kv import QuantKVState  # noqa: E402
from ssmq.models.kv_format import kv_format  # noqa: E402

HKV, E, LAYERS = 8, 128, 32
SPREADS = {"tight": 1.0, "wide": 5.0}


def quantizer(name: str, spread: float) -> KVQuantizer:
    """A quantizer of format ``name`` with per-channel ranges of width ~``spread`` around random centres."""
    g = torch.Generator().manual_seed(0)
    q = KVQuantizer(kv_format(name).spec, HKV, E)
    for x in "kv":
        if hasattr(q, f"{x}_lo"):
            width = (torch.rand(HKV, E, generator=g) * 2 + 0.5) * spread
            centre = torch.randn(HKV, E, generator=g) * 0.3
            getattr(q, f"{x}_lo").copy_(centre - width)
            getattr(q, f"{x}_hi").copy_(centre + width)
    return q.cuda()


def time_append(name: str, spread: float, rows: int, reps: int) -> float:
    q = quantizer(name, spread)
    st = QuantKVState(q, rows, 64, torch.float16, "cuda")
    x = torch.randn(rows, 1, HKV, E, device="cuda", dtype=torch.float16)
    x = x * torch.where(torch.rand(x.shape, device="cuda") < 0.02, 6.0, 1.0).half()  # heavy tails
    slots, pos = torch.arange(rows, device="cuda"), torch.full((rows, 1), 7, device="cuda")
    sides = [(q.params(w), s) for w, s in (("keys", st.k), ("values", st.v))]

    def step():
        for _ in range(LAYERS):
            for p, s in sides:
                kv_append.quant_kv_append(x, slots, pos, p, s.bits, s.codes, s.mid, s.half, s.out_idx, s.out_val,
                                          s.sink)

    return timeit(step, reps, flush_l2=False) * 1e3 / (2 * LAYERS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="kvquant-nuq4,kvquant-nuq4-1%,kvquant-nuq3-1%,kvquant-nuq2-1%")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--warps", default=str(kv_append.NUM_WARPS))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT", "out/kv_append"))
    args = ap.parse_args()
    rows = []
    for warps in (int(w) for w in args.warps.split(",")):
        kv_append.NUM_WARPS = warps
        for name in args.formats.split(","):
            for spread in SPREADS:
                for b in (int(x) for x in args.batch.split(",")):
                    us = time_append(name, SPREADS[spread], b, args.reps)
                    rows.append({"format": name, "thresholds": spread, "batch": b, "warps": warps, "us": us})
                    print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    (out / "kv_append.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = ["| format | key thresholds | batch | warps | µs a launch |", "|---|---|---:|---:|---:|"]
    lines += [f"| {r['format']} | {r['thresholds']} | {r['batch']} | {r['warps']} | {r['us']:.2f} |" for r in rows]
    (out / "kv_append.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
