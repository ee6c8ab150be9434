"""The ``ssmq bench`` command and its subcommands (latency, throughput, serve, kernels, accuracy)."""

from __future__ import annotations

import argparse

from ssmq.errors import SSMQError

DTYPE_CHOICES = ("float32", "fp32", "float16", "fp16", "bfloat16", "bf16")


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _names(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values:
        raise argparse.ArgumentTypeError("expected at least one name")
    return values


def _engines(text: str) -> list[str]:
    values = _names(text)
    bad = [v for v in values if v not in ("process", "thread")]
    if bad:
        raise argparse.ArgumentTypeError(f"engines are 'process' and 'thread', not {', '.join(bad)}")
    return values


def _device_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=DTYPE_CHOICES,
                   help="weights and activations (default: bfloat16 on CUDA, float32 on the CPU)")
    p.add_argument("--out", default=None, help="folder for the JSON result and its PNG (default: print only)")


def _timing_args(p: argparse.ArgumentParser, what: str, warmup: int, reps: int) -> None:
    p.add_argument("--warmup", type=int, default=warmup, help=f"untimed {what} before timing (default {warmup})")
    p.add_argument("--reps", type=int, default=reps, help=f"timed {what}; the median is reported (default {reps})")


def _request_args(p: argparse.ArgumentParser, prompts: int | None, prompts_help: str) -> None:
    p.add_argument("--num-prompts", type=int, default=prompts, help=prompts_help)
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request (default 128)")
    p.add_argument("--output-len", type=int, default=64, help="tokens generated per request (default 64)")


def _model_args(p: argparse.ArgumentParser, default_recipes: str = "float") -> None:
    p.add_argument("--model", default="mamba2-130m", help="a published architecture, run with random weights "
                   "(mamba2-130m ... mamba2-8b, mamba-2.8b, bamba-9b, llama-3.1-8b, smollm2-135m; see ssmq plan), "
                   "or a checkpoint folder or hub id (default mamba2-130m)")
    p.add_argument("--recipes", type=_names, default=_names(default_recipes), help="comma-separated: 'float' (the "
                   f"unquantized model) and recipe names, timed side by side (default {default_recipes})")
    p.add_argument("--layers", type=int, default=None,
                   help="keep only the first N layers of a published architecture (default: all)")
    p.add_argument("--gptq-as-rtn", action="store_true", help="round GPTQ recipes' weights to nearest instead of "
                   "solving GPTQ: the same format and kernels, minutes faster (speed only)")


