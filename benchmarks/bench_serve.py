"""Serving speed: throughput, TTFT and TPOT p50/p99 of `ssmq serve` under 1, 16, 64, 256 concurrent streaming
clients, beside the offline batched throughput and offline TPOT of the same model in the same run.

    python benchmarks/bench_serve.py --model mamba2-2.7b --out out/serve            # GPU, FP16, random weights
    python benchmarks/bench_serve.py --model mamba2-2.7b --quant rtn-w8a16 --out out/serve-w8a16
    python benchmarks/bench_serve.py --model tiny --concurrency 1,4,16 --prompt-len 32 --output-len 32  # CPU sanity
    python benchmarks/bench_serve.py --model llama-3.1-8b --kv nuq4-1% --kv-cache-memory 2.5 --skip-offline \
        --concurrency 64 --prompt-len 1024 --output-len 256 --out out/serve-kv   # KV formats at equal KV memory

The server runs in a child process (model, engine, uvicorn: what `ssmq serve` runs), which first measures the
offline numbers with the same model: ``generate`` of C prompts at once (CUDA-graph decode on GPU) for the
throughput, and single-sequence decode steps for the TPOT. The load comes from ``--client-procs`` processes of
asyncio httpx clients on 127.0.0.1 only; each client sends its next request when the previous one ends (closed
loop), ``ignore_eos`` so every request makes exactly ``--output-len`` tokens; a level stops after
``--requests`` x C requests or ``--max-seconds``. Throughput counts generated tokens over the level's wall time.
TTFT: request sent to first streamed token; TPOT: (last - first token time) / (tokens - 1), per request.
Writes serve.json, serve.md and serve.png to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plotting import pyplot  # noqa: E402

TINY = dict(arch="mamba2", d_model=256, n_layer=4, vocab_size=512, d_state=32, headdim=32, chunk_size=64)


class IdTokenizer:
    """Text is the ids, space-separated: the benchmark sends token-id prompts, and random weights have no vocabulary."""

    eos_id = 0

    def __init__(self, vocab: int):
        self.vocab = vocab

    def encode(self, text: str) -> list[int]:
        return [int(t) % self.vocab for t in text.split() if t.isdigit()]

    def decode(self, ids) -> str:
        return "".join(f" {i}" for i in ids)

    def __len__(self) -> int:
        return self.vocab


# ------------------------------------------------------------------------------------------------- server process
def build_model(args):
    import torch

    from ssmq.models.config import ModelConfig

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if device == "cuda" else torch.float32
    if args.model == "tiny":
        from random_model import random_model

        model = random_model(ModelConfig(**TINY), device=device, dtype=dtype)
    elif Path(args.model).is_dir():
        from ssmq.models.loading import load_model

        model = load_model(args.model, dtype=dtype, device=device).eval()
    else:
        from published_configs import PUBLISHED
        from random_model import random_model

        model = random_model(PUBLISHED[args.model], device=device, dtype=dtype)
    if args.quant:
        from ssmq.quant.api import quantize

        model = quantize(model, args.quant, progress=False)
    if args.kv:  # every attention layer caches in this KV format, placeholder codebooks and scales (speed, not accuracy)
        from check_plan_memory import quantize_kv

        from ssmq.models.kv_format import kv_format

        quantize_kv(model, kv_format(args.kv))
    return model


def offline(model, args, levels) -> dict:
    """Offline TPOT (one sequence, decode steps) and batched throughput (``generate`` of C prompts) per level."""
    import torch

    from ssmq.runtime.generate import generate
    from ssmq.runtime.sampling import SamplingParams

    cuda = model.device.type == "cuda"
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_new_tokens=args.output_len, stop_at_eos=False)
    out = {"throughput_tok_s": {}, "decode_step_tok_s": {}}
    for c in levels:
        prompts = torch.randint(1, vocab, (c, args.prompt_len), generator=g).tolist()
        run = {}
        if cuda:
            from ssmq.runtime.cuda_graph import CudaGraphDecoder

            dec = CudaGraphDecoder(model, max_batch=c, max_seqlen=args.prompt_len + args.output_len + 1)
            run = {"cache": dec.cache, "decode_fn": dec}
        # warm-up with all C prompts: CUDA graphs are captured per batch bucket on first use, which must not be timed
        generate(model, prompts, SamplingParams(max_new_tokens=4, stop_at_eos=False), **run)
        sync()
        t = time.perf_counter()
        generate(model, prompts, params, **run)
        sync()
        out["throughput_tok_s"][c] = c * args.output_len / (time.perf_counter() - t)
        # the bound a server could reach with no prefill and no host work: C rows per decode step (graph replay on
        # CUDA). generate() prefills prompt by prompt, so its throughput is far below this at large C
        step_s = decode_step_s(model, run, c, steps=min(args.output_len, 200))
        out["decode_step_tok_s"][c] = c / step_s
        if c == 1:  # TPOT: decode steps only, prefill excluded
            out["tpot_ms"] = step_s * 1e3
        del run
    return out


def decode_step_s(model, run: dict, c: int, steps: int = 10, warmup: int = 5) -> float:
    """Median seconds of one greedy decode step of C rows (argmax included): ``run``'s CudaGraphDecoder over its
    cache (reset first: the timed steps must not run past the cache's length), else ``model.step`` on a fresh
    cache."""
    import torch

    dev = model.device
    slots = torch.arange(c, device=dev)
    tokens = torch.ones(c, dtype=torch.long, device=dev)
    if run:
        run["cache"].reset()
        decode_fn = run["decode_fn"]
    else:
        cache = model.allocate_cache(c, steps + warmup)
        decode_fn = lambda x, s: model.step(x, cache, s)  # noqa: E731
    times = []
    with torch.inference_mode():
        for _ in range(steps + warmup):
            sync()
            t = time.perf_counter()
            decode_fn(tokens, slots).argmax(-1)
            sync()
            times.append(time.perf_counter() - t)
    return statistics.median(times[warmup:])


def sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def serve_main(args) -> None:
    """The child process: offline numbers to --offline-json, then serve on --port until killed."""
    import torch

    from ssmq.runtime.engine import Engine, EngineConfig
    from ssmq.runtime.server import ServerConfig, run_server

    torch.set_grad_enabled(False)
    if not torch.cuda.is_available():
        # one intra-op thread: on a loaded host, 2-thread ops wait ~30 ms on each other (measured on the 2-core box)
        torch.set_num_threads(1)
    model = build_model(args)
    levels = [int(c) for c in args.concurrency.split(",")]
    t = time.perf_counter()
    info = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)",
            "vocab": model.config.vocab_size,
            "offline": {} if args.skip_offline else offline(model, args, levels)}
    info["offline_s"] = time.perf_counter() - t
    t = time.perf_counter()
    kv_bytes = None if args.kv_cache_memory is None else int(args.kv_cache_memory * 2 ** 30)
    engine = Engine(model, EngineConfig(max_batch=max(levels), max_model_len=args.prompt_len + args.output_len + 1,
                                        prefill_tokens=args.prefill_tokens, kv_cache_bytes=kv_bytes))
    info["engine_start_s"] = time.perf_counter() - t  # CUDA-graph capture on GPU
    if engine.blocks is not None:  # the KV pools: how many sequences of prompt + output tokens they hold at once
        seq = engine.blocks.blocks_for(args.prompt_len + args.output_len)
        info.update(kv_blocks=engine.blocks.total, kv_block_size=engine.blocks.block_size,
                    kv_sequences_at_once=engine.blocks.total // seq)
    Path(args.offline_json).write_text(json.dumps(info))
    run_server(engine, IdTokenizer(model.config.vocab_size),
               ServerConfig(("bench",), request_timeout_s=None), port=args.port, log_level="warning")


# ------------------------------------------------------------------------------------------------- load clients
async def _client_loop(url, n_requests, deadline, body, records):
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=None) as c:
        while time.monotonic() < deadline and n_requests[0] > 0:
            n_requests[0] -= 1
            start, first, times, ok = time.perf_counter(), None, [], False
            async with c.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        ok = True
                        break
                    now = time.perf_counter()
                    chunk = json.loads(line[6:])
                    if chunk.get("choices") and chunk["choices"][0]["text"]:
                        first = first or now
                        times.append(now)
            if ok and first is not None:
                records.append({"start": start, "first": first, "end": times[-1], "chunks": len(times)})


def _client_proc(url, clients, n_requests, max_seconds, body):
    """One load process: ``clients`` closed-loop clients sharing a budget of ``n_requests``."""
    records, budget = [], [n_requests]
    deadline = time.monotonic() + max_seconds

    async def main():
        await asyncio.gather(*(_client_loop(url, budget, deadline, body, records) for _ in range(clients)))

    asyncio.run(main())
    return records


def run_level(url, c, args, vocab) -> dict:
    import random

    rng = random.Random(c)
    body = {"model": "bench", "prompt": [rng.randrange(1, vocab) for _ in range(args.prompt_len)],
            "max_tokens": args.output_len, "temperature": 0, "ignore_eos": True, "stream": True}
    n_total = args.requests * c
    procs = max(1, min(args.client_procs, c))
    shares = [c // procs + (i < c % procs) for i in range(procs)]
    with mp.get_context("spawn").Pool(procs) as pool:
        parts = pool.starmap(_client_proc, [(url, s, n_total * s // c, args.max_seconds, body) for s in shares])
    records = [r for p in parts for r in p]
    if not records:
        return {"concurrency": c, "requests": 0}
    wall = max(r["end"] for r in records) - min(r["start"] for r in records)
    ttft = sorted(r["first"] - r["start"] for r in records)
    tpot = sorted((r["end"] - r["first"]) / (args.output_len - 1) for r in records)
    return {"concurrency": c, "requests": len(records), "wall_s": wall,
            "throughput_tok_s": len(records) * args.output_len / wall,
            "ttft_ms_p50": pct(ttft, 50) * 1e3, "ttft_ms_p99": pct(ttft, 99) * 1e3,
            "tpot_ms_p50": pct(tpot, 50) * 1e3, "tpot_ms_p99": pct(tpot, 99) * 1e3}


def pct(sorted_values, q):
    i = min(len(sorted_values) - 1, max(0, round(q / 100 * (len(sorted_values) - 1))))
    return sorted_values[i]


def wait_ready(url, proc, timeout_s) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server process exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the server was not ready within {timeout_s} s")


def merge_runs(old: dict, new: dict) -> dict:
    """``new`` with the levels (and their offline figures) of ``old`` that it did not measure; refuses runs of
    another model, recipe or prompt / output length, whose rows would not compare."""
    for key in ("model", "quant", "prompt_len", "output_len"):
        if old.get(key) != new.get(key):
            raise SystemExit(f"--merge: {key} differs ({old.get(key)!r} vs {new.get(key)!r})")
    done = {r["concurrency"] for r in new["levels"]}
    merged = {**new, "offline": {**new["offline"]}, "merged_from": old.get("command")}
    for key in ("throughput_tok_s", "decode_step_tok_s"):
        merged["offline"][key] = {**old["offline"].get(key, {}), **new["offline"].get(key, {})}
    if "tpot_ms" not in merged["offline"] and "tpot_ms" in old["offline"]:
        merged["offline"]["tpot_ms"] = old["offline"]["tpot_ms"]
    merged["levels"] = sorted([r for r in old["levels"] if r["concurrency"] not in done] + new["levels"],
                              key=lambda r: r["concurrency"])
    return merged


def report(res: dict, out: Path) -> None:
    off = res["offline"]
    kv = (f"; KV {res.get('kv') or 'float16'}" + (f", {res['kv_cache_gib']} GiB: {res['kv_blocks']} blocks of "
                                                  f"{res['kv_block_size']} tokens, {res['kv_sequences_at_once']} "
                                                  "sequences at once" if res.get("kv_blocks") else ""))
    lines = [f"# ssmq serve: {res['model']}{' ' + res['quant'] if res['quant'] else ''} on {res['device']}", "",
             f"prompt {res['prompt_len']} tokens, output {res['output_len']} tokens (ignore_eos), streaming, "
             "closed-loop clients" + (f"; offline TPOT {off['tpot_ms']:.2f} ms" if "tpot_ms" in off else "") + kv,
             "",
             "| clients | requests | throughput tok/s | offline tok/s | ratio | decode-step bound tok/s | ratio | "
             "TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | TPOT p50 / offline |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["levels"]:
        if not r.get("requests"):
            lines.append(f"| {r['concurrency']} | 0 | | | | | | | | | | |")
            continue
        o = off.get("throughput_tok_s", {}).get(str(r["concurrency"]), float("nan"))
        tpot_ratio = f"{r['tpot_ms_p50'] / off['tpot_ms']:.2f}" if "tpot_ms" in off else ""
        bound = off.get("decode_step_tok_s", {}).get(str(r["concurrency"]))
        bound_cells = f"{bound:.0f} | {r['throughput_tok_s'] / bound:.2f}" if bound else " | "
        lines.append(f"| {r['concurrency']} | {r['requests']} | {r['throughput_tok_s']:.0f} | {o:.0f} | "
                     f"{r['throughput_tok_s'] / o:.2f} | {bound_cells} | {r['ttft_ms_p50']:.1f} | {r['ttft_ms_p99']:.1f} | "
                     f"{r['tpot_ms_p50']:.2f} | {r['tpot_ms_p99']:.2f} | {tpot_ratio} |")
    (out / "serve.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plt = pyplot()
    if plt is None:
        return
    rows = [r for r in res["levels"] if r.get("requests")]
    cs = [r["concurrency"] for r in rows]
    fig, ax = plt.subplots(1, 3, figsize=(13, 3.6))
    ax[0].plot(cs, [r["throughput_tok_s"] for r in rows], "o-", label="server")
    if off.get("throughput_tok_s"):
        ax[0].plot(cs, [off["throughput_tok_s"][str(c)] for c in cs], "s--", label="offline generate")
    bound = [c for c in cs if str(c) in off.get("decode_step_tok_s", {})]
    if bound:
        ax[0].plot(bound, [off["decode_step_tok_s"][str(c)] for c in bound], "k:", label="decode-step bound")
    ax[0].set(xscale="log", yscale="log", xlabel="concurrent clients", ylabel="generated tok/s", title="throughput")
    ax[1].plot(cs, [r["ttft_ms_p50"] for r in rows], "o-", label="p50")
    ax[1].plot(cs, [r["ttft_ms_p99"] for r in rows], "o--", label="p99")
    ax[1].set(xscale="log", yscale="log", xlabel="concurrent clients", ylabel="ms", title="TTFT")
    ax[2].plot(cs, [r["tpot_ms_p50"] for r in rows], "o-", label="p50")
    ax[2].plot(cs, [r["tpot_ms_p99"] for r in rows], "o--", label="p99")
    if "tpot_ms" in off:
        ax[2].axhline(off["tpot_ms"], color="gray", ls=":", label="offline, 1 sequence")
    ax[2].set(xscale="log", xlabel="concurrent clients", ylabel="ms", title="TPOT")
    for a in ax:
        a.legend(fontsize=8)
    fig.suptitle(f"ssmq serve, {res['model']}{' ' + res['quant'] if res['quant'] else ''}, {res['device']}")
    fig.tight_layout()
    fig.savefig(out / "serve.png", dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mamba2-2.7b", help="published config name (random weights), tiny, or a folder")
    p.add_argument("--quant", help="quantize with this recipe first (one without calibration, e.g. rtn-w8a16)")
    p.add_argument("--concurrency", default="1,16,64,256")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--requests", type=int, default=3, help="requests per client per level (default 3)")
    p.add_argument("--max-seconds", type=float, default=60, help="time cap per level")
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--kv", help="KV format of the attention layers (a KV preset, e.g. nuq4-1%%; placeholder "
                   "codebooks and scales: speed and capacity, not accuracy); default float16")
    p.add_argument("--kv-cache-memory", type=float, metavar="GIB", help="KV blocks of this many GiB (ssmq serve's "
                   "flag), in the --kv format: the same memory holds more tokens of a quantized cache")
    p.add_argument("--skip-offline", action="store_true", help="no offline numbers (generate, decode steps)")
    p.add_argument("--client-procs", type=int, default=4, help="load-generating processes")
    p.add_argument("--port", type=int, default=0, help="server port (default: a free one)")
    p.add_argument("--ready-timeout", type=float, default=600)
    p.add_argument("--out", default="out/serve")
    p.add_argument("--merge", help="serve.json of an earlier run (same model and recipe): its other levels and "
                   "offline figures join this run's report, each level's row as it was measured")
    p.add_argument("--serve-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--offline-json", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.output_len < 2:
        raise SystemExit("--output-len must be >= 2 (TPOT needs two tokens)")
    if args.serve_only:
        return serve_main(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.port:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            args.port = s.getsockname()[1]
    url = f"http://127.0.0.1:{args.port}"
    import tempfile

    offline_json = Path(tempfile.mkdtemp(prefix="bench_serve_")) / "offline.json"  # not in --out: few files back
    child = [sys.executable, __file__, "--serve-only", "--offline-json", str(offline_json)] + [
        a for a in sys.argv[1:]]
    if "--port" not in sys.argv:
        child += ["--port", str(args.port)]
    proc = subprocess.Popen(child, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_ready(url, proc, args.ready_timeout)
        info = json.loads(offline_json.read_text())
        for key in ("throughput_tok_s", "decode_step_tok_s"):
            info["offline"][key] = {str(k): v for k, v in info["offline"].get(key, {}).items()}
        levels = []
        for c in [int(x) for x in args.concurrency.split(",")]:
            levels.append(run_level(url, c, args, info["vocab"]))
            print(json.dumps(levels[-1]), flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    res = {"model": args.model, "quant": args.quant, "kv": args.kv, "kv_cache_gib": args.kv_cache_memory,
           "prompt_len": args.prompt_len, "output_len": args.output_len,
           "date": time.strftime("%Y-%m-%d"), "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
           **info, "levels": levels}
    if args.merge:
        res = merge_runs(json.loads(Path(args.merge).read_text()), res)
    (out / "serve.json").write_text(json.dumps(res, indent=1))
    report(res, out)


if __name__ == "__main__":
    main()
