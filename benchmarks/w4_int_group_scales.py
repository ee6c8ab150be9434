"""What W4A8 would cost with integer group scales (a per-channel float scale times a small integer per group, the
layout that lets int4 codes widen to int8 in registers and the whole product run as one int8 GEMM with a per-channel
epilogue), measured on the trained models' forward on the CPU.

    python benchmarks/w4_int_group_scales.py --model ../shared/models/mamba2 --recipes quamba2-w4a8 --out OUT.json

Each recipe quantizes the model once and scores the first ``--limit`` WikiText-2 test windows through the forward on
the references; then, for each ``--levels`` L, every int8-activation linear with int4 codes in groups is re-quantized
in place: per output channel s_c = max_g s_g / L, each group's scale becomes sg * s_c with the integer
sg = ceil(s_g / s_c) in [1, L] (never below the group's own scale, so no code clips), and the codes are re-rounded
from the recipe's dequantized int4 weight to that scale (a second rounding: an upper bound on what quantizing the
float weight directly would lose). The widened codes q * sg stay within int8 for L <= 16.
"""

from __future__ import annotations

import json
from contextlib import contextmanager

import torch

from act_code_sensitivity import forward_args, score_changed
from ssmq.ops.quant_linear import dequantize_weight, pack_int4
from ssmq.quant.linear import QuantLinear


@contextmanager
def integer_group_scales(model, levels: int):
    """``model``'s int8-activation linears with grouped int4 codes re-quantized to integer group scales of at most
    ``levels`` steps of a per-channel scale; restored on exit."""
    saved = []
    for m in model.modules():
        if not isinstance(m, QuantLinear) or m.act is None or m.act.dtype != "int8" or m.weight_scale.dim() != 2 \
                or m.weight_q.dtype != torch.uint8:
            continue
        saved.append((m, m.weight_q, m.weight_scale))
        s = m.weight_scale
        n, groups = s.shape
        w = dequantize_weight(m.weight_q, s).view(n, groups, -1)
        s_c = s.amax(1, keepdim=True) / levels
        sg = torch.ceil(s / s_c).clamp(1, levels)
        s_new = (sg * s_c).float()
        codes = torch.round(w / s_new[..., None]).clamp(-8, 7).to(torch.int8).view(n, -1)
        m.weight_q, m.weight_scale = pack_int4(codes), s_new
    try:
        yield
    finally:
        for m, w_q, s in saved:
            m.weight_q, m.weight_scale = w_q, s


def main() -> None:
    ap = forward_args(__doc__.splitlines()[0], "quamba2-w4a8")
    ap.add_argument("--levels", default="16,8")
    args = ap.parse_args()
    levels = [int(v) for v in args.levels.split(",")]
    rows = score_changed(args, lambda model: [integer_group_scales(model, L) for L in levels])
    with open(args.out, "w") as fh:
        json.dump({"model": args.model, "recipes": args.recipes, "levels": levels, "seqlen": args.seqlen,
                   "limit": args.limit, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
