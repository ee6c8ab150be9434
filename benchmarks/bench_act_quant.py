"""Fused activation quantization (``SSMQ_FUSED_ACT_QUANT``): the producer of an A8 linear's input emits its int8
codes (residual + RMSNorm + quantize, gated RMSNorm + quantize, online Hadamard + quantize) instead of a float
output that a stand-alone quantize kernel reads again.

    python benchmarks/bench_act_quant.py [--recipes quamba2-w8a8,static-w8a8] [--batches 1,128] [--out DIR]

1. Micro: each fused op vs its unfused pair (float op, then ``kernels.quantize_act``; for the Hadamard the two
   GEMMs of ``hadamard_transform_gemm``; for Quamba2's out_proj input gated norm + Hadamard + quantize vs the
   one kernel of ``rmsnorm_gated_quant(rotate=True)``), CUDA-graph replays, at Mamba2-2.7B widths (d_model 2560, d_inner 5120)
   for 1, 128 and 1024 rows; the Hadamard kernel at each num_warps of --warps (a launch-setting sweep).
2. End to end: Mamba2-2.7B, random fp16 weights, quantized by each recipe (static scales calibrated on random
   tokens), TPOT from CUDA-graph decode replays with the fusion off and on (graphs captured for each setting),
   and eager TTFT of --prompt-len tokens.
3. ``--profile``: the kernels of one eager decode step at batch 1, fusion off and on (``bench_e2e.profile_step``).
Writes act_quant.json (after each part) and act_quant.png to --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_e2e import profile_step, time_ms  # noqa: E402
from published_configs import PUBLISHED  # noqa: E402
from random_model import random_model  # noqa: E402

from ssmq import kernels  # noqa: E402
from ssmq.kernels import policy  # noqa: E402
from ssmq.prototype import hadamard_quant  # noqa: E402
from ssmq.ops.hadamard import hadamard_transform_gemm  # noqa: E402
from ssmq.quant import CalibrationData, quantize  # noqa: E402
from ssmq.runtime.cuda_graph import CudaGraphDecoder  # noqa: E402


def graph_ms(fn, reps: int = 20) -> float:
    """Median time of fn() in ms as a CUDA-graph replay of ``reps`` calls (launch overhead as in graph decode)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    return time_ms(g.replay, warmup=2, reps=10) / reps


def micro(args) -> dict:
    hk = hadamard_quant
    out = {}
    d_model, d_inner = 2560, 5120
    for rows in map(int, args.micro_rows.split(",")):
        x = torch.randn(rows, d_model, device="cuda", dtype=torch.float16)
        res = torch.randn(rows, d_model, device="cuda", dtype=torch.float32)
        w = torch.ones(d_model, device="cuda", dtype=torch.float16)
        y = torch.randn(rows, d_inner, device="cuda", dtype=torch.float16)
        z = torch.randn(rows, d_inner, device="cuda", dtype=torch.float16)
        wi = torch.ones(d_inner, device="cuda", dtype=torch.float16)
        s = torch.tensor(0.02, device="cuda")
        r = {}
        for name, scale in (("static", s), ("dynamic", None)):
            r[f"rms_norm+quantize_{name}_us"] = 1e3 * graph_ms(
                lambda: kernels.quantize_act(kernels.rms_norm(x, w, 1e-5, res)[0], scale))
            r[f"rms_norm_quant_{name}_us"] = 1e3 * graph_ms(lambda: kernels.rms_norm_quant(x, w, 1e-5, res, True, scale))
            r[f"gated_norm+quantize_{name}_us"] = 1e3 * graph_ms(
                lambda: kernels.quantize_act(kernels.rmsnorm_gated(y, wi, z, 1e-5, None), scale))
            r[f"gated_norm_quant_{name}_us"] = 1e3 * graph_ms(
                lambda: kernels.rmsnorm_gated_quant(y, wi, z, 1e-5, None, False, scale))
            r[f"hadamard_gemm+quantize_{name}_us"] = 1e3 * graph_ms(
                lambda: kernels.quantize_act(hadamard_transform_gemm(y), scale))
            # Quamba2's out_proj input: gated norm, Hadamard GEMMs, quantize (three ops, four launches) vs one kernel
            r[f"gated_norm+hadamard_gemm+quantize_{name}_us"] = 1e3 * graph_ms(
                lambda: kernels.quantize_act(hadamard_transform_gemm(kernels.rmsnorm_gated(y, wi, z, 1e-5)), scale))
            for wps in map(int, args.warps.split(",")):
                hk.CFG["warps"] = wps
                r[f"hadamard_quant_{name}_w{wps}_us"] = 1e3 * graph_ms(lambda: hk.hadamard_quant(y, scale))
                r[f"gated_hadamard_quant_{name}_w{wps}_us"] = 1e3 * graph_ms(
                    lambda: hk.rmsnorm_gated_hadamard_quant(y, wi, z, 1e-5, None, False, scale))
            hk.CFG["warps"] = 4
        out[rows] = {k: round(v, 2) for k, v in r.items()}
        print("micro", rows, json.dumps(out[rows]), flush=True)
    return out


