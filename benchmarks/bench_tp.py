"""Tensor-parallel speed on N GPUs of one host (random weights at published configs), one torchrun job.

    torchrun --nproc_per_node N benchmarks/bench_tp.py --out $OUT        (benchmarks/device_tp.sh runs it)

Rows (each in its own try/except; the ranks agree on every row's outcome, so one failing row never
desynchronises the collectives of the next):
  allreduce     latency of one all-reduce of (b, d) bf16 (and the fused norm's (b, d + 1) float32) by
                message size: NCCL vs the one-shot symmetric-memory path, eager and inside a CUDA graph
                (mean of 64 calls in one graph), and the bf16 / int8-payload quantized all-reduce (eager)
  decode        CUDA-graph decode step time and tokens/s vs batch for: one GPU (every rank runs the whole
                model independently at the same time: rank 0's figure), data-parallel N (the N independent
                runs together: N x batch, summed tokens/s), and TP=N; per --recipes (fp16 and / or quantized
                random weights: each rank quantizes the same model, then shards it in memory)
  ttft          prefill of one 1024 / 4096-token prompt to the first token (CUDA graphs of binary pieces)
  capacity      the largest decode batch whose cache and one step fit at context --capacity-ctx
                (a pure Mamba model's state does not grow with context)
  variants      TP decode with the gated norm fused into out_proj's all-reduce (1 per block) vs not (2),
                NCCL-only vs auto (one-shot for small messages), int8-payload all-reduce, the sharded gated
                norm as torch references instead of its Triton kernels (--variants picks)
A global budget (--budget-s) skips the remaining rows (recorded as skipped) so the job ends in time.
Writes tp.json (rows as they come), tp.md and tp.png to --out; prints the table at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_e2e import model_bytes, profile_step, time_ms as e2e_time_ms  # noqa: E402
from published_configs import PUBLISHED  # noqa: E402
from bench_quant import build as build_quantized  # noqa: E402
from random_model import random_model  # noqa: E402

from ssmq.runtime.cuda_graph import CudaGraphDecoder, CudaGraphPrefill  # noqa: E402
from ssmq.runtime.tp import apply_tp  # noqa: E402
from ssmq.runtime.tp_comm import Communicator  # noqa: E402
from ssmq.runtime.tp_launch import init_tp  # noqa: E402
from plotting import pyplot  # noqa: E402

DTYPE = torch.bfloat16  # the all-reduce rows' payload


def time_ms(fn, warmup=2, reps=7) -> float:
    """bench_e2e's CUDA-event median, the ranks starting each call together (a TP step waits for the slowest)."""
    return e2e_time_ms(fn, warmup, reps, setup=lambda: (dist.barrier(), torch.cuda.synchronize()))


class Bench:
    def __init__(self, args, rank, world):
        self.args, self.rank, self.world = args, rank, world
        self.rows: list[dict] = []
        self.start = time.monotonic()
        self.out = Path(args.out)
        if rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)

    def left_s(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.start)

    def row(self, fields: dict, fn) -> dict | None:
        """Run fn() -> dict on every rank; all ranks agree on success; rank 0 records fields + result."""
        go = torch.tensor([1.0 if self.left_s() > 0 else 0.0], device="cuda")
        dist.broadcast(go, 0)
        if go.item() == 0:
            rec = {**fields, "status": "skipped: time budget"}
            self._record(rec)
            return None
        t0 = time.monotonic()
        try:
            result, err = fn(), None
        except Exception as e:  # noqa: BLE001 - a row failing is a result, not the end of the run
            result, err = None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            if self.rank == 0:
                traceback.print_exc()
        gc.collect()
        torch.cuda.empty_cache()
        ok = torch.tensor([0.0 if err else 1.0], device="cuda")
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        rec = {**fields, **(result or {}), "status": "ok" if ok.item() == 1 else (err or "failed on another rank"),
               "seconds": round(time.monotonic() - t0, 1)}
        self._record(rec)
        return rec if rec["status"] == "ok" else None

    def _record(self, rec):
        if self.rank == 0:
            self.rows.append(rec)
            print(json.dumps(rec), flush=True)
            (self.out / "tp.json").write_text(json.dumps({"world": self.world, "rows": self.rows,
                                                          "gpu": torch.cuda.get_device_name(),
                                                          "torch": torch.__version__}, indent=1))


