"""Launch settings of the warp KV decode kernel (``ssmq.kernels.kv_decode_warp``) swept on ``bench_kvquant.py``'s
layer (--shape: 8b, 32 query / 8 KV heads x 128, full RoPE; smollm2, 9 / 3 x 64; hybrid, 6 / 2 x 64, RoPE on 32;
sink 1; random codes, as that bench), one GPU, ms a call
(``bench_kvquant.timeit``: CUDA-graph replays, L2 flushed; a case's settings timed in turn, --rounds times, the
median of the rounds). One JSON row a (batch, context, width, setting):

    regcap   MAXNREG (a register cap a thread: more programs an SM), the splits filling whole rounds of the programs
             it allows, and the uncapped launch's splits (8 programs an SM)
    splits   the split count, around the default (whole rounds of 8 programs an SM)
    stages   STAGES, the tiles of codes in flight (cp.async), with and without 1% outliers; the float16 decode
             (``kv_decode_fast.float_kv_decode``) of the same shape timed first, for the ratio

    python benchmarks/sweep_kv_warp.py regcap|splits|stages [--shape 8b|smollm2|hybrid] [--rounds 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kvquant as bk  # noqa: E402

from ssmq.kernels import kv_decode_warp as w  # noqa: E402
from ssmq.kernels.kv_decode_fast import float_kv_decode  # noqa: E402

SHAPES = {"regcap": ((1, 131072), (8, 32768), (1, 16384)), "splits": ((1, 131072), (1, 16384), (8, 32768)),
          "stages": ((1, 131072), (8, 32768), (1, 16384), (1, 4096), (8, 131072))}
SPLITS = {1: (16, 33, 66, 132, 264, 528), 8: (8, 17, 33, 66)}


def settings(what: str, b: int, outliers: bool) -> list[dict]:
    """The kernel settings one (batch, width, outliers) case is timed under (module attributes, or a split count)."""
    if what == "regcap":
        return [dict(MAXNREG=cap, uncapped_splits=u) for cap in (None, 224, 200, 184, 168)
                for u in ((False, True) if cap else (False,))]
    if what == "splits":
        return [dict(splits=p) for p in SPLITS[b]]
    return [dict(STAGES=s) for s in ((2, 3, 4) if not outliers else (3,))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=sorted(SHAPES))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--shape", default="8b", help=f"bench_kvquant's attention shape: {', '.join(bk.SHAPES)}")
    ap.add_argument("--rounds", type=int, default=3, help="passes over a case's settings, in turn; ms = their median")
    args = ap.parse_args()
    bk.set_shape(args.shape)
    programs = w.programs(bk.HKV, bk.E)
    gen = torch.Generator(device=bk.DEV).manual_seed(0)
    defaults = dict(MAXNREG=w.MAXNREG, STAGES=w.STAGES)
    rows = []
    for b, L in SHAPES[args.what]:
        q = torch.randn(b, bk.HQ, bk.E, generator=gen, device=bk.DEV, dtype=torch.float16)
        slots = torch.arange(b, device=bk.DEV)
        lens = torch.full((b,), L, device=bk.DEV, dtype=torch.int32)
        base = {}
        if args.what == "stages":
            kf, vf = (torch.randn(b, L, bk.HKV, bk.E, generator=gen, device=bk.DEV, dtype=torch.float16) for _ in "kv")
            base = {"fp16 ms": bk.timeit(lambda: float_kv_decode(q, slots, lens, kf, vf))}
            del kf, vf
        for bits in (4, 3, 2):
            for outliers in ((False, True) if args.what == "stages" else (False,)):
                K, V = bk.quant_cache(b, L, *(bk.ONE_PCT if outliers else (0, 0)), gen, bits)
                uncapped = w.default_splits(b, programs, L, q.device)  # the module's defaults are in place here
                cases = settings(args.what, b, outliers)
                times = [[] for _ in cases]
                used = [0] * len(cases)
                # the settings in turn, --rounds times: a drift of the card's clocks during the sweep then spreads over
                # every setting instead of favouring the ones timed early (one pass once measured two identical
                # launches 9% apart)
                for _ in range(args.rounds):
                    for j, s in enumerate(cases):
                        for name in defaults:
                            setattr(w, name, s.get(name, defaults[name]))
                        splits = uncapped if s.get("uncapped_splits") else s.get("splits")
                        used[j] = splits = splits or w.default_splits(b, programs, L, q.device)
                        times[j].append(bk.timeit(
                            lambda: w.quant_kv_decode(q, slots, lens, K, V, bk.R, 1e4, splits=splits)))  # noqa: B023
                        for name, value in defaults.items():
                            setattr(w, name, value)
                for s, ms, splits in zip(cases, times, used):
                    row = dict(batch=b, context=L, bits=bits, outliers=outliers, **s, ms=statistics.median(ms),
                               **{"ms rounds": ms}, **base)
                    row["splits"] = splits
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                del K, V
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = "" if args.shape == "8b" else f"_{args.shape}"
    (out / f"kv_warp_{args.what}{tag}_sweep.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name() if bk.DEV == "cuda" else "cpu", "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
