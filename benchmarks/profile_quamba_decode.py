"""Kernels of one eager decode step of Mamba2-2.7B (random weights) quantized by a Quamba / Quamba2 recipe with the
int8 state cache, at the given batches, costliest first: where a quantized step's time goes on the GPU.

    python benchmarks/profile_quamba_decode.py [--recipe quamba2-w8a8] [--batches 1,128] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_e2e import profile_step  # noqa: E402
from published_configs import PUBLISHED  # noqa: E402
from random_model import random_model  # noqa: E402

from ssmq.quant.api import quantize  # noqa: E402
from ssmq.quant.calibration import CalibrationData  # noqa: E402
from ssmq.quant.recipe import Cache, get_recipe  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="mamba2-2.7b")
    ap.add_argument("--recipe", default="quamba2-w8a8")
    ap.add_argument("--batches", default="1,128")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json")
    args = ap.parse_args()
    model = random_model(PUBLISHED[args.model], dtype=torch.float16)
    recipe = get_recipe(args.recipe).with_changes(name=f"{args.recipe}-int8state", cache=Cache(state_bits=8))
    quantize(model, recipe, CalibrationData(torch.randint(0, 50000, (4, 256)), source="random tokens", seed=0),
             progress=False)
    out = {str(b): profile_step(model, b, args.top, ssm_dtype=torch.int8) for b in map(int, args.batches.split(","))}
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "recipe": recipe.name, "profiles": out}, indent=1))


if __name__ == "__main__":
    main()
