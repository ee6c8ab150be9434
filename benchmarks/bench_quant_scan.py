"""int8-input prefill scans (one GPU): the SSD on int8 x, B, C codes (``quant_ssd_chunk_scan``, Quamba2) vs the float
SSD on fp16 inputs and vs the earlier Quamba2 path (dequantize the codes to fp16, then the float SSD), at Mamba2-2.7B's
layer; the same three for Mamba-1's selective scan (``quant_selective_scan``, Quamba) at Mamba-2.8B's layer.

    PYTHONPATH=. python benchmarks/bench_quant_scan.py --out out/quant_scan [--batches 1,4] [--lens 2048,8192]

Mamba2-2.7B: h 80, p 64, n 128, g 1, chunk 256; x scales per (h, p) channel, B / C per 8 state groups. Mamba-2.8B:
d 5120, n 16; u, B, C codes with per-channel / per-tensor scales, Δ and z fp16 (16-bit taps). One layer per call, the
median of CUDA-event timings; ``dequant+float`` counts the dequantization kernels the codes need before a float scan.
Also the relative error of the int8-input kernels against the float kernels on the dequantized inputs (the same
values: only rounding differs). Writes quant_scan.json to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_e2e import time_ms  # noqa: E402

from ssmq.kernels.scan import quant_selective_scan, selective_scan  # noqa: E402
from ssmq.kernels.ssd import quant_ssd_chunk_scan, ssd_chunk_scan  # noqa: E402

DEV = "cuda"
H, P, N, G, T, K = 80, 64, 128, 1, 256, 8  # Mamba2-2.7B layer; K state groups of B / C scales
D1, N1 = 5120, 16  # Mamba-2.8B layer


def codes(*shape):
    return torch.randint(-128, 128, shape, dtype=torch.int8, device=DEV)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def ssd_case(b, l):
    x_q, B_q, C_q = codes(b, l, H, P), codes(b, l, G, N), codes(b, l, G, N)
    s_x = torch.rand(H, P, device=DEV) * 0.02 + 1e-3
    s_B, s_C = (torch.rand(G, K, device=DEV) * 0.02 + 1e-3 for _ in range(2))
    dt, A = torch.randn(b, l, H, device=DEV, dtype=torch.float16), -torch.rand(H, device=DEV) - 0.5
    kw = dict(D=torch.randn(H, device=DEV), dt_bias=torch.randn(H, device=DEV) - 2, dt_softplus=True)
    per_state = lambda s: s.repeat_interleave(N // K, -1)  # noqa: E731

    def dequant():
        return ((x_q.float() * s_x).half(), (B_q.float() * per_state(s_B)).half(), (C_q.float() * per_state(s_C)).half())

    ssd_float = lambda x, B, C: ssd_chunk_scan(x, dt, A, B, C, T, **kw)  # noqa: E731
    x, B, C = dequant()
    quant = lambda: quant_ssd_chunk_scan(x_q, s_x, dt, A, B_q, s_B, C_q, s_C, T, out_dtype=torch.float16, **kw)  # noqa
    return dict(
        float_ms=time_ms(lambda: ssd_float(x, B, C)),
        int8_ms=time_ms(quant),
        dequant_float_ms=time_ms(lambda: ssd_float(*dequant())),
        rel_err_vs_float=rel(quant(), ssd_chunk_scan(x.float(), dt, A, B.float(), C.float(), T, **kw)),
    )


def scan_case(b, l):
    u_q, B_q, C_q = codes(b, D1, l), codes(b, N1, l), codes(b, N1, l)
    s_u, s_B, s_C = torch.rand(D1, 1, device=DEV) * 0.02 + 1e-3, torch.tensor(0.01, device=DEV), \
        torch.tensor(0.01, device=DEV)
    dt, z = (torch.randn(b, D1, l, device=DEV, dtype=torch.float16) for _ in range(2))
    A = -torch.rand(D1, N1, device=DEV) - 0.2
    Dv, bias = torch.randn(D1, device=DEV), torch.randn(D1, device=DEV) - 2

    def dequant():
        return (u_q.float() * s_u).half(), (B_q.float() * s_B).half(), (C_q.float() * s_C).half()

    u, B, C = dequant()
    flt = lambda u, B, C: selective_scan(u, dt, A, B, C, Dv, z, bias, True)  # noqa: E731
    quant = lambda: quant_selective_scan(u_q, s_u, dt, None, A, B_q, s_B, C_q, s_C, Dv, z, None, bias, True,  # noqa
                                         out_dtype=torch.float16)
    return dict(
        float_ms=time_ms(lambda: flt(u, B, C)),
        int8_ms=time_ms(quant),
        dequant_float_ms=time_ms(lambda: flt(*dequant())),
        rel_err_vs_float=rel(quant(), selective_scan(u.float(), dt.float(), A, B.float(), C.float(), Dv, z.float(),
                                                     bias, True)),
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out/quant_scan")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--lens", default="2048,8192")
    args = ap.parse_args()
    rows = []
    for b in map(int, args.batches.split(",")):
        for l in map(int, args.lens.split(",")):
            for name, fn in (("ssd-mamba2-2.7b", ssd_case), ("scan-mamba-2.8b", scan_case)):
                r = dict(kernel=name, batch=b, seqlen=l, **fn(b, l))
                rows.append(r)
                print(f"{name:16s} b={b} l={l:5d}  float {r['float_ms']:.3f} ms  int8 {r['int8_ms']:.3f} ms  "
                      f"dequant+float {r['dequant_float_ms']:.3f} ms  rel err {r['rel_err_vs_float']:.2e}", flush=True)
                torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "quant_scan.json").write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows), indent=1))


if __name__ == "__main__":
    main()
