"""Decode with Quamba2's out_proj input (act_z quantizer, gated norm, online Hadamard, static int8 codes) made three
ways, alternated in one process on one GPU:

    python benchmarks/device_out_proj_input.py OUT [--recipes quamba2-w4a8,quamba2-w8a8] [--batch-size 1,4,16]
        [--reps 2] [other ssmq bench latency options, e.g. --model mamba2-130m --layers 2]

``apart``: act_z's fake-quant kernel, the gated norm, then out_proj's Hadamard GEMMs and quantize kernel; ``z-inside``:
z fake-quantized inside the norm kernel, out_proj still rotating and quantizing its own input; ``codes`` (the
product): one kernel from y and z to out_proj's rotated int8 codes (``kernels.hadamard``). Runs ``ssmq bench
latency`` (Mamba2-2.7B, random weights, float16, CUDA-graph decode) ``--reps`` times a variant; each run writes
OUT/<variant>-<rep>/latency.json.
"""

from __future__ import annotations

import argparse

from ssmq.cli import main
from ssmq.models.mamba2 import Mamba2Mixer

PRODUCT = Mamba2Mixer._normed, Mamba2Mixer._out_codes


def _unrotated_codes(self):
    codes = PRODUCT[1](self)
    return None if codes is None or codes.rotate else codes


def _apart(self, y, z):
    return self.act_y(self.norm(y, self.act_z(z)))


VARIANTS = {"apart": (_apart, _unrotated_codes), "z-inside": (PRODUCT[0], _unrotated_codes), "codes": PRODUCT}


def run(out: str, recipes: str, batches: str, reps: int, extra: list[str]) -> None:
    for rep in range(reps):
        for name, (normed, out_codes) in VARIANTS.items():
            Mamba2Mixer._normed, Mamba2Mixer._out_codes = normed, out_codes
            try:
                rc = main(["bench", "latency", "--model", "mamba2-2.7b", "--dtype", "float16", "--recipes",
                           f"float,{recipes}", "--batch-size", batches, "--input-len", "1024", "--gptq-as-rtn",
                           "--peers", "none", "--out", f"{out}/{name}-{rep}", *extra])
            finally:
                Mamba2Mixer._normed, Mamba2Mixer._out_codes = PRODUCT
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