# ---------------------------------------------------------------------------------------------
# all-reduce latency
# ---------------------------------------------------------------------------------------------
def allreduce_rows(bench: Bench, comms: dict, d_models, batches):
    for d in d_models:
        for b in batches:
            for dtype, extra in ((DTYPE, 0), (torch.float32, 1)):
                x = torch.randn(b, d + extra, device="cuda", dtype=dtype)
                nbytes = x.numel() * x.element_size()
                for name, comm in comms.items():
                    if comm is None:
                        continue
                    for graph in (False, True):
                        if graph and comm.payload != "none":
                            continue
                        fields = {"kind": "allreduce", "d": d + extra, "batch": b, "dtype": str(dtype)[6:],
                                  "bytes": nbytes, "mode": name, "graph": graph}
                        bench.row(fields, lambda: {"us": allreduce_us(comm, x, graph)})


def allreduce_us(comm, x, graph: bool, calls: int = 64) -> float:
    if not graph:
        return 1e3 * time_ms(lambda: comm.all_reduce(x.clone()), warmup=3, reps=21)
    static = x.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            comm.all_reduce(static.clone())
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = static
        for _ in range(calls):
            y = comm.all_reduce(y * 0.5)
    return 1e3 * time_ms(g.replay, warmup=2, reps=11) / calls


# ---------------------------------------------------------------------------------------------
# model rows
# ---------------------------------------------------------------------------------------------
def decode_ms(model, bs: int, steps: int, timer=None) -> float:
    """Mean CUDA-graph decode step at batch ``bs`` over ``steps`` replays; ``timer`` (default: the ranks starting
    together) as ``bench_e2e.time_ms``."""
    dec = CudaGraphDecoder(model, max_batch=bs, max_seqlen=steps + 64, buckets=(bs,))
    tokens = torch.randint(0, 1000, (bs,), device="cuda")
    dec(tokens, torch.arange(bs, device="cuda"))
    graph = dec.graphs[bs][0]

    def run():
        for _ in range(steps):
            graph.replay()

    ms = (timer or time_ms)(run, warmup=1, reps=5) / steps
    del dec, graph
    return ms


def ttft_ms(model, L: int) -> float:
    ids = torch.randint(0, 1000, (1, L), device="cuda")
    cache = model.allocate_cache(2, L + 1)
    prefill = CudaGraphPrefill(model, cache, max_len=L)

    def run():  # a fresh slot each time: the prompt fills the cache, a second prefill into it would not fit
        cache.reset([0])
        return prefill(ids, 0).argmax(-1)

    ms = time_ms(run, warmup=1, reps=5)
    del prefill, cache
    return ms


def max_batch(model, ctx: int, start: int, limit: int) -> int:
    """Largest power-of-two multiple of ``start`` whose cache (ctx tokens) and one eager step fit."""
    best, bs = 0, start
    while bs <= limit:
        ok = True
        try:
            cache = model.allocate_cache(bs, ctx)
            with torch.inference_mode():
                model.step(torch.zeros(bs, dtype=torch.long, device="cuda"), cache)
            torch.cuda.synchronize()
            del cache
        except torch.OutOfMemoryError:
            ok = False
        gc.collect()
        torch.cuda.empty_cache()
        flag = torch.tensor([1.0 if ok else 0.0], device="cuda")
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if flag.item() == 0:
            break
        best, bs = bs, bs * 2
    return best


