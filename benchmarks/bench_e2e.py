"""End-to-end speed: TTFT, TPOT and peak memory of ssmq vs mamba_ssm (Triton kernels) and transformers,
and the bandwidth limit of decode, at published configs with random weights.

    python benchmarks/bench_e2e.py --models mamba2-2.7b --out out/e2e [--peers mamba_ssm,hf]

TTFT: prefill of a prompt (batch 1) to the first token's logits, replayed from CUDA graphs of the
prompt's binary pieces (``ttft_*_eager_ms``: the same without graphs). TPOT: one decode step with
CUDA graphs. Limit: (weight bytes + state bytes read and written) / measured copy bandwidth.
Writes e2e.json, e2e.md and e2e.png to --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from published_configs import PUBLISHED, hf_config, mamba_ssm_config_dict  # noqa: E402
from random_model import random_model  # noqa: E402

from ssmq.runtime.cuda_graph import CudaGraphDecoder, CudaGraphPrefill  # noqa: E402
from plotting import pyplot  # noqa: E402


def time_ms(fn, warmup=2, reps=10, setup=None) -> float:
    """Median wall time of fn() in ms, timed with CUDA events; ``setup`` runs untimed before each call."""
    for _ in range(warmup):
        if setup:
            setup()
        fn()
    times = []
    for _ in range(reps):
        if setup:
            setup()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus written."""
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = time_ms(lambda: b.copy_(a), warmup=3, reps=20)
    del a, b
    return 2 * n / (ms / 1e3)


def model_bytes(model) -> tuple[int, int]:
    """(weight bytes: parameters and buffers (quantized codes, scales), recurrent state bytes per sequence, in the
    state format the model decodes on: int8 codes and their row scales for an int8-state recipe)."""
    from ssmq.models.cache import calibrated_ssm_dtype

    w = sum(p.numel() * p.element_size() for p in [*model.parameters(), *model.buffers()])
    cache = model.allocate_cache(1, 1, ssm_dtype=calibrated_ssm_dtype(model))
    s = cache.nbytes()
    del cache
    return w, s


def bench_ssmq(cfg, prompt_lens, batches, dtype, steps) -> dict:
    return bench_model(random_model(cfg, dtype=dtype), prompt_lens, batches, steps)