def tpot(model, batches, steps) -> dict:
    out = {}
    for bs in batches:
        dec = CudaGraphDecoder(model, max_batch=bs, max_seqlen=steps + 64, buckets=(bs,))
        dec(torch.randint(0, 50000, (bs,), device="cuda"), torch.arange(bs, device="cuda"))
        graph = dec.graphs[bs][0]

        def run():
            for _ in range(steps):
                graph.replay()

        out[f"tpot_b{bs}_ms"] = round(time_ms(run, warmup=1, reps=5) / steps, 4)
        del dec, graph
        gc.collect()
        torch.cuda.empty_cache()
    return out


def e2e(args, results, save) -> None:
    batches = [int(b) for b in args.batches.split(",")]
    for recipe in args.recipes.split(","):
        gc.collect()
        torch.cuda.empty_cache()
        t0 = time.time()
        model = random_model(PUBLISHED[args.model], dtype=torch.float16)
        calib = CalibrationData(torch.randint(0, 50000, (2, 256)), source="random tokens", seed=0)
        quantize(model, recipe, calib, progress=False)
        entry = results["e2e"].setdefault(recipe, {"quantize_s": round(time.time() - t0, 1)})
        ids = torch.randint(0, 50000, (1, args.prompt_len), device="cuda")
        for fused in (False, True):
            policy.set_policy(policy.KernelPolicy(act_quant_fusion=fused))
            key = "fused" if fused else "unfused"
            with torch.inference_mode():
                cache = model.allocate_cache(1, args.prompt_len + 1)
                r = {f"ttft_{args.prompt_len}_eager_ms": round(time_ms(
                    lambda: model(ids, cache, [0], num_last_tokens=1).argmax(-1), setup=cache.reset), 3)}
                del cache
                r.update(tpot(model, batches, args.steps))
                if args.profile:
                    r["profile_b1"] = profile_step(model, 1, top=args.top)
            entry[key] = r
            print(recipe, key, json.dumps({k: v for k, v in r.items() if k != "profile_b1"}), flush=True)
            save()
        policy.set_policy(policy.KernelPolicy())
        del model


def plot(results, out: Path) -> None:
    from plotting import pyplot

    plt = pyplot()
    e = results.get("e2e", {})
    keys = sorted({k for rec in e for s in ("unfused", "fused") for k in e[rec].get(s, {}) if k.startswith("tpot")})
    if not keys:
        return
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.5), squeeze=False)
    for ax, k in zip(axes[0], keys):
        recs = list(e)
        for i, s in enumerate(("unfused", "fused")):
            ax.bar([j + 0.4 * i for j in range(len(recs))], [e[r].get(s, {}).get(k, 0) for r in recs], 0.4, label=s)
        ax.set_xticks([j + 0.2 for j in range(len(recs))], recs)
        ax.set_title(k.replace("_", " "))
        ax.set_ylabel("ms")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "act_quant.png", dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mamba2-2.7b")
    ap.add_argument("--recipes", default="quamba2-w8a8,static-w8a8")
    ap.add_argument("--batches", default="1,128")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--micro-rows", default="1,128,1024")
    ap.add_argument("--warps", default="2,4,8")
    ap.add_argument("--no-micro", action="store_true")
    ap.add_argument("--no-e2e", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--out", default=os.environ.get("OUT", "out/act_quant"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"device": torch.cuda.get_device_name(), "model": args.model, "micro": {}, "e2e": {}}

    def save():
        (out / "act_quant.json").write_text(json.dumps(results, indent=1))

    if not args.no_micro:
        results["micro"] = micro(args)
        save()
    if not args.no_e2e:
        e2e(args, results, save)
    save()
    plot(results, out)


if __name__ == "__main__":
    main()