def gather(value: float) -> list[float]:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def quantized_model(cfg, recipe: str, comm, dtype):
    """A random model quantized by ``recipe`` on this rank's GPU (bench_quant's build: GPTQ weights rounded to
    nearest, static scales from random tokens), then sharded for ``comm`` in memory as ``apply_tp`` shards a loaded
    checkpoint; every rank quantizes the same seeded model, so the shards are those of one quantized model."""
    model, _ = build_quantized(cfg, recipe, dtype, via_disk=False, weights_rtn=True)
    if comm is not None:
        apply_tp(model, comm)
    return model


def model_rows(bench: Bench, name: str, recipe: str, tp_comms: dict, comm_nccl, comm_int8):
    """tp_comms: mode -> communicator; "tp" spans every rank, "tp{t}" a group of t ranks (world / t groups at once)."""
    a = bench.args
    cfg = PUBLISHED[name]
    comm_auto = tp_comms["tp"]
    batches = [int(b) for b in a.batches.split(",")] if "decode" in a.kinds else []
    W = bench.world
    dtype = getattr(torch, a.dtype)
    label = name if recipe == "fp16" else f"{name} {recipe}"
    for mode in ("single", *tp_comms):
        comm = tp_comms.get(mode)
        t = comm.world if comm is not None else 1
        fields = {"model": label, "mode": mode, "tp": t}
        model = None

        def build():
            nonlocal model
            model = (random_model(cfg, dtype=dtype, comm=comm) if recipe == "fp16"
                     else quantized_model(cfg, recipe, comm, dtype))
            return {"weight_gib_per_gpu": model_bytes(model)[0] / 2**30}

        if bench.row({**fields, "kind": "build"}, build) is None:
            continue
        for bs in batches:
            def dec():
                ms = decode_ms(model, bs, a.steps)
                if t < W:  # W / t groups (one rank each for "single") ran at the same time: data-parallel W / t
                    per_rank = gather(bs / ms * 1e3)
                    return {"tpot_ms": ms, "tok_s": per_rank[0], "dp_batch": W // t * bs,
                            "dp_tok_s": sum(per_rank[::t])}  # the groups are consecutive ranks: one leader each
                return {"tpot_ms": ms, "tok_s": bs / ms * 1e3}
            bench.row({**fields, "kind": "decode", "batch": bs}, dec)
        if a.profile:  # where a batch-1 step's time goes: rank 0's kernels (every rank steps: the all-reduces)
            bench.row({**fields, "kind": "profile"},
                      lambda: {"kernels": profile_step(model, 1, top=20 if bench.rank == 0 else 0)})
        for L in (1024, 4096) if "ttft" in a.kinds else ():
            bench.row({**fields, "kind": "ttft", "prompt": L}, lambda: {"ttft_ms": ttft_ms(model, L)})
        if "capacity" in a.kinds:
            bench.row({**fields, "kind": "capacity", "ctx": a.capacity_ctx},
                      lambda: {"max_batch": max_batch(model, a.capacity_ctx, 256, a.capacity_limit)})
        del model
        gc.collect()
        torch.cuda.empty_cache()
    # TP variants at small batches: fused norm off, NCCL only, int8 payload; the sharded gated norm as the torch
    # references (the per-op glue it was before its Triton kernels), fused and two-all-reduce
    variants = {"two_allreduces": (comm_auto, False, False), "nccl_only": (comm_nccl, True, False),
                "int8_payload": (comm_int8, True, False), "torch_norm": (comm_auto, True, True),
                "torch_norm_two_allreduces": (comm_auto, False, True)}
    for vname in a.variants.split(",") if "variants" in a.kinds and recipe == "fp16" else ():
        comm, fuse, torch_norm = variants[vname]
        if comm is None:
            continue
        model = None

        def build_v():
            nonlocal model
            model = random_model(cfg, dtype=dtype, comm=comm, fuse_norm=fuse)
            return {"all_reduces_per_token": model.tp.all_reduces_per_token}

        if bench.row({"model": name, "mode": f"tp:{vname}", "kind": "build"}, build_v) is None:
            continue
        with sharded_norm_as_references(torch_norm):
            for bs in [int(b) for b in a.variant_batches.split(",")]:
                bench.row({"model": name, "mode": f"tp:{vname}", "kind": "decode", "batch": bs},
                          lambda: {"tpot_ms": decode_ms(model, bs, a.steps), "tok_s": None})
            if a.profile and torch_norm:
                bench.row({"model": name, "mode": f"tp:{vname}", "kind": "profile"},
                          lambda: {"kernels": profile_step(model, 1, top=20 if bench.rank == 0 else 0)})
        del model
        gc.collect()
        torch.cuda.empty_cache()


