"""Accuracy cost of the quantized tensor-parallel all-reduce: WikiText-2 perplexity and top-1 agreement.

    torchrun --nproc_per_node 2 benchmarks/tp_allreduce_accuracy.py --out benchmarks/results/tp   (CPU: gloo)

Each reference model (../shared/models) is sharded once per rank (float32); the same windows are scored
with the all-reduce payload unquantized, bf16 (the paper's FP32 -> FP16 idea) and int8 with one scale per
128 values. Top-1 agreement: the share of positions whose argmax token equals the unquantized run's.
Writes allreduce_accuracy.json and .md to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from ssmq.eval.perplexity import wikitext2_path, windows
from ssmq.paths import shared_path
from ssmq.runtime.tp_comm import Communicator
from ssmq.runtime.tp_launch import init_tp, load_tp_model
from ssmq.tokenizer import load_tokenizer


@torch.no_grad()
def score(model, w: torch.Tensor, batch: int):
    nll, n, top1 = 0.0, 0, []
    for i in range(0, len(w), batch):
        x = w[i:i + batch]
        logits = model(x).float()
        nll += F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten(), reduction="sum").item()
        n += x[:, 1:].numel()
        top1.append(logits.argmax(-1))
    return math.exp(nll / n), torch.cat(top1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mamba2,mamba1,hybrid")
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--out", default=os.environ.get("OUT", "out/tp"))
    args = ap.parse_args()
    world = int(os.environ["WORLD_SIZE"])
    rank, world, device = init_tp(world, device="cpu")
    torch.set_num_threads(1)
    comm = Communicator(mode="nccl")
    text = wikitext2_path().read_text(encoding="utf-8")
    rows = []
    for name in args.models.split(","):
        path = shared_path("models", name)
        if path is None:
            continue
        w = windows(load_tokenizer(path).encode(text), args.seqlen, args.windows)
        model = load_tp_model(path, comm, dtype=torch.float32, device="cpu")
        base = None
        for payload in ("none", "bf16", "int8"):
            comm.payload = payload
            ppl, top1 = score(model, w, args.batch)
            base = top1 if base is None else base
            rows.append({"model": name, "tp": world, "payload": payload, "ppl": ppl,
                         "top1_agreement": (top1 == base).float().mean().item(), "positions": top1.numel(),
                         "seqlen": args.seqlen, "windows": len(w)})
            if rank == 0:
                print(json.dumps(rows[-1]), flush=True)
    if rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "allreduce_accuracy.json").write_text(json.dumps(rows, indent=1))
        md = ["| model | TP | all-reduce payload | WikiText-2 ppl | top-1 agreement |", "|---|---|---|---|---|"]
        md += [f"| {r['model']} | {r['tp']} | {r['payload']} | {r['ppl']:.3f} | {100 * r['top1_agreement']:.2f}% |"
               for r in rows]
        (out / "allreduce_accuracy.md").write_text("\n".join(md) + "\n")
        print("\n".join(md))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