def bench_model(model, prompt_lens, batches, steps) -> dict:
    """TTFT (eager and graphs), TPOT from graph replays and their peak memory of one model (then freed), on the SSM
    state format the model was calibrated for (an int8-state recipe: the int8 state, as ``ssmq generate`` runs it)."""
    from ssmq.models.cache import calibrated_ssm_dtype

    out = {}
    ssm_dtype = calibrated_ssm_dtype(model)
    for L in prompt_lens:
        ids = torch.randint(0, 50000, (1, L), device="cuda")
        cache = model.allocate_cache(2, L + 1, ssm_dtype=ssm_dtype)  # slot 1 is the graphs' scratch slot
        torch.cuda.reset_peak_memory_stats()
        with torch.inference_mode():
            out[f"ttft_{L}_eager_ms"] = time_ms(lambda: model(ids, cache, [0], num_last_tokens=1).argmax(-1),
                                                setup=cache.reset)
            prefill = CudaGraphPrefill(model, cache, max_len=L)
            out[f"ttft_{L}_ms"] = time_ms(lambda: prefill(ids, 0).argmax(-1), setup=lambda: cache.reset([0]))
        out[f"ttft_{L}_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        del cache, prefill
    for bs in batches:
        torch.cuda.reset_peak_memory_stats()
        dec = CudaGraphDecoder(model, max_batch=bs, max_seqlen=steps + 64, buckets=(bs,), ssm_dtype=ssm_dtype)
        tokens = torch.randint(0, 50000, (bs,), device="cuda")
        slots = torch.arange(bs, device="cuda")
        dec(tokens, slots)
        graph = dec.graphs[bs][0]
        reps = steps

        def run():
            for _ in range(reps):
                graph.replay()

        out[f"tpot_b{bs}_ms"] = time_ms(run, warmup=1, reps=5) / reps
        out[f"tpot_b{bs}_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        del dec
    out["weight_bytes"], out["state_bytes"] = model_bytes(model)
    del model
    torch.cuda.empty_cache()
    return out


def bench_mamba_ssm(cfg, prompt_lens, batches, dtype, steps) -> dict:
    from mamba_ssm.models.config_mamba import MambaConfig
    from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel

    out = {}
    model = MambaLMHeadModel(MambaConfig(**mamba_ssm_config_dict(cfg)), device="cuda", dtype=dtype).eval()
    for L in prompt_lens:
        ids = torch.randint(0, 50000, (1, L), device="cuda")
        with torch.inference_mode():
            out[f"ttft_{L}_ms"] = time_ms(lambda: model(ids, num_last_tokens=1).logits.argmax(-1))
    for bs in batches:
        ids = torch.randint(0, 50000, (bs, 16), device="cuda")

        def gen(n):
            return lambda: model.generate(ids, max_length=16 + n, cg=True, return_dict_in_generate=True,
                                          output_scores=False, enable_timing=False)

        # TPOT from the difference of two generation lengths (prefill and graph capture cancel out), and
        # directly: replays of the decode graph mamba_ssm's generate() captured (its `run`: copy the token in,
        # replay, clone the logits). The direct figure is the one reported: the difference of two host-driven
        # loops once gave a batch-1 TPOT below the weight-bandwidth limit (README, 2026-11-23)
        t_short, t_long = time_ms(gen(1), warmup=1, reps=3), time_ms(gen(1 + steps), warmup=1, reps=3)
        out[f"tpot_b{bs}_generate_ms"] = (t_long - t_short) / steps
        cache = model._decoding_cache
        tok = torch.zeros((bs, 1), dtype=torch.long, device="cuda")
        pos = torch.full((bs, 1), 16, dtype=torch.long, device="cuda")
        with torch.inference_mode():
            out[f"tpot_b{bs}_ms"] = time_ms(lambda: cache.run(tok, pos, 16), warmup=3, reps=20)
    del model
    torch.cuda.empty_cache()
    return out


def bench_hf(cfg, prompt_lens, batches, dtype, steps) -> dict:
    import transformers as tf

    out = {}
    with torch.device("cuda"):
        model = tf.AutoModelForCausalLM.from_config(hf_config(cfg)).to(dtype).eval()  # the family's class
    for L in prompt_lens:
        ids = torch.randint(0, 50000, (1, L), device="cuda")
        with torch.inference_mode():
            out[f"ttft_{L}_ms"] = time_ms(lambda: model(ids, logits_to_keep=1).logits.argmax(-1), warmup=1, reps=3)
    n = min(steps, 16)
    for bs in batches[:1]:  # transformers decodes far slower; batch 1 only
        ids = torch.randint(0, 50000, (bs, 16), device="cuda")

        def gen(k):
            return lambda: model.generate(ids, max_new_tokens=k, min_new_tokens=k, do_sample=False)

        out[f"tpot_b{bs}_ms"] = (time_ms(gen(1 + n), warmup=1, reps=2) - time_ms(gen(1), warmup=1, reps=2)) / n
    del model
    torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mamba2-130m,mamba2-1.3b,mamba2-2.7b,mamba2-8b,mamba-2.8b")
    ap.add_argument("--peers", default="mamba_ssm,hf", help="comma list of mamba_ssm, hf (empty: none)")
    ap.add_argument("--hf-models", default="mamba2-130m,mamba2-2.7b", help="transformers is slow: only these")
    ap.add_argument("--prompt-lens", default="1024,2048")
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--steps", type=int, default=64, help="decode steps per TPOT timing")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    ap.add_argument("--out", default=os.environ.get("OUT", "out/e2e"))
    ap.add_argument("--profile", action="store_true", help="print the kernels of one eager decode step per model")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_e2e: needs a CUDA GPU")
    dtype = getattr(torch, args.dtype)
    prompt_lens = [int(x) for x in args.prompt_lens.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    peers = [p for p in args.peers.split(",") if p]
    bw = copy_bandwidth()
    results = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "dtype": args.dtype,
               "torch": torch.__version__, "copy_bandwidth_GBps": bw / 1e9, "models": {}}
    runners = {"ssmq": bench_ssmq, "mamba_ssm": bench_mamba_ssm, "hf": bench_hf}
    for name in tqdm(args.models.split(","), desc="models"):
        cfg = PUBLISHED[name]
        if args.profile:
            profile_decode(cfg, dtype)
        entry = {}
        for who in ["ssmq", *peers]:
            if who == "hf" and name not in args.hf_models.split(","):
                continue
            # the previous run's graphs and caches sit in reference cycles: free them now, or their memory
            # counts in this run's peak (it did: Mamba-1's TTFT peak read 21 GiB after Mamba2-2.7B's run)
            gc.collect()
            torch.cuda.empty_cache()
            t0 = time.time()
            try:
                entry[who] = runners[who](cfg, prompt_lens, batches, dtype, args.steps)
            except Exception as e:  # a peer that cannot run this model is reported, not fatal
                entry[who] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
                torch.cuda.empty_cache()
            entry[who]["wall_s"] = round(time.time() - t0, 1)
            print(name, who, json.dumps(entry[who]), flush=True)
        s = entry["ssmq"]
        if "weight_bytes" in s:
            entry["limit"] = {f"tpot_b{bs}_ms": (s["weight_bytes"] + 2 * bs * s["state_bytes"]) / bw * 1e3
                              for bs in batches}
        results["models"][name] = entry
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "e2e.json").write_text(json.dumps(results, indent=1))
    table = markdown_table(results, prompt_lens, batches)
    (out / "e2e.md").write_text(table)
    print(table)
    plot(results, batches, out / "e2e.png")


def profile_decode(cfg, dtype, bs: int = 1) -> None:
    """Kernel launches and GPU time of one eager decode step, by kernel name (what a graph replays)."""
    model = random_model(cfg, dtype=dtype)
    profile_step(model, bs)
    del model
    torch.cuda.empty_cache()


def profile_step(model, bs: int = 1, top: int = 15, ssm_dtype=None) -> list[dict]:
    """Print (and return) the kernels of one eager decode step of ``model`` at batch ``bs``, costliest first
    (``ssm_dtype=torch.int8``: on an int8 state cache)."""
    from torch.profiler import ProfilerActivity, profile

    cache = model.allocate_cache(bs, 8, ssm_dtype=ssm_dtype)
    tokens = torch.zeros(bs, dtype=torch.long, device="cuda")
    with torch.inference_mode():
        for _ in range(3):
            model.step(tokens, cache)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model.step(tokens, cache)
            torch.cuda.synchronize()
    del cache
    return kernel_rows(prof, f"decode step, batch {bs}", top)


def kernel_rows(prof, what: str, top: int) -> list[dict]:
    """Print (and return) a profile's CUDA kernels, costliest first: count, µs each."""
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in events)
    print(f"{what}: {sum(e.count for e in events)} kernel launches, {total / 1e3:.2f} ms GPU time")
    rows = []
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:top]:
        print(f"  {e.count:5d} x {e.self_device_time_total / max(e.count, 1):8.1f} us  {e.key[:90]}")
        rows.append({"kernel": e.key[:120], "count": e.count, "us_each": e.self_device_time_total / max(e.count, 1)})
    return rows