SHARDED_NORM_KERNELS = ("rmsnorm_gated_partial", "rmsnorm_gated_reduced", "rstd_scale")  # no dispatch: ops.norm twins


@contextlib.contextmanager
def sharded_norm_as_references(on: bool):
    """While on, ``ssmq.runtime.tp`` runs the sharded gated norm's torch references instead of its Triton kernels."""
    from ssmq import kernels
    from ssmq.ops import norm as ref

    saved = {n: getattr(kernels, n) for n in SHARDED_NORM_KERNELS}
    if on:
        for n in SHARDED_NORM_KERNELS:
            setattr(kernels, n, getattr(ref, f"{n}_ref"))
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(kernels, n, f)


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------
def markdown(rows, world) -> str:
    ok = [r for r in rows if r.get("status") == "ok"]
    dec = {(r["model"], r["mode"], r["batch"]): r for r in ok if r["kind"] == "decode"}
    tp_modes = sorted({m for _, m, _ in dec if m == "tp" or m[2:].isdigit()}, key=lambda m: (m == "tp", m))
    deg = {m: world if m == "tp" else int(m[2:]) for m in tp_modes}
    head = "".join(f" TP={deg[m]} ms | TP={deg[m]} tok/s | TP={deg[m]} / 1 GPU |"
                   + (f" TP={deg[m]} x DP={world // deg[m]} tok/s |" if m != "tp" else "") for m in tp_modes)
    lines = [f"## Decode (CUDA graphs), {world} GPUs", "",
             f"| model | batch | 1 GPU ms | 1 GPU tok/s | DP={world} batch | DP={world} tok/s |{head}",
             "|---|---|---|---|---|---|" + "".join("---|" * (3 if m == "tp" else 4) for m in tp_modes)]
    for (model, mode, bs), r in sorted(dec.items()):
        if mode != "single":
            continue
        cells = ""
        for m in tp_modes:
            t = dec.get((model, m, bs), {})
            ratio = f"{t['tok_s'] / r['tok_s']:.2f}x" if t.get("tok_s") else "-"
            cells += f" {t.get('tpot_ms', float('nan')):.3f} | {t.get('tok_s') or 0:.0f} | {ratio} |"
            cells += f" {t.get('dp_tok_s') or 0:.0f} |" if m != "tp" else ""
        lines.append(f"| {model} | {bs} | {r['tpot_ms']:.3f} | {r['tok_s']:.0f} | {r['dp_batch']} | "
                     f"{r['dp_tok_s']:.0f} |{cells}")
    lines += ["", "## TTFT and capacity", "", "| model | mode | TTFT 1024 ms | TTFT 4096 ms | max batch |", "|---|---|---|---|---|"]
    for model in sorted({r["model"] for r in ok if "model" in r}):
        for mode in ("single", *tp_modes):
            get = lambda kind, key, **kw: next((r[key] for r in ok if r.get("model") == model and r.get("mode") == mode  # noqa: E731
                                                and r["kind"] == kind and all(r.get(k) == v for k, v in kw.items())), None)
            t1, t4, cap = get("ttft", "ttft_ms", prompt=1024), get("ttft", "ttft_ms", prompt=4096), get("capacity", "max_batch")
            f = lambda v: "-" if v is None else f"{v:.1f}" if isinstance(v, float) else str(v)  # noqa: E731
            lines.append(f"| {model} | {mode} | {f(t1)} | {f(t4)} | {f(cap)} |")
    lines += ["", "## TP variants (decode step ms)", "", "| model | variant | batch | ms |", "|---|---|---|---|"]
    for r in ok:
        if r["kind"] == "decode" and r["mode"].startswith("tp:"):
            lines.append(f"| {r['model']} | {r['mode']} | {r['batch']} | {r['tpot_ms']:.3f} |")
    lines += ["", "## All-reduce latency (us)", "", "| bytes | shape | dtype | mode | graph | us |", "|---|---|---|---|---|---|"]
    for r in ok:
        if r["kind"] == "allreduce":
            lines.append(f"| {r['bytes']} | {r['batch']}x{r['d']} | {r['dtype']} | {r['mode']} | {r['graph']} | {r['us']:.1f} |")
    bad = [r for r in rows if r.get("status") != "ok"]
    if bad:
        lines += ["", "## Rows that failed or were skipped", ""]
        lines += [f"- {json.dumps({k: v for k, v in r.items() if k != 'seconds'})}" for r in bad]
    return "\n".join(lines) + "\n"


