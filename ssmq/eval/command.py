"""``ssmq eval``: perplexity and the zero-shot suite for one model, or a side-by-side comparison of several.

    ssmq eval --model MODEL --tasks wikitext2,lambada --limit 100 --out results.json
    ssmq eval --compare fp16=MODEL w4a8=out/mamba2-w4a8 --tasks all --out cmp.json

Wire-up: ``ssmq.eval.command.register(subparsers)`` adds the subcommand with ``func=run`` (``run(args) -> int``).
Standalone: ``python -m ssmq.eval.command ...`` (same arguments).
"""

from __future__ import annotations

import argparse
import sys

from ssmq.errors import SSMQError

DESCRIPTION = """Perplexity and zero-shot accuracy of one model, or several side by side.

  ssmq eval --model MODEL --tasks wikitext2,lambada --limit 100 --out results.json
  ssmq eval --compare fp16=MODEL w4a8=out/mamba2-w4a8 --tasks all --out cmp.json

Evaluation data (WikiText-2, the zero-shot tasks) is read offline from data/eval/ of the data folder
($SSMQ_SHARED); ppl:PATH scores any text file.
"""
HELP_TASKS = ("comma-separated: wikitext2, wikitext2-decode (through the decode path and the cache), lambada_openai "
              "(lambada), hellaswag, piqa, arc_easy, arc_challenge, winogrande, mmlu, ppl:PATH (perplexity of a text "
              "file), or all (default)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model folder; hf:PATH for the transformers reference; LABEL=PATH to name it")
    p.add_argument("--quantized", help="quantized checkpoint folder of --model")
    p.add_argument("--compare", nargs="+", metavar="MODEL",
                   help="evaluate several models on the same data; deltas against the first")
    p.add_argument("--tasks", default="all", help=HELP_TASKS)
    p.add_argument("--limit", type=int, help="first N documents per task (MMLU: per subject; wikitext2: windows)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per forward (default 16)")
    p.add_argument("--max-batch-tokens", type=int, default=32768,
                   help="cap on padded tokens per forward, bounding the (rows, length, vocab) logits (default 32768)")
    p.add_argument("--ppl-batch-size", type=int, help="windows per forward for perplexity (default: --batch-size)")
    p.add_argument("--seqlen", type=int, default=2048, help="perplexity window length in tokens (default 2048)")
    p.add_argument("--max-length", type=int, default=2048,
                   help="zero-shot requests are left-truncated to this many tokens (lm-eval's default 2048)")
    p.add_argument("--dtype", default="auto", help="float16 | bfloat16 | float32 (default: bfloat16 on CUDA, "
                   "float32 on the CPU, as every command)")
    p.add_argument("--device", default="auto", help="cuda | cuda:N | cpu (default: cuda when available)")
    p.add_argument("--state-checkpoint", type=int, metavar="K",
                   help="wikitext2-decode: SSM states checkpointed every K decode steps (ReplaySSM) instead of written "
                        "every step")
    p.add_argument("--out", help="results JSON path (a Markdown table and a PNG chart are written beside it)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    from ssmq.runtime.tp_launch import add_tp_args

    add_tp_args(p)


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("eval", help="perplexity, zero-shot accuracy (lm-eval definitions), comparisons",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from ssmq.eval import report, suite

    if args.model and args.compare:
        raise SSMQError("give either --model M or --compare A B ..., not both")
    if not args.model and not args.compare:
        from ssmq.paths import default_model

        args.model = default_model()
    if args.compare and args.quantized:
        raise SSMQError("--quantized goes with --model; in --compare give each quantized checkpoint folder itself")
    suite.check_limit(args.limit)
    for name, v in (("--batch-size", args.batch_size), ("--seqlen", args.seqlen), ("--max-length", args.max_length),
                    ("--max-batch-tokens", args.max_batch_tokens), ("--ppl-batch-size", args.ppl_batch_size),
                    ("--state-checkpoint", args.state_checkpoint)):
        if v is not None and v < 1:
            raise SSMQError(f"{name} must be positive, got {v}")
    task_names = suite.parse_tasks(args.tasks)
    if args.device not in (None, "auto"):  # a device name that cannot be is told before any data or model is read
        from ssmq.eval.loading import resolve_device

        resolve_device(args.device)
    if args.out:  # a results path that cannot be written is told before the (long) evaluation
        from ssmq.paths import check_output_location

        check_output_location(args.out)
    if any(not n.startswith("ppl:") for n in task_names):
        suite.data_dir()  # fail before loading any model when the data folder is missing
    kwargs = dict(limit=args.limit, batch_size=args.batch_size, seqlen=args.seqlen, max_length=args.max_length,
                  ppl_batch_size=args.ppl_batch_size, max_batch_tokens=args.max_batch_tokens,
                  progress=not args.no_progress, dtype=args.dtype,
                  device=args.device, state_checkpoint=args.state_checkpoint)
    if args.tp > 1:  # every rank runs the same evaluation on its shard; rank 0 prints and writes
        from ssmq.runtime.tp_launch import start_tp

        comm, device = start_tp(args, None if args.device == "auto" else args.device)
        kwargs.update(device=device, tp_comm=comm)
        if comm.rank != 0:
            args.out = None
    if args.compare:
        runs = report.compare(args.compare, task_names, **kwargs)
    else:
        runs = [report.evaluate_spec(args.model, task_names, quantized=args.quantized, **kwargs)]
    print(report.markdown(runs))
    if args.out:
        paths = report.write(runs, args.out)
        print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ssmq.eval.command", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    try:
        return run(p.parse_args(argv))
    except SSMQError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
