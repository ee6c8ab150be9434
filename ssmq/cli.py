"""The ``ssmq`` command: info, generate, and the subcommands registered by eval/, quant/ and runtime/ (serve).

Every user error ends as one line on stderr (``ssmq: error: ...``) and exit status 1.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from ssmq.errors import SSMQError

DEFAULT_HUB_MODEL = "state-spaces/mamba2-130m"
# Subcommands owned by other packages; each module has register(subparsers).
PLUGIN_COMMANDS = ("ssmq.eval.command", "ssmq.quant.command", "ssmq.quant.export_command", "ssmq.runtime.command")
DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
          "bfloat16": "bfloat16", "bf16": "bfloat16"}


def default_model() -> str:
    """$SSMQ_MODEL, else ../shared/models/mamba2 when present, else the hub id of Mamba2-130m."""
    from ssmq.paths import shared_path

    env = os.environ.get("SSMQ_MODEL")
    if env:
        return env
    local = shared_path("models", "mamba2")
    return str(local) if local is not None else DEFAULT_HUB_MODEL


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--model/--dtype/--device, shared by every subcommand that loads a model."""
    p.add_argument("--model", default=None, help="checkpoint folder or hub id (default: $SSMQ_MODEL, "
                   "../shared/models/mamba2, else state-spaces/mamba2-130m)")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available)")


def load_from_args(args, load=None):
    """(model, tokenizer, model path) from the --model/--dtype/--device arguments.

    ``load(path, dtype, device)`` replaces ``load_model`` (e.g. loading this rank's tensor-parallel shard)."""
    import torch

    from ssmq.models.loading import load_model, resolve_model_path
    from ssmq.tokenizer import load_tokenizer

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SSMQError(f"--device {device} asked for, but CUDA is not available on this machine")
    default_dtype = "bfloat16" if device.startswith("cuda") else "float32"
    dtype = getattr(torch, DTYPES[args.dtype or default_dtype])
    path = resolve_model_path(args.model or default_model())
    if getattr(args, "tp", 1) > 1:
        from ssmq.runtime.tp_launch import load_tp_model, start_tp

        comm, device = start_tp(args, device)
        return load_tp_model(path, comm, dtype=dtype, device=device), load_tokenizer(path), path
    model = (load or (lambda p, dtype, device: load_model(p, dtype=dtype, device=device)))(path, dtype, device).eval()
    return model, load_tokenizer(path), path


def cmd_info(args) -> None:
    from ssmq.models.loading import load_config, resolve_model_path
    from ssmq.runtime.footprint import footprint

    path = resolve_model_path(args.model or default_model())
    cfg, fmt = load_config(path)
    bytes_per = {"float32": 4, "float16": 2, "bfloat16": 2}[DTYPES[args.dtype or "bfloat16"]]
    for key, value in footprint(cfg, bytes_per, format_name=fmt, path=str(path)).items():
        print(f"{key:<28} {value}")


def cmd_generate(args) -> None:
    from ssmq.runtime.generate import stream_generate
    from ssmq.runtime.sampling import SamplingParams

    model, tok, _ = load_from_args(args)
    prompts = args.prompt or ["The history of"]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, eos_id=tok.eos_id, vocab_limit=len(tok), seed=args.seed,
                            stop_at_eos=not args.ignore_eos)
    ids = tok.encode_batch(prompts)
    run = {}
    if model.device.type == "cuda" and not args.eager:  # decode from CUDA graphs over the decoder's cache
        from ssmq.runtime.cuda_graph import CudaGraphDecoder

        dec = CudaGraphDecoder(model, max_batch=len(ids), max_seqlen=max(map(len, ids)) + args.max_new_tokens)
        run = {"cache": dec.cache, "decode_fn": dec}
    if len(prompts) == 1:  # stream: print the new text as each token arrives
        print(prompts[0], end="", flush=True)
        out: list[int] = []
        shown = ""
        for _, t in stream_generate(model, ids, params, **run):
            out.append(t)
            text = tok.decode(out)
            print(text[len(shown):], end="", flush=True)
            shown = text
        print()
        return
    outs: list[list[int]] = [[] for _ in prompts]
    for row, t in stream_generate(model, ids, params, **run):
        outs[row].append(t)
    for prompt, out in zip(prompts, outs):
        print(f"--- {prompt!r}\n{prompt}{tok.decode(out)}")


def add_tp_args(p: argparse.ArgumentParser) -> None:
    from ssmq.runtime.tp_launch import add_tp_args as add

    add(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ssmq", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="architecture, parameters, weight/state/KV bytes of a model")
    add_model_args(p)
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("generate", help="continue a prompt (streams tokens)")
    add_model_args(p)
    p.add_argument("--prompt", action="append", help="prompt text; repeat for a batch (default: 'The history of')")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-text token")
    p.add_argument("--eager", action="store_true", help="on CUDA, decode without CUDA graphs")
    add_tp_args(p)
    p.set_defaults(func=cmd_generate)

    for module in PLUGIN_COMMANDS:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name is None or not module.startswith(e.name):
                raise
            continue
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except SSMQError as e:
        print(f"ssmq: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("ssmq: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if getattr(args, "tp", 1) <= 1:
            raise
        from ssmq.runtime.tp_launch import failure_line  # a tensor-parallel rank: one line, then torchrun stops the rest

        print(failure_line(e, int(os.environ.get("RANK", 0))), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
