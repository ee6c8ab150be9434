"""A/B of index / length pointer dtypes (int32 vs int64) for the kernels the models feed int64 (session 38)."""
import json, os, sys, time
sys.path.insert(0, "benchmarks")
import torch
import bench_kvquant as bk
from bench_int8_ssm import graph_ms, tpot
from published_configs import PUBLISHED
from random_model import random_model
from ssmq.kernels import conv1d, kv_decode_fast
from ssmq.runtime import cuda_graph

OUT = os.environ.get("OUT", "out")
res = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": torch.cuda.get_device_name()}
which = sys.argv[1:] or ["conv", "kvfast", "e2e"]

if "conv" in which:
    D, W = 5120 + 2 * 128, 4
    rows = []
    for b in (1, 32, 128, 256):
        blocks = max(1, (256 << 20) // (b * D * (W - 1) * 2))
        cs = torch.randn(blocks * b, D, W - 1, device="cuda", dtype=torch.float16)
        x, wt, bias = (torch.randn(b, D, device="cuda", dtype=torch.float16), torch.randn(D, W, device="cuda",
                       dtype=torch.float16), torch.randn(D, device="cuda", dtype=torch.float16))
        r = {"batch": b}
        for dt in ("int32", "int64"):
            sl = [torch.arange(k * b, (k + 1) * b, device="cuda", dtype=getattr(torch, dt)) for k in range(blocks)]
            r[dt] = [graph_ms([lambda s=s: conv1d.causal_conv1d_update(x, cs, wt, bias, "silu", s) for s in sl])
                     for _ in range(3)]
        print("conv", r, flush=True)
        rows.append(r)
    res["conv1d_update"] = rows

if "kvfast" in which:
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for bits, b, L in ((4, 1, 131072), (4, 8, 32768), (2, 8, 32768), (4, 64, 32768)):
        K, V = bk.quant_cache(b, L, 0, 0, gen, bits)
        q = torch.randn(b, bk.HQ, bk.E, generator=gen, device="cuda", dtype=torch.float16)
        slots = torch.arange(b, device="cuda")
        r = {"bits": bits, "batch": b, "len": L}
        for dt in ("int32", "int64"):
            lens = torch.full((b,), L, device="cuda", dtype=getattr(torch, dt))
            f = lambda: kv_decode_fast.quant_kv_decode(q, slots, lens, K, V, bk.E, 10000.0)
            r[dt] = [bk.timeit(f) for _ in range(3)]
        print("kvfast", r, flush=True)
        rows.append(r)
        del K, V
        torch.cuda.empty_cache()
    res["kv_decode_fast"] = rows

if "e2e" in which:
    real = cuda_graph.CudaGraphDecoder._capture
    def capture_dtype(dt):
        def _capture(self, bs):
            device = self.model.device
            tokens = torch.zeros(bs, dtype=torch.long, device=device)
            slots = torch.full((bs,), self.scratch, dtype=dt, device=device)
            graph, logits = cuda_graph._capture(lambda: self.model.step(tokens, self.cache, slots), self.pool,
                                                lambda: self.cache.reset([self.scratch]))
            self.graphs[bs] = (graph, tokens, slots, logits)
        return _capture
    model = random_model(PUBLISHED["mamba2-2.7b"], dtype=torch.float16)
    rows = []
    for b in (1, 32, 128):
        r = {"batch": b}
        for name, dt in (("int32", torch.int32), ("int64", torch.long)):
            cuda_graph.CudaGraphDecoder._capture = capture_dtype(dt)
            r[name] = [tpot(model, b, 32, None)["tpot_ms"] for _ in range(2)]
        print("e2e fp16", r, flush=True)
        rows.append(r)
    res["e2e_mamba2_2.7b_fp16"] = rows
    cuda_graph.CudaGraphDecoder._capture = real
json.dump(res, open(f"{OUT}/ab_index.json", "w"), indent=1)
