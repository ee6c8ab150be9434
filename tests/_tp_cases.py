"""What the tensor-parallel tests run on every rank (and once without TP, as the reference)."""

from __future__ import annotations

import torch

PROMPT = [3, 17, 5, 42, 9, 11, 2, 30, 7, 19, 23, 4, 8]  # 13 tokens: several SSD chunks of the tiny models


def build(source, dtype=torch.float32, device="cpu"):
    """source: ("tiny", arch, overrides) | ("path", folder); a quantized folder loads in ``dtype`` with its
    scales as stored (float32), which ``.to(dtype)`` would round."""
    if source[0] == "tiny":
        from tiny_ssm import tiny_model

        return tiny_model(source[1], **source[2]).to(device, dtype)
    from ssmq.quant import load_model  # float or quantized folders

    return load_model(source[1], dtype=dtype, device=device).eval()


@torch.no_grad()
def run_model(model, prompt=PROMPT, steps: int = 4, batch: int = 2, ssm_dtype=None, dtype=torch.float32) -> dict:
    """Logits of a full forward, of a cached prefill, of ``steps`` greedy decode steps; greedy tokens. ``dtype``: the
    caches' (float32, or float64 for a model run in float64 throughout)."""
    ids = torch.tensor([prompt] * batch, device=model.device)
    ids[1:, 0] = 1  # rows differ
    full = model(ids)
    cache = model.allocate_cache(batch, len(prompt) + steps + 1, dtype=dtype, ssm_dtype=ssm_dtype)
    head = 5
    model(ids[:, :head], cache)  # prefill in two pieces: continues from the cache
    pre = model(ids[:, head:], cache)
    decode, tok = [], pre[:, -1].argmax(-1)
    for _ in range(steps):
        logits = model.step(tok, cache)
        decode.append(logits)
        tok = logits.argmax(-1)
    from ssmq.runtime.generate import generate
    from ssmq.runtime.sampling import SamplingParams

    gen_cache = model.allocate_cache(2, len(prompt) + 9, dtype=dtype, ssm_dtype=ssm_dtype)
    gen = generate(model, [prompt, prompt[:7]], SamplingParams(max_new_tokens=8, temperature=0.0, stop_at_eos=False),
                   cache=gen_cache)
    return {"full": full, "prefill": pre, "decode": torch.stack(decode), "generated": gen}



def quantized_checkpoint(arch: str, recipe: str, folder, state_bits: int | None = None, **overrides) -> str:
    """Quantize the tiny model of ``arch`` by ``recipe`` (SSM recipes: optionally an int8 state cache) and
    save it; returns the folder."""
    from tiny_ssm import synthetic_calibration, tiny_model

    from ssmq.quant import quantize, save_quantized

    model = tiny_model(arch, **overrides)
    if state_bits is not None:
        from ssmq.quant.recipe import Cache, get_recipe

        recipe = get_recipe(recipe).with_changes(cache=Cache(state_bits=state_bits))
    quantize(model, recipe, synthetic_calibration(model.config.vocab_size, n=4, seqlen=32), progress=False)
    save_quantized(model, folder)
    return str(folder)


def reference(source, ssm_dtype=None, device: str = "cpu", float64: bool = False) -> dict:
    with _precision(float64):
        dtype = torch.float64 if float64 else torch.float32
        return on_cpu(run_model(build(source, dtype).to(device), ssm_dtype=ssm_dtype, dtype=dtype))


def _precision(float64: bool):
    """float64 throughout (``hf_tiny.float64_throughout``: the models' float32 upcasts lifted), or nothing."""
    import contextlib

    from hf_tiny import float64_throughout

    return float64_throughout() if float64 else contextlib.nullcontext()


def on_cpu(res: dict) -> dict:
    return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in res.items()}


def tp_suite(comm, cases, device: str = "cpu", float64: bool = False) -> list[dict]:
    """cases: [(source, fuse_norm, ssm_dtype)] -> run_model of the sharded model for each (on this rank's GPU with
    ``device`` "cuda"; results on the CPU); ``float64``: the models in float64 throughout (CPU)."""
    with _precision(float64):
        return _tp_suite(comm, cases, device, torch.float64 if float64 else torch.float32)


