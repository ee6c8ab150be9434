"""A/B of the warp decode kernel at one batch: time (CUDA graph, L2 flushed) or launch a few times for ncu."""
import argparse
import sys
sys.path.insert(0, "benchmarks")
import torch
import bench_kvquant as bk
from ssmq.kernels import quant_kv_decode

p = argparse.ArgumentParser()
p.add_argument("--bits", type=int, default=2)
p.add_argument("--batch", type=int, default=166)
p.add_argument("--len", type=int, default=32768)
p.add_argument("--ncu", action="store_true")
p.add_argument("--cap", type=int, default=0)
p.add_argument("--n", type=int, default=0)
p.add_argument("--extra", type=int, default=0)
p.add_argument("--i64", action="store_true")
p.add_argument("--outliers", action="store_true")
a = p.parse_args()
gen = torch.Generator(device="cuda").manual_seed(0)
K, V = bk.quant_cache(a.batch + a.extra, a.cap or a.len, *(bk.ONE_PCT if a.outliers else (0, 0)), gen, a.bits)
q = torch.randn(a.batch, bk.HQ, bk.E, generator=gen, device="cuda", dtype=torch.float16)
slots = torch.arange(a.batch, device="cuda")
lens = torch.full((a.batch,), a.n or a.len, device="cuda", dtype=torch.int64 if a.i64 else torch.int32)
f = lambda: quant_kv_decode(q, slots, lens, K, V, bk.E, 10000.0)
if a.ncu:
    for _ in range(3):
        f()
    torch.cuda.synchronize()
else:
    ts = [bk.timeit(f) for _ in range(3)]
    print(f"{vars(a)}: ms {' '.join(f'{t:.3f}' for t in ts)}")
