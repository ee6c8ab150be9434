"""``ssmq serve``: an OpenAI-compatible HTTP server with continuous batching.

    ssmq serve --model MODEL --port 8000
    curl -s localhost:8000/v1/completions -H 'content-type: application/json' \\
         -d '{"prompt": "The history of", "max_tokens": 32, "temperature": 0}'

Wire-up: ``ssmq.runtime.command.register(subparsers)`` adds the subcommand (``func=run``).
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from ssmq.errors import SSMQError
from ssmq.paths import default_model

DESCRIPTION = """An OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /v1/models) with continuous
batching.

  ssmq serve --model MODEL --port 8000
  curl -s localhost:8000/v1/completions -H 'content-type: application/json' \\
       -d '{"prompt": "The history of", "max_tokens": 32, "temperature": 0}'
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ssmq.runtime.model_args import add_model_args

    add_model_args(p)
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks: launch as torchrun --nproc_per_node N -m ssmq serve ... --tp N "
                        "(default 1)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--max-batch", type=int, default=64, help="cache slots: sequences decoded together (default 64)")
    p.add_argument("--max-model-len", type=int, default=2048, help="prompt + generated tokens per sequence "
                   "(default 2048)")
    p.add_argument("--prefill-chunk", type=int, default=512,
                   help="prompt tokens of one request prefilled per engine step: a longer prompt is prefilled in "
                        "chunks of this many, interleaved with the decode steps of the running requests "
                        "(default 512)")
    p.add_argument("--prefill-tokens", type=int, default=8192,
                   help="prompt tokens prefilled per engine step over all requests in prefill; chunks of equal "
                        "length share one forward (default 8192)")
    p.add_argument("--graph-prefill-tokens", type=int, default=512,
                   help="rows x tokens of the largest prefill forward replayed from CUDA graphs, captured at start; "
                        "larger ones run eagerly (default 512)")
    p.add_argument("--graph-prefill-pieces", type=int, default=8,
                   help="a larger prefill forward runs as up to this many graph-sized forwards of its rows instead "
                        "of eagerly (1: never; default 8)")
    p.add_argument("--kv-block-size", type=int, default=32, help="tokens per KV block (hybrids; default 32)")
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--kv-cache-memory", type=float, metavar="GIB",
                    help="GiB of KV blocks over all attention layers, in the model's KV format, with the decode "
                         "workspace that grows with them (a KVQuant model fits 3.5-5x the tokens of float16); "
                         "default: blocks for a quarter of max-batch x max-model-len tokens")
    kv.add_argument("--kv-blocks", type=int, help="KV blocks per attention layer (in place of --kv-cache-memory)")
    p.add_argument("--served-model-name", help="name in /v1/models and requests (default: the model folder's name)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request (default 600)")
    p.add_argument("--max-body-bytes", type=int, default=4 << 20, help="larger request bodies are refused "
                   "with 413 (default 4194304)")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds for a request's headers to arrive; slower ones get 408 (default 10)")
    p.add_argument("--max-connections", type=int, default=1024,
                   help="open connections beyond this are answered 503 (default 1024)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds for requests in flight to finish before they are failed (default 30); "
                        "a second SIGTERM exits at once")
    p.add_argument("--api-key", default=os.environ.get("SSMQ_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on the API routes (default: $SSMQ_API_KEY, else none)")
    p.add_argument("--chat-template", metavar="FILE",
                   help="Jinja chat template for /v1/chat/completions (default: the model's, from its tokenizer "
                        "files)")
    p.add_argument("--engine", choices=["process", "thread"], default=None,
                   help="where the engine (model, cache, scheduler, sampler) runs: 'process', a process of its own "
                        "beside the HTTP server's (its loop never waits for the API's Python); 'thread', a thread of "
                        "the server's process (default: process; thread with --tp, whose ranks' collectives run in "
                        "rank 0's process)")
    p.add_argument("--eager", action="store_true", help="on CUDA, run without CUDA graphs")
    add_state_checkpoint_arg(p)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="server log level (default info)")


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="OpenAI-compatible completions server (continuous batching)",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def add_state_checkpoint_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state-checkpoint", type=int, default=None, metavar="K",
                   help="write each SSM state once every K decode steps, replaying the steps since from a ring of "
                        "their inputs (ReplaySSM; e.g. 16); default: every step")


def state_checkpoint(args) -> int | None:
    k = getattr(args, "state_checkpoint", None)
    if k is not None and k < 2:
        raise SSMQError("--state-checkpoint must be >= 2 (leave it out to write the state every step)")
    return k


def engine_config(args):
    from ssmq.runtime.engine import EngineConfig

    for name in ("max_batch", "max_model_len", "prefill_chunk", "prefill_tokens", "graph_prefill_tokens",
                 "graph_prefill_pieces", "kv_block_size"):
        if getattr(args, name) < 1:
            raise SSMQError(f"--{name.replace('_', '-')} must be >= 1")
    if args.kv_blocks is not None and args.kv_blocks < 1:
        raise SSMQError("--kv-blocks must be >= 1")
    if args.kv_cache_memory is not None and not args.kv_cache_memory > 0:
        raise SSMQError("--kv-cache-memory must be a positive number of GiB")
    return EngineConfig(max_batch=args.max_batch, max_model_len=args.max_model_len,
                        prefill_tokens=args.prefill_tokens, prefill_chunk=args.prefill_chunk,
                        graph_prefill_tokens=args.graph_prefill_tokens,
                        graph_prefill_pieces=args.graph_prefill_pieces, cuda_graphs=not args.eager,
                        state_checkpoint=state_checkpoint(args), kv_block_size=args.kv_block_size,
                        kv_blocks=args.kv_blocks,
                        kv_cache_bytes=None if args.kv_cache_memory is None else int(args.kv_cache_memory * 2 ** 30))


