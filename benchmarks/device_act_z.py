"""Decode with a quantizing ``act_z`` before a rotated out_proj (Quamba2): z fake-quantized inside the gated norm
against the quantizer's own kernel before the norm, alternated in one process on one GPU.

    python benchmarks/device_act_z.py OUT [--recipes quamba2-w4a8,quamba2-w8a8] [--batch-size 1,4,16] [--reps 2]
        [other ssmq bench latency options, e.g. --model mamba2-130m --layers 2]

Runs ``ssmq bench latency`` (Mamba2-2.7B, random weights, float16, CUDA-graph decode) ``--reps`` times a variant,
the variants alternated; each run writes OUT/<variant>-<rep>/latency.json. ``apart`` puts the quantizer's own pass
back for the length of its runs (as before z moved into the norm kernel); the product runs ``inside``.
"""

from __future__ import annotations

import argparse

from ssmq.cli import main
from ssmq.models.mamba2 import Mamba2Mixer


def _apart(self, y, z):
    return self.act_y(self.norm(y, self.act_z(z)))


def run(out: str, recipes: str, batches: str, reps: int, extra: list[str]) -> None:
    inside = Mamba2Mixer._normed
    for rep in range(reps):
        for name, normed in (("apart", _apart), ("inside", inside)):
            Mamba2Mixer._normed = normed
            try:
                rc = main(["bench", "latency", "--model", "mamba2-2.7b", "--dtype", "float16", "--recipes",
                           f"float,{recipes}", "--batch-size", batches, "--input-len", "1024", "--gptq-as-rtn",
                           "--peers", "none", "--out", f"{out}/{name}-{rep}", *extra])
            finally:
                Mamba2Mixer._normed = inside
            if rc:
                raise SystemExit(rc)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--recipes", default="quamba2-w4a8,quamba2-w8a8")
    p.add_argument("--batch-size", default="1,4,16")
    p.add_argument("--reps", type=int, default=2)
    a, rest = p.parse_known_args()
    run(a.out, a.recipes, a.batch_size, a.reps, rest)