def _tp_suite(comm, cases, device, dtype) -> list[dict]:
    from ssmq.runtime.tp import apply_tp

    out = []
    for source, fuse_norm, ssm_dtype in cases:
        model = build(source, dtype)
        if device == "cuda":
            model = model.to(torch.device("cuda", torch.cuda.current_device()))
        apply_tp(model, comm, fuse_norm=fuse_norm)
        comm.counts.clear()
        comm.counting = True
        res = run_model(model, ssm_dtype=ssm_dtype, dtype=dtype)
        comm.counting = False
        res["all_reduces_per_layer"] = model.tp.all_reduces_per_layer
        res["counts"] = dict(comm.counts)
        out.append(on_cpu(res))
    return out


def tp_graph_decode(comm, cases, dtype_name: str, steps: int = 6) -> list[dict]:
    """cases: [source] -> per case, the sharded model in ``dtype_name`` on this rank's GPU: max |graph - eager|
    / max |eager| over ``steps`` teacher-forced decode steps of a ``CudaGraphDecoder`` (its captures hold the
    collectives: one-shot or NCCL by dtype and size; dynamic activation scales reduced over ranks) and the
    eager logits (on the CPU, for the ranks to agree)."""
    from ssmq.runtime.cuda_graph import CudaGraphDecoder
    from ssmq.runtime.tp import apply_tp

    dtype = getattr(torch, dtype_name)
    out = []
    for source in cases:
        model = build(source, dtype, torch.device("cuda", torch.cuda.current_device()))
        apply_tp(model, comm)
        dec = CudaGraphDecoder(model, max_batch=2, max_seqlen=16)
        cache = model.allocate_cache(2, 16, dtype=dtype)
        slots = torch.arange(2, device=model.device)
        g = torch.Generator().manual_seed(0)
        err, eager_all = 0.0, []
        with torch.inference_mode():
            for _ in range(steps):
                tok = torch.randint(0, model.config.vocab_size, (2,), generator=g).to(model.device)
                eager = model.step(tok, cache, slots).float()
                graph = dec(tok, slots).float()
                err = max(err, ((graph - eager).abs().max() / eager.abs().max()).item())
                eager_all.append(eager.cpu())
        out.append({"err": err, "eager": torch.stack(eager_all)})
    return out


def allreduce_dtypes(comm) -> dict:
    """Sums of a per-rank tensor per dtype and size (under and over the one-shot limit), eager and replayed from a
    CUDA graph, on this rank's GPU; results on the CPU."""
    dev = torch.device("cuda", torch.cuda.current_device())
    out = {}
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for n in (3 * 300, comm.oneshot_max_bytes):  # elements: the second is over the limit at every dtype
            x = torch.randn(n, generator=torch.Generator().manual_seed(comm.rank)).to(dev, dtype)
            out[(str(dtype), n, "eager")] = comm.all_reduce(x.clone()).cpu()
            y = x.clone()
            comm.all_reduce(y.clone())  # warm-up outside the capture (NCCL sets up its buffers)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                z = comm.all_reduce(y)
            graph.replay()
            torch.cuda.synchronize()
            out[(str(dtype), n, "graph")] = z.cpu()
    out["oneshot"] = comm._symm is not None
    return out


def peer_hangs(comm):
    """Rank 1 never joins the collective; rank 0's all-reduce must time out."""
    import time

    if comm.rank == 1:
        time.sleep(600)
    comm.all_reduce(torch.ones(4))


def rank_stalls(comm):
    """Rank 0 stalls outside any collective; its watchdog must end it."""
    import time

    from ssmq.runtime.tp_launch import Watchdog

    if comm.rank == 0:
        with Watchdog(2.0, comm.rank):
            time.sleep(600)
    comm.all_reduce(torch.ones(4))


def allreduce_payloads(comm) -> dict:
    """The sum of a per-rank tensor with every payload; ranks must agree bit for bit."""
    g = torch.Generator().manual_seed(comm.rank)
    x = torch.randn(3, 300, generator=g)
    out = {}
    for payload in ("none", "bf16", "int8"):
        comm.payload = payload
        out[payload] = comm.all_reduce(x.clone())
    comm.payload = "none"
    return out


def peer_dies(comm):
    """Rank 1 exits before the collective; rank 0's all-reduce must fail, not hang."""
    import os

    if comm.rank == 1:
        os._exit(3)
    comm.all_reduce(torch.ones(4))
