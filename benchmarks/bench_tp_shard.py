"""One rank's share of a tensor-parallel decode step, timed alone on one GPU: the shard's kernels, no collectives.

    python benchmarks/bench_tp_shard.py --models mamba2-2.7b,mamba2-8b --recipes fp16,quamba2-w8a8 \
        --tp 1,2,4 --batches 1,128,1024 --out DIR

Each model is sharded as rank 0 of t ranks with a communicator whose collectives move nothing (an all-reduce
returns its input, an all-gather repeats it), and its CUDA-graph decode step is timed (random weights at the
published configs, as ``bench_tp.py`` builds them). Set beside ``bench_tp.py``'s TP=t step of the same model,
batch and GPU kind, this splits the TP step into the shard's compute (this) and communication plus waiting for
the slowest rank (the rest). ``floor_ms`` is the step's bytes over the measured copy bandwidth: the weights of
the shard once, the shard's recurrent state read and written once per sequence.
Writes tp_shard.json / .md / .png to --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_e2e import copy_bandwidth, model_bytes, profile_step, time_ms  # noqa: E402
from bench_tp import decode_ms, quantized_model  # noqa: E402
from plotting import pyplot  # noqa: E402
from published_configs import PUBLISHED  # noqa: E402
from random_model import random_model  # noqa: E402


@dataclass
class NoComm:
    """Rank 0 of ``world`` ranks whose collectives move nothing: the shapes of a TP=world shard, none of its
    communication (the partial sums it would add up stand for the sums)."""

    world: int
    rank: int = 0
    counting: bool = False
    counts: Counter = field(default_factory=Counter)

    def all_reduce(self, x, name="all_reduce", exact_cols=0):
        return x

    def all_reduce_max(self, x, name="all_reduce_max"):
        return x

    def all_gather(self, x, name="all_gather"):
        return torch.cat([x] * self.world, dim=-1)


def shard_rows(name: str, recipe: str, t: int, batches, steps: int, dtype, bw: float, profile: bool,
               gemv: list | None = None) -> list[dict]:
    """Decode rows of one shard; ``gemv`` (a list) gets the GEMV rows at its linears' shapes."""
    cfg = PUBLISHED[name]
    comm = NoComm(t) if t > 1 else None
    model = random_model(cfg, dtype=dtype, comm=comm) if recipe == "fp16" else quantized_model(cfg, recipe, comm, dtype)
    weights, state = model_bytes(model)
    if gemv is not None:
        gemv += gemv_rows(model, name, t, bw, dtype)
    rows = []
    for bs in batches:
        ms = decode_ms(model, bs, steps, timer=time_ms)  # one process: no barrier
        floor = (weights + 2 * bs * state) / bw * 1e3
        rows.append({"model": name, "recipe": recipe, "tp": t, "batch": bs, "shard_ms": ms, "floor_ms": floor,
                     "weight_gib": weights / 2**30, "state_mib_per_seq": state / 2**20})
        if profile and bs == 1:  # one eager step's kernels: where the shard's batch-1 time goes
            rows[-1]["kernels"] = profile_step(model, 1, top=8)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return rows


# launch configurations of the decode GEMV tried at each shard's shapes (None: the shipped heuristic)
GEMV_VARIANTS = {"default": None, "waves4": {"WAVES": 4}, "waves8": {"WAVES": 8},
                 "tile4096_w4": {"TILE_FMA": 4096, "warps_fma": 4}, "stages2": {"stages_fma": 2},
                 "bk512": {"BK_FMA": 512}}