def server_options(args) -> dict:
    """The ServerConfig fields the flags set (checked before the model loads)."""
    for name in ("header_timeout", "drain_timeout"):
        value = getattr(args, name)
        if not value > 0 or value == float("inf"):
            raise SSMQError(f"--{name.replace('_', '-')} must be a positive number of seconds")
    if args.max_connections < 1:
        raise SSMQError("--max-connections must be >= 1")
    if args.api_key is not None and not args.api_key:
        raise SSMQError("--api-key must not be empty")
    if args.chat_template is not None and not Path(args.chat_template).is_file():
        raise SSMQError(f"--chat-template: no file {args.chat_template}")
    return dict(max_body_bytes=args.max_body_bytes, request_timeout_s=args.request_timeout,
                header_timeout_s=args.header_timeout, max_connections=args.max_connections,
                drain_timeout_s=args.drain_timeout, api_key=args.api_key)


def engine_kind(args) -> str:
    """'process' or 'thread' (``--engine``; the default: process, thread with --tp)."""
    if args.tp > 1:
        if args.engine == "process":
            raise SSMQError("--engine process serves one rank: with --tp the engine runs in rank 0's process "
                            "(--engine thread, the default there)")
        return "thread"
    return args.engine or "process"


def load_engine_model(args, cfg):
    """The engine process's model (``ProcessEngine``'s ``load``): the --model/--dtype/--device arguments."""
    from ssmq.runtime.model_args import load_from_args

    return load_from_args(args)[0]


def run(args: argparse.Namespace) -> int:
    from ssmq.runtime.model_args import load_from_args
    from ssmq.runtime.engine import Engine, LocalRunner
    from ssmq.runtime.tp_launch import check_tp_degree

    check_tp_degree(args.tp)
    cfg = engine_config(args)
    options = server_options(args)
    kind = engine_kind(args)
    # the engine's own lines (the KV pool's size, warnings) before uvicorn configures its loggers
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
    logger = logging.getLogger("ssmq")
    logger.addHandler(handler)
    logger.setLevel(args.log_level.upper())
    if kind == "process":  # the model loads in the engine's process; here only its tokenizer
        import functools

        from ssmq.models.loading import resolve_model_path
        from ssmq.runtime.engine_proc import ProcessEngine
        from ssmq.tokenizer import load_tokenizer

        path = resolve_model_path(args.model or default_model())
        # the engine process loads the model while this one loads the tokenizer
        engine = ProcessEngine(functools.partial(load_engine_model, args), cfg, log_level=args.log_level).launch()
        try:
            tok = load_tokenizer(path)
            import ssmq.runtime.server  # noqa: F401 - (fastapi, uvicorn) while the engine process starts
            engine.start()
            code = serve(engine, tok, args, path, options)
        finally:
            engine.shutdown()
        if code:
            raise SystemExit(code)
        return 0
    runner, rank = None, 0
    if args.tp > 1:  # every rank loads its shard; rank 0 serves, the others follow its engine's calls
        from ssmq.runtime.tp_comm import Communicator
        from ssmq.runtime.tp_launch import init_tp, load_tp_model
        from ssmq.runtime.tp_serve import BroadcastRunner, follow

        rank, _, args.device = init_tp(args.tp, args.device)
        comm = Communicator(device=args.device)
        model, tok, path = load_from_args(args, load=lambda p, dtype, device: load_tp_model(p, comm, dtype, device))
        local = LocalRunner(model, cfg)
        if rank != 0:
            follow(local)
            return 0
        runner = BroadcastRunner(local)
    else:
        model, tok, path = load_from_args(args)
    code = serve(Engine(model, cfg, runner=runner), tok, args, path, options)
    if code:  # a forced exit (a second signal during the drain)
        raise SystemExit(code)
    return 0


def serve(engine, tok, args, path, options: dict) -> int:
    from ssmq.runtime.chat import load_chat_template
    from ssmq.runtime.server import ServerConfig, run_server

    names = tuple(dict.fromkeys(n for n in (args.served_model_name, Path(str(path)).name, args.model) if n))
    template = load_chat_template(path, args.chat_template)
    stats = engine.stats()
    kv = (f", KV cache {stats['kv_blocks_total']} blocks of {engine.cfg.kv_block_size} tokens"
          if "kv_blocks_total" in stats else "")
    print(f"ssmq serve: {names[0]} on http://{args.host}:{args.port} (max batch {args.max_batch}, "
          f"max model len {args.max_model_len}, prefill chunk {engine.cfg.prefill_chunk} of "
          f"{engine.cfg.prefill_tokens} tokens a step{kv}{f', tp {args.tp}' if args.tp > 1 else ''}, chat template: "
          f"{'yes' if template is not None else 'none'}{', API key required' if args.api_key else ''})", flush=True)
    return run_server(engine, tok, ServerConfig(names, chat_template=template, **options),
                      host=args.host, port=args.port, log_level=args.log_level)