def bench_world(rows) -> int:
    return max((r["tp"] for r in rows if r.get("mode") == "tp" and "tp" in r), default=0) or "N"


def plot(rows, path):
    plt = pyplot()
    if plt is None:
        return
    ok = [r for r in rows if r.get("status") == "ok"]
    models = sorted({r["model"] for r in ok if r["kind"] == "decode"})
    fig, axes = plt.subplots(1, len(models) + 1, figsize=(5 * (len(models) + 1), 4))
    axes = list(axes) if hasattr(axes, "__len__") else [axes]
    for ax, model in zip(axes, models):
        sub = sorted({r["mode"] for r in ok if r["kind"] == "decode" and r["mode"][2:].isdigit()})
        for mode, key, bkey, label in (("single", "tok_s", "batch", "1 GPU"),
                                       ("single", "dp_tok_s", "dp_batch", f"data-parallel {bench_world(ok)}"),
                                       *((m, "tok_s", "batch", f"TP={m[2:]}") for m in sub),
                                       *((m, "dp_tok_s", "dp_batch", f"TP={m[2:]} x DP") for m in sub),
                                       ("tp", "tok_s", "batch", f"TP={bench_world(ok)}")):
            pts = sorted((r[bkey], r[key]) for r in ok if r["kind"] == "decode" and r["model"] == model and r["mode"] == mode)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=label)
        ax.set(xscale="log", yscale="log", xlabel="batch (total)", ylabel="tokens/s", title=model)
        ax.legend()
    ax = axes[-1]
    for mode in sorted({(r["mode"], r["graph"]) for r in ok if r["kind"] == "allreduce" and r["dtype"] == "bfloat16"}):
        pts = sorted((r["bytes"], r["us"]) for r in ok if r["kind"] == "allreduce" and r["dtype"] == "bfloat16"
                     and (r["mode"], r["graph"]) == mode)
        ax.plot(*zip(*pts), marker=".", label=f"{mode[0]}{' graph' if mode[1] else ''}")
    ax.set(xscale="log", yscale="log", xlabel="bytes", ylabel="us", title="all-reduce (bf16)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def sizes(spec: str, world: int) -> list[int]:
    out = sorted({int(t) for t in spec.split(",") if t})
    bad = [t for t in out if t < 2 or t >= world or world % t]
    if bad:
        raise SystemExit(f"bench_tp.py: --tp-sizes {bad} must divide the world size {world} and lie in [2, {world})")
    return out


def sub_communicator(t: int, mode: str, device) -> Communicator:
    """A communicator over this rank's group of t consecutive ranks (every rank makes every group, as NCCL asks);
    "auto" falls back to NCCL by itself where the group's one-shot buffers cannot be set up."""
    group, _ = dist.new_subgroups(group_size=t)
    return Communicator(group=group, mode=mode, device=device)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mamba2-2.7b,mamba2-8b")
    ap.add_argument("--recipes", default="fp16", help="fp16 and / or quantization recipes (random weights quantized "
                                                      "on each rank, then sharded), e.g. fp16,rtn-w4a16-g128")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"], help="the models' dtype")
    ap.add_argument("--batches", default="1,8,32,128,512,1024")
    ap.add_argument("--steps", type=int, default=32, help="decode steps per timing")
    ap.add_argument("--capacity-ctx", type=int, default=4096)
    ap.add_argument("--capacity-limit", type=int, default=16384)
    ap.add_argument("--ar-batches", default="1,4,16,64,256", help="all-reduce rows' batches ('' for none)")
    ap.add_argument("--kinds", default="decode,ttft,capacity,variants", help="which model rows to run")
    ap.add_argument("--variants", default="two_allreduces,nccl_only,int8_payload,torch_norm",
                    help="TP variants to time (two_allreduces, nccl_only, int8_payload, torch_norm, "
                         "torch_norm_two_allreduces)")
    ap.add_argument("--variant-batches", default="1,32")
    ap.add_argument("--profile", action="store_true", help="kernels of one eager batch-1 decode step per mode")
    ap.add_argument("--tp-sizes", default="", help="tensor-parallel degrees below the world size to time too, e.g. 2 "
                    "on 4 GPUs: world / t groups of t consecutive ranks each run TP=t at once (rank 0's group "
                    "reported, every group's tokens/s summed as data-parallel)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="skip rows once this much time has passed")
    ap.add_argument("--out", default=os.environ.get("OUT", "out/tp"))
    args = ap.parse_args()
    world = int(os.environ["WORLD_SIZE"])
    tp_sizes = sizes(args.tp_sizes, world)  # refused before any GPU work
    rank, world, device = init_tp(world, timeout_s=180)
    torch.cuda.set_device(device)
    torch.manual_seed(0)
    bench = Bench(args, rank, world)
    comms = {"nccl": Communicator(mode="nccl", device=device)}
    try:
        comms["oneshot"] = Communicator(mode="oneshot", device=device)
    except Exception as e:  # noqa: BLE001 - recorded; the NCCL rows still run
        bench._record({"kind": "oneshot_setup", "status": f"{type(e).__name__}: {e}"[:300]})
        comms["oneshot"] = None
    comms["auto"] = Communicator(mode="auto", device=device)
    comms["bf16_payload"] = Communicator(mode="nccl", payload="bf16", device=device)
    comms["int8_payload"] = Communicator(mode="nccl", payload="int8", device=device)
    d_models = sorted({PUBLISHED[m].d_model for m in args.models.split(",")})
    allreduce_rows(bench, {k: comms[k] for k in ("nccl", "oneshot", "int8_payload")}, d_models,
                   [int(b) for b in args.ar_batches.split(",") if b])
    # the model rows use "auto" only if every one-shot row worked (graphs included); rank 0 decides for all
    bad = [r for r in bench.rows if r.get("mode") == "oneshot" and r.get("status") != "ok"] if rank == 0 else []
    flag = torch.tensor([0.0 if comms["oneshot"] is None or bad else 1.0], device="cuda")
    dist.broadcast(flag, 0)
    tp_comm = comms["auto"] if flag.item() == 1 else comms["nccl"]
    bench._record({"kind": "tp_comm", "status": "ok", "mode": "auto" if tp_comm is comms["auto"] else "nccl"})
    tp_comms = {**{f"tp{t}": sub_communicator(t, tp_comm.mode, device) for t in tp_sizes},
                "tp": tp_comm}
    for recipe in args.recipes.split(","):
        for name in args.models.split(","):
            model_rows(bench, name, recipe, tp_comms, comms["nccl"], comms["int8_payload"])
    if rank == 0:
        md = markdown(bench.rows, world)
        (bench.out / "tp.md").write_text(md)
        plot(bench.rows, bench.out / "tp.png")
        print(md, flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