def gemv_rows(model, name: str, t: int, bw: float, dtype) -> list[dict]:
    """Batch-1 ``linear_decode`` at the shapes of the first layer's linears in this shard, per launch variant, and
    cuBLAS; the weight cycled over copies 4x the L2 size (decode reads every layer's weight from HBM), all the calls
    in one CUDA graph."""
    from bench_kernels import l2_bytes  # here: it imports every Triton kernel module

    from ssmq.kernels.gemv import linear_decode

    l2 = l2_bytes()
    out = []
    linears = [(n, m.weight) for n, m in model.layers[0].named_modules()
               if isinstance(m, nn.Linear) and m.weight.dtype == dtype]
    for lname, w in linears:
        n, k = w.shape
        copies = max(1, -(-4 * l2 // (n * k * w.element_size())))
        ws = [torch.randn(n, k, device="cuda", dtype=dtype) for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=dtype)
        for vname, cfg in {**GEMV_VARIANTS, "cublas": "cublas"}.items():
            def calls(cfg=cfg):
                for wi in ws:
                    F.linear(x, wi) if cfg == "cublas" else linear_decode(x, wi, cfg=cfg)
            calls()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()  # replayed: the launches' host time would hide the kernels' (~us)
            with torch.cuda.graph(graph):
                calls()
            ms = time_ms(graph.replay, warmup=3, reps=20) / copies
            out.append({"model": name, "tp": t, "linear": lname, "n": n, "k": k, "variant": vname,
                        "us": 1e3 * ms, "floor_us": 1e6 * n * k * w.element_size() / bw})
            del graph
        del ws
    return out


def markdown(rows, bw: float) -> str:
    lines = [f"Copy bandwidth {bw / 1e12:.2f} TB/s (read + write). floor = (shard weights + 2 x batch x shard state)"
             " / bandwidth.", "",
             "| model | recipe | TP | batch | shard step ms | floor ms | floor / step | weights GiB / GPU |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['recipe']} | {r['tp']} | {r['batch']} | {r['shard_ms']:.3f} | "
                     f"{r['floor_ms']:.3f} | {r['floor_ms'] / r['shard_ms']:.0%} | {r['weight_gib']:.2f} |")
    return "\n".join(lines) + "\n"


def gemv_markdown(rows) -> str:
    variants = [*GEMV_VARIANTS, "cublas"]
    lines = ["", "Batch-1 GEMV at the shard's shapes, us (floor: weight bytes / copy bandwidth)", "",
             "| model | TP | linear | N x K | floor us | " + " | ".join(variants) + " |",
             "|---|---|---|---|---|" + "---|" * len(variants)]
    keys = sorted({(r["model"], r["tp"], r["linear"], r["n"], r["k"], r["floor_us"]) for r in rows})
    for model, t, lname, n, k, floor in keys:
        us = {r["variant"]: r["us"] for r in rows if (r["model"], r["tp"], r["linear"]) == (model, t, lname)}
        lines.append(f"| {model} | {t} | {lname} | {n} x {k} | {floor:.1f} | "
                     + " | ".join(f"{us[v]:.1f}" if v in us else "-" for v in variants) + " |")
    return "\n".join(lines) + "\n"


def plot(rows, path) -> None:
    plt = pyplot()
    if plt is None:
        return
    keys = sorted({(r["model"], r["recipe"]) for r in rows})
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4), squeeze=False)
    for ax, (model, recipe) in zip(axes[0], keys):
        for bs in sorted({r["batch"] for r in rows}):
            pts = sorted((r["tp"], r["shard_ms"], r["floor_ms"]) for r in rows
                         if (r["model"], r["recipe"], r["batch"]) == (model, recipe, bs))
            if not pts:
                continue
            tps, ms, floor = zip(*pts)
            line, = ax.plot(tps, ms, marker="o", label=f"batch {bs}")
            ax.plot(tps, floor, ls="--", color=line.get_color())
            ax.plot(tps, [ms[0] / t for t in tps], ls=":", color=line.get_color())
        ax.set(xscale="log", yscale="log", xlabel="TP degree (one shard)", ylabel="decode step ms",
               title=f"{model} {recipe}\n(dashed: bytes / bandwidth, dotted: 1 GPU / t)")
        ax.set_xticks(sorted({r["tp"] for r in rows}), labels=[str(t) for t in sorted({r["tp"] for r in rows})])
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mamba2-2.7b,mamba2-8b")
    ap.add_argument("--recipes", default="fp16")
    ap.add_argument("--tp", default="1,2,4", help="shard degrees")
    ap.add_argument("--batches", default="1,128,1024")
    ap.add_argument("--steps", type=int, default=16, help="decode steps per timing")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--profile", action="store_true", help="kernels of one eager batch-1 step per shard")
    ap.add_argument("--gemv", action="store_true", help="time the batch-1 GEMV's launch variants at the float "
                    "shards' linear shapes")
    ap.add_argument("--budget-s", type=float, default=300.0, help="skip the remaining rows after this long")
    ap.add_argument("--out", default="out/tp_shard")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    bw = copy_bandwidth()
    batches = [int(b) for b in a.batches.split(",")]
    jobs = [(m, r, int(t)) for r in a.recipes.split(",") for m in a.models.split(",") for t in a.tp.split(",")]
    rows, gemv, skipped, start = [], [], [], time.monotonic()
    for name, recipe, t in tqdm(jobs, desc="shards"):
        if time.monotonic() - start > a.budget_s:
            skipped.append(f"{name} {recipe} TP={t}")
            continue
        rows += shard_rows(name, recipe, t, batches, a.steps, getattr(torch, a.dtype), bw, a.profile,
                           gemv if a.gemv and recipe == "fp16" else None)
        (out / "tp_shard.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "copy_bw": bw,
                                                       "rows": rows, "gemv": gemv, "skipped": skipped}, indent=1))
    md = markdown(rows, bw) + (gemv_markdown(gemv) if gemv else "")
    md += f"\nSkipped (time budget): {', '.join(skipped)}\n" if skipped else ""
    (out / "tp_shard.md").write_text(md)
    plot(rows, out / "tp_shard.png")
    print(md)


if __name__ == "__main__":
    main()
