"""The H100 decode tables of issue 13 as one PNG: Mamba2-2.7B TPOT vs batch for FP16, the int8 state, ReplaySSM
checkpointing and a Quamba2 W8A8 model, from the JSON the benchmarks wrote (benchmarks/results/).

    python benchmarks/plot_decode_h100.py [--out benchmarks/results/int8_ssm_h100/decode_tpot.png]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plotting import log_axes, pyplot  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
# (file, key in its "e2e", label): the later run of a row wins where two runs measured it
SERIES = [
    ("replay_h100/e2e_run2.json", "fp16 state, plain", "FP16, fp16 state"),
    ("replay_h100/e2e_run2.json", "int8 state, plain", "FP16 weights, int8 state"),
    ("replay_h100/e2e_run2.json", "fp16 state, checkpoint K=16", "FP16, fp16 state, checkpoint K=16"),
    ("replay_h100/e2e_int8_run3.json", "int8 state, checkpoint K=16", "FP16 weights, int8 state, checkpoint K=16"),
    ("int8_ssm_h100/e2e_run1_butterfly_hadamard.json", "quamba2-w8a8 int8 state, int8 kernels",
     "quamba2-w8a8, int8 state (butterfly Hadamard)"),
    ("int8_ssm_h100/e2e_run2_gemm_hadamard.json", "quamba2-w8a8 int8 state, int8 kernels",
     "quamba2-w8a8, int8 state (GEMM Hadamard)"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(RESULTS / "int8_ssm_h100" / "decode_tpot.png"))
    args = ap.parse_args()
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    for path, key, label in SERIES:
        rows = json.loads((RESULTS / path).read_text())["e2e"].get(key, {})
        pts = sorted((int(b[1:]), r["tpot_ms"]) for b, r in rows.items() if b.startswith("b") and "tpot_ms" in r)
        if pts:
            ax.plot(*zip(*pts), "o-", label=label)
    log_axes(ax, "batch", "TPOT ms (CUDA graphs)", "Mamba2-2.7B decode on one H100, 2026-11-23 (random weights)",
             legend_size=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
