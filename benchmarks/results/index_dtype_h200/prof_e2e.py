"""Kernel times inside Mamba2-2.7B Quamba2 W8A8 + int8 state decode graphs (b=128), torch profiler (session 38)."""
import sys, os
sys.path.insert(0, "benchmarks")
import torch
from torch.profiler import profile, ProfilerActivity
from published_configs import PUBLISHED
from random_model import random_model
from ssmq.quant import CalibrationData, quantize
from ssmq.quant.recipe import Cache, get_recipe
from ssmq.runtime.cuda_graph import CudaGraphDecoder

model = random_model(PUBLISHED["mamba2-2.7b"], dtype=torch.float16)
recipe = get_recipe("quamba2-w8a8").with_changes(name="q", cache=Cache(state_bits=8, state_scales="x_groups"))
quantize(model, recipe, CalibrationData(torch.randint(0, 50000, (4, 256)), source="random", seed=0), progress=False)
for b in (32, 128):
    dec = CudaGraphDecoder(model, max_batch=b, max_seqlen=128, buckets=(b,), ssm_dtype=torch.int8)
    dec(torch.randint(0, 50000, (b,), device="cuda"), torch.arange(b, device="cuda"))
    g = dec.graphs[b][0]
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(10):
            g.replay()
        torch.cuda.synchronize()
    print(f"batch {b}")
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
    del dec
    torch.cuda.empty_cache()