def register(subparsers) -> argparse.ArgumentParser:
    bench = subparsers.add_parser(
        "bench", help="benchmarks: latency, throughput, serve, kernels, accuracy (JSON + PNG to --out)",
        description="Benchmarks. Each writes a JSON result (with the command, device and date) and a PNG to --out. "
                    "Times on the CPU only check that a benchmark runs; measure speed on a GPU.")
    sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")

    p = sub.add_parser("latency", help="time to first token and time per output token against batch size",
                       description="Time to first token (prefill of one prompt) and time per output token (one "
                                   "decode step of the batch) against batch size, for each recipe side by side and "
                                   "for mamba_ssm when it is installed. CUDA graphs on a GPU, as ssmq generate runs.")
    _model_args(p)
    p.add_argument("--batch-size", type=_ints, default=[1, 8, 32],
                   help="comma-separated decode batch sizes (default 1,8,32)")
    p.add_argument("--input-len", type=_ints, default=[128], help="comma-separated prompt lengths for the time to "
                   "first token (default 128)")
    p.add_argument("--steps", type=int, default=8, help="decode steps in one timing (default 8)")
    _timing_args(p, "runs", 2, 5)
    p.add_argument("--peers", type=_names, default=["mamba_ssm", "transformers"], help="comma-separated peers timed "
                   "alongside when installed: mamba_ssm (on CUDA, Mamba-1 and Mamba-2 architectures), transformers "
                   "(the hybrid families' published architectures, whole) (default both; 'none' for none)")
    p.add_argument("--profile", action="store_true", help="also profile each prefill and each decode step: their "
                   "kernels, calls and time per call, and the time between kernels; decode from a step captured "
                   "without programmatic dependent launch (on the CPU: the PyTorch operators)")
    _device_args(p)
    p.set_defaults(func=_run("latency"))

    p = sub.add_parser("throughput", help="offline generation throughput (requests/s, tokens/s)",
                       description="Offline generation of random prompts, a fixed number of new tokens each, "
                                   "--max-batch sequences at a time: requests/s and tokens/s for each recipe.")
    _model_args(p)
    _request_args(p, 16, "prompts generated (default 16)")
    p.add_argument("--max-batch", type=int, default=8, help="sequences decoded together (default 8)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default 0)")
    _device_args(p)
    p.set_defaults(func=_run("throughput"))

    p = sub.add_parser("serve", help="load against an OpenAI-compatible server, beside the decode-step bound",
                       description="Closed-loop clients sending streaming /v1/completions requests of random token "
                                   "ids: throughput, time to first token and time per output token at each "
                                   "concurrency. Against a running server (--url; start one with ssmq serve), or "
                                   "with --model: the model is served here under each recipe, its decode step timed "
                                   "at each concurrency's batch, and each level's throughput reported as a share of "
                                   "that decode-step bound (batch / step time).")
    p.add_argument("--url", default="http://localhost:8000", help="the server (default http://localhost:8000); "
                   "ignored with --model")
    p.add_argument("--served-model", default=None, help="model name sent in requests (default: the first the "
                   "server lists at /v1/models)")
    p.add_argument("--model", default=None, help="serve this model here instead of --url: a published "
                   "architecture with random weights (mamba2-2.7b, ...; see ssmq plan) or a checkpoint folder")
    p.add_argument("--recipes", type=_names, default=["float"], help="with --model: comma-separated 'float' and "
                   "recipe names, served one after the other (default float)")
    p.add_argument("--layers", type=int, default=None,
                   help="with --model: keep only the first N layers of a published architecture (default: all)")
    p.add_argument("--gptq-as-rtn", action="store_true", help="round GPTQ recipes' weights to nearest instead of "
                   "solving GPTQ (speed only)")
    p.add_argument("--concurrency", type=_ints, default=[1, 4, 16],
                   help="comma-separated numbers of concurrent clients (default 1,4,16)")
    _request_args(p, None, "requests at each level (default: twice the number of clients)")
    p.add_argument("--vocab-limit", type=int, default=1000, help="prompt token ids are drawn below this (default "
                   "1000)")
    p.add_argument("--timeout", type=float, default=600, help="seconds one request may take (default 600)")
    p.add_argument("--prefill-chunk", type=int, default=512, help="with --model: the engine's --prefill-chunk "
                   "(default 512)")
    p.add_argument("--prefill-tokens", type=int, default=8192, help="with --model: the engine's --prefill-tokens "
                   "(default 8192)")
    p.add_argument("--graph-prefill-tokens", type=int, default=512, help="with --model: the engine's "
                   "--graph-prefill-tokens (default 512)")
    p.add_argument("--graph-prefill-pieces", type=int, default=8, help="with --model: the engine's "
                   "--graph-prefill-pieces (default 8)")
    p.add_argument("--engine", type=_engines, default=["process"],
                   help="with --model: comma-separated 'process' (the engine in a process of its own, as ssmq serve "
                        "runs it) and 'thread' (in a thread of the server's process); both: one after the other on "
                        "the same model and bound (default process)")
    p.add_argument("--steps", type=int, default=8, help="with --model: decode steps in one timing of the bound "
                   "(default 8)")
    _timing_args(p, "runs of the bound", 2, 5)
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    _device_args(p)
    p.set_defaults(func=_run("serve"))

    from ssmq.bench.kernels import KERNEL_BENCHES
    from ssmq.bench.tune import TUNABLE

    p = sub.add_parser("kernels", help="kernel micro-benchmarks against their baselines",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Kernel micro-benchmarks at the shapes of a published architecture, each "
                                   "against its baseline (torch or the PyTorch reference).\n\nbenchmarks:\n"
                                   + "\n".join(f"  {b.name:<14} {b.description}" for b in KERNEL_BENCHES.values()))
    p.add_argument("--only", type=_names, default=None, help="comma-separated benchmark names (default: all)")
    p.add_argument("--shape", default="mamba2-2.7b", help="the published architecture whose shapes are timed "
                   "(default mamba2-2.7b)")
    p.add_argument("--rows", type=_ints, default=[1, 8, 32], help="comma-separated rows (batch) (default 1,8,32)")
    p.add_argument("--l2-flush", action="store_true", help="evict the GPU's L2 cache before each timed call")
    _timing_args(p, "calls", 3, 20)
    p.add_argument("--tune", choices=sorted(TUNABLE), default=None, help="time candidate launch settings of this "
                   "op on the current GPU (its benchmark's cases, L2 flushed) and write the fastest into its config "
                   "file under the GPU's name (CUDA only)")
    p.add_argument("--config", default=None, help="with --tune: the config file written (default: the package's "
                   "ssmq/kernels/configs/OP.json)")
    _device_args(p)
    p.set_defaults(func=_run("kernels"))

    p = sub.add_parser("accuracy", help="perplexity of a checkpoint unquantized and under each recipe",
                       description="Perplexity of a checkpoint unquantized and under each recipe, side by side, on "
                                   "one text (WikiText-2 test by default).")
    p.add_argument("--model", default=None, help="checkpoint folder or hub id (default: as ssmq generate)")
    p.add_argument("--recipes", type=_names, default=["float", "rtn-w8a16"],
                   help="comma-separated: 'float' and recipe names (default float,rtn-w8a16)")
    p.add_argument("--text", default=None, help="a UTF-8 text file to score (default: WikiText-2 test from the "
                   "data folder)")
    p.add_argument("--seqlen", type=int, default=2048, help="tokens per window (default 2048)")
    p.add_argument("--limit", type=int, default=8, help="windows scored (default 8)")
    p.add_argument("--batch-size", type=int, default=1, help="windows per forward (default 1)")
    p.add_argument("--paths", type=_names, default=["forward"], help="comma-separated: forward (each window in "
                   "one forward, prefill's kernels), decode (the windows token by token through the cache and the "
                   "decode kernels, one batch) (default forward)")
    p.add_argument("--against-reference", action="store_true", help="also score each path on the ssmq.ops "
                   "references and report the kernels' difference from them (CUDA only)")
    p.add_argument("--calib", default=None, help="calibration text file (default: WikiText-2 train from the data "
                   "folder)")
    p.add_argument("--calib-samples", type=int, default=128, help="calibration windows (default 128)")
    p.add_argument("--calib-seqlen", type=int, default=512, help="tokens per calibration window (default 512)")
    _device_args(p)
    p.set_defaults(func=_run("accuracy"))
    return bench


def _run(name: str):
    def run(args) -> None:
        import importlib

        for key in ("steps", "warmup", "reps", "num_prompts", "input_len", "output_len", "max_batch", "seqlen",
                    "limit", "batch_size", "calib_samples", "calib_seqlen", "layers", "prefill_chunk",
                    "prefill_tokens", "graph_prefill_tokens", "graph_prefill_pieces"):
            value = getattr(args, key, None)
            if isinstance(value, int) and value < (0 if key == "warmup" else 1):
                raise SSMQError(f"--{key.replace('_', '-')} must be >= {0 if key == 'warmup' else 1}, got {value}")
        if getattr(args, "peers", None) == ["none"]:
            args.peers = []
        if getattr(args, "recipes", None):  # an unknown recipe stops before any model is built
            from ssmq.bench.models import FLOAT
            from ssmq.quant import get_recipe

            for recipe in args.recipes:
                if recipe != FLOAT:
                    get_recipe(recipe)
        importlib.import_module(f"ssmq.bench.{'tune' if getattr(args, 'tune', None) else name}").run(args)

    return run