def profile_prefill(model, seqlen: int = 1024, top: int = 12) -> list[dict]:
    """Print (and return) the kernels of one eager batch-1 prefill of ``seqlen`` tokens, costliest first."""
    from torch.profiler import ProfilerActivity, profile

    ids = torch.zeros((1, seqlen), dtype=torch.long, device="cuda")
    with torch.inference_mode():
        for _ in range(2):
            model(ids)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model(ids)
            torch.cuda.synchronize()
    return kernel_rows(prof, f"prefill of {seqlen} tokens", top)


def markdown_table(results, prompt_lens, batches) -> str:
    cols = [f"TTFT {L}" for L in prompt_lens] + [f"TPOT b{b}" for b in batches]
    keys = [f"ttft_{L}_ms" for L in prompt_lens] + [f"tpot_b{b}_ms" for b in batches]
    lines = [f"{results['device']}, {results['dtype']}, {results['date']}, copy bandwidth "
             f"{results['copy_bandwidth_GBps']:.0f} GB/s; times in ms (median)\n",
             "| model | impl | " + " | ".join(cols) + " | peak GiB |", "|---" * (len(cols) + 3) + "|"]
    for name, entry in results["models"].items():
        for who in ("ssmq", "mamba_ssm", "hf", "limit"):
            r = entry.get(who)
            if r is None:
                continue
            if "error" in r:
                lines.append(f"| {name} | {who} | " + " | ".join("—" for _ in cols) + f" | {r['error'][:60]} |")
                continue
            cells = [f"{r[k]:.2f}" if k in r else "" for k in keys]
            peak = max((v for k, v in r.items() if k.endswith("peak_gib")), default=None)
            lines.append(f"| {name} | {who} | " + " | ".join(cells) + f" | {'' if peak is None else f'{peak:.1f}'} |")
    return "\n".join(lines) + "\n"


def plot(results, batches, path) -> None:
    plt = pyplot()
    if plt is None:
        return
    names = list(results["models"])
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), squeeze=False)
    for ax, bs in zip(axes[0], batches):
        key = f"tpot_b{bs}_ms"
        for i, who in enumerate(("ssmq", "mamba_ssm", "hf", "limit")):
            vals = [results["models"][n].get(who, {}).get(key, 0) for n in names]
            ax.bar([x + 0.2 * i for x in range(len(names))], vals, width=0.2, label=who)
        ax.set_xticks([x + 0.3 for x in range(len(names))], names, rotation=30, fontsize=7)
        ax.set_title(f"TPOT batch {bs} (ms)")
        ax.set_yscale("log")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
