"""The split-combine kernel (``ssmq.kernels.kv_decode._combine_kernel``, every split decode's second launch) alone,
one GPU, under several tilings (HB heads, EB channels, PC splits a loop step) against ``combine_tiling``'s pick, on
the decode shapes that take many splits: one row of few heads (SmolLM2: 9 x 64, the hybrid: 6 x 64, 528 splits)
and bench_kvquant's 32 x 128 at batch 1 and 8. ms a call (``bench_kvquant.timeit``: CUDA-graph replays, L2
flushed); one JSON row a (shape, tiling).

    python benchmarks/sweep_combine.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kvquant as bk  # noqa: E402

from ssmq.kernels.kv_decode import combine_splits, combine_tiling, split_outputs  # noqa: E402

CASES = [(1, 9, 64, 528), (1, 6, 64, 528), (1, 9, 64, 264), (8, 9, 64, 66), (1, 32, 128, 132), (8, 32, 128, 33)]
TILINGS = [(4, 16, 32), (4, 8, 64), (4, 4, 128), (4, 8, 32), (4, 4, 32), (4, 16, 128)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    rows = []
    for b, hq, e, splits in CASES:
        out, ws = split_outputs(b, hq, e, splits, bk.DEV)
        ws.copy_(torch.randn(ws.shape, device=bk.DEV))
        ws[..., e + 1].abs_()  # l > 0
        want = combine_splits(out.clone(), ws, splits, (4, 16, 32)).clone()
        pick = combine_tiling(b, hq, e, splits, out.device)
        for tiling in dict.fromkeys([pick, *TILINGS]):
            got = combine_splits(out, ws, splits, tiling)
            row = dict(batch=b, heads=hq, e=e, splits=splits, tiling=tiling, picked=tiling == pick,
                       ms=bk.timeit(lambda: combine_splits(out, ws, splits, tiling)),  # noqa: B023
                       max_diff=float((got - want).abs().max()))
            rows.append(row)
            print(json.dumps(row), flush=True)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "combine_sweep.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name() if bk.DEV == "cuda" else "cpu", "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
