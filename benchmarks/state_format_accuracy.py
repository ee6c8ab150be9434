"""Perplexity through the decode path (``wikitext2-decode``: every token a ``model.step`` over the cache) with the SSM
state stored in candidate formats, on the same windows of WikiText-2 test, on the CPU.

    python benchmarks/state_format_accuracy.py --model ../shared/models/mamba2 --limit 4 --seqlen 512 --out OUT.json

Formats: float32, float16 and bfloat16 states; int8 with dynamic row scales (``int8-state``); and, emulated in the
reference step (the codes kept in the int8 buffer, ``ssmq.ops.quant_ssm``'s row quantizer replaced): FP8 e4m3 with a
row scale (absmax / 448 a row of n, rounded to nearest even by the conversion), FP8 e4m3 without a scale (the state
cast, saturating at 448), e5m2 with a row scale, and int4 with row scales (absmax / 7); int8 and int4 rows also with
stochastic rounding (``-stochastic``, seeds 0 and 1). y is computed from the float32 state before it is stored, as
every format does, so only later steps see a format's rounding.
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import contextmanager

import torch

import ssmq.ops.quant_ssm as Q
from ssmq.eval.perplexity import decode_perplexity_of_ids, wikitext2_path
from ssmq.models.loading import load_model
from ssmq.models.ssm_mixer import SSMMixer
from ssmq.tokenizer import load_tokenizer


def _fp8_rows(dtype, qmax):
    def quantize(state):
        state = state.float()
        amax = state.abs().amax(-1)
        inv = torch.where(amax > 0, qmax / amax, torch.zeros_like(amax))
        codes = (state * inv[..., None]).clamp(-qmax, qmax).to(dtype)
        return codes.view(torch.int8), amax / qmax

    def dequantize(q, scale):
        return q.view(dtype).float() * scale.float()[..., None]

    return quantize, dequantize


def _int_rows(qmax, seed=None):
    """Row scales (absmax / qmax a row of n); each value rounded to nearest, or with a ``seed`` stochastically: down or
    up with the probability of its distance to the other code (floor(v + u), u uniform in [0, 1)), unbiased where
    round-to-nearest drifts a slowly decaying state."""
    gen = None if seed is None else torch.Generator().manual_seed(seed)

    def quantize(state):
        state = state.float()
        amax = state.abs().amax(-1)
        inv = torch.where(amax > 0, qmax / amax, torch.zeros_like(amax))
        v = state * inv[..., None]
        codes = torch.round(v) if gen is None else torch.floor(v + torch.rand(v.shape, generator=gen))
        return codes.clamp(-qmax, qmax).to(torch.int8), amax / qmax

    return quantize, Q.dequantize_state_rows_ref


ROW_CODECS = {"fp8-e4m3-rows": _fp8_rows(torch.float8_e4m3fn, 448.0), "fp8-e5m2-rows": _fp8_rows(torch.float8_e5m2,
              57344.0), "int4-rows": _int_rows(7.0), "int8-rows": (Q.quantize_state_rows_ref,
              Q.dequantize_state_rows_ref), "int8-rows-stochastic": _int_rows(127.0, 0),
              "int8-rows-stochastic-seed1": _int_rows(127.0, 1), "int4-rows-stochastic": _int_rows(7.0, 0),
              "int4-rows-stochastic-seed1": _int_rows(7.0, 1)}
FLOATS = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "fp8-e4m3": torch.float8_e4m3fn}


@contextmanager
def row_codec(name):
    """The reference's row quantizer replaced by ``ROW_CODECS[name]`` (the int8 buffer holds the codes' bits)."""
    q, dq = Q.quantize_state_rows_ref, Q.dequantize_state_rows_ref
    Q.quantize_state_rows_ref, Q.dequantize_state_rows_ref = ROW_CODECS[name]
    try:
        yield
    finally:
        Q.quantize_state_rows_ref, Q.dequantize_state_rows_ref = q, dq


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--formats", default=",".join([*FLOATS, *ROW_CODECS]))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    tok = load_tokenizer(args.model)
    ids = tok.encode(wikitext2_path().read_text(encoding="utf-8"))
    rows = []
    for fmt in args.formats.split(","):
        model = load_model(args.model, torch.float32, "cpu").eval()
        t0 = time.time()
        if fmt in FLOATS:
            r = decode_perplexity_of_ids(model, ids, args.seqlen, args.limit, 0, FLOATS[fmt], False)
        else:
            for m in model.modules():
                if isinstance(m, SSMMixer):
                    m.enable_int8_state(0, rows=True)
            with row_codec(fmt):
                r = decode_perplexity_of_ids(model, ids, args.seqlen, args.limit, 0, None, False)
        rows.append({"format": fmt, "ppl": r["ppl"], "nll_mean": r["nll_mean"], "windows": r["n_windows"],
                     "seqlen": r["seqlen"], "tokens": r["n_tokens_predicted"], "seconds": round(time.time() - t0, 1)})
        print(json.dumps(rows[-1]), flush=True)
    base = rows[0]["ppl"]
    print(f"\n{args.model}: wikitext2-decode, {rows[0]['windows']} windows x {rows[0]['seqlen']} tokens, CPU float32")
    for r in rows:
        print(f"{r['format']:16s} ppl {r['ppl']:9.4f}  {100 * (r['ppl'] / base - 1):+7.3f}% vs {rows[0]['format']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "task": "wikitext2-decode", "device": "cpu", "dtype": "float32",
                       "date": time.strftime("%Y-%m-%d"), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
