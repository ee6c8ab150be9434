"""The ``ssmq`` command: info, generate, quantize, and the subcommands registered by eval/ and runtime/ (serve).

Every user error ends as one line on stderr (``ssmq: error: ...``) and exit status 1.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
import time

from ssmq.errors import SSMQError
from ssmq.paths import DEFAULT_HUB_MODEL, default_model  # noqa: F401  (re-exported)
from ssmq.runtime.model_args import DTYPES, add_model_args, load_from_args  # noqa: F401  (re-exported)

# Subcommands owned by other packages; each module has register(subparsers).
PLUGIN_COMMANDS = ("ssmq.eval.command", "ssmq.quant.export_command", "ssmq.runtime.command",
                   "ssmq.runtime.plan_command", "ssmq.bench.command")
DESCRIPTION = ("Quantize, run, evaluate, benchmark and serve Mamba-1, Mamba-2, hybrid and Llama language models. "
               "Run 'ssmq COMMAND --help' for a command's options.")
DEFAULT_PROMPT = "The song was released as a single"  # the register of WikiText, the reference models' training text
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def cmd_info(args) -> None:
    from ssmq.models.loading import resolve_model_path
    from ssmq.runtime.info import describe, print_sections

    path = resolve_model_path(args.model or default_model())
    bytes_per = {"float32": 4, "float16": 2, "bfloat16": 2}[DTYPES[args.dtype or "bfloat16"]]
    print_sections(describe(path, bytes_per))
    if args.plan:  # the decode plan per layer: needs the weights (quantizers, state scales)
        import torch

        from ssmq.runtime.layer_plans import plan_lines

        dtype = getattr(torch, DTYPES[args.dtype or "bfloat16"])
        print("\n".join(plan_lines(load_from_args(args)[0], dtype)))


def _utf8(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SSMQError(f"{where} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})") from None


def read_prompts(args) -> list[str]:
    """--prompt texts (argv as the OS gave it), then --prompt-file contents (a path, or - for stdin; one trailing
    newline dropped); the default prompt when neither is given. Non-UTF-8 bytes and empty prompts are refused."""
    prompts = []
    for i, p in enumerate(args.prompt or []):
        # argv bytes that are not UTF-8 arrive as lone surrogates (os.fsdecode): give the bytes back to decode them
        prompts.append(_utf8(os.fsencode(p), f"--prompt #{i + 1}"))
    for f in args.prompt_file or []:
        if f == "-":
            data, where = sys.stdin.buffer.read(), "the prompt on stdin"
        else:
            try:
                data, where = open(f, "rb").read(), f"--prompt-file {f}"
            except OSError as e:
                raise SSMQError(f"--prompt-file {f}: {e.strerror or e}") from None
        text = _utf8(data, where)
        prompts.append(text[:-1] if text.endswith("\n") else text)
    if any(not p for p in prompts):
        raise SSMQError("a prompt is empty")
    return prompts or [DEFAULT_PROMPT]


def max_new_tokens(model, prompt_lens: list[int], asked: int) -> int:
    """``asked``, or fewer with a warning where a prompt plus ``asked`` runs past the positions of a model with
    attention layers (``max_position_embeddings``; SSM layers have no position limit), as the server's
    ``--max-model-len`` bounds a request. A prompt that alone fills the context is refused."""
    cfg = model.config
    if not cfg.attention_layers():
        return asked
    context, longest = cfg.max_position_embeddings, max(prompt_lens)
    if longest >= context:
        raise SSMQError(f"the prompt has {longest} tokens; this model's context is {context} positions")
    if longest + asked > context:
        print(f"ssmq: warning: --max-new-tokens {asked} runs past this model's context of {context} positions "
              f"(prompt {longest} tokens): generating at most {context - longest}", file=sys.stderr)
        return context - longest
    return asked


def cmd_generate(args) -> None:
    from ssmq.runtime.command import state_checkpoint
    from ssmq.runtime.generate import stream_generate
    from ssmq.runtime.sampling import SamplingParams, seed_problem

    run = {"state_checkpoint": state_checkpoint(args)}  # checked before the model loads
    if seed_problem(args.seed):  # the server's rule, before any work
        raise SSMQError(f"--{seed_problem(args.seed)}")
    if args.max_new_tokens < 1:
        raise SSMQError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    prompts = read_prompts(args)
    model, tok, _ = load_from_args(args)
    from ssmq.models.cache import int8_state_note

    note = int8_state_note(model, run["state_checkpoint"])
    if note:
        print(f"note: {note}", file=sys.stderr)
    ids = tok.encode_batch(prompts)
    if any(not i for i in ids):
        raise SSMQError("a prompt encodes to no tokens")
    vocab = model.config.vocab_size
    if (top := max(max(i) for i in ids)) >= vocab:
        raise SSMQError(f"a prompt has token id {top}, beyond the model's vocabulary of {vocab}: the tokenizer does not "
                        "match the model")
    n_new = max_new_tokens(model, [len(i) for i in ids], args.max_new_tokens)
    params = SamplingParams(max_new_tokens=n_new, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, eos_id=tok.eos_id, vocab_limit=len(tok), seed=args.seed,
                            stop_at_eos=not args.ignore_eos)
    if model.device.type == "cuda" and not args.eager:  # decode from CUDA graphs over the decoder's cache
        from ssmq.runtime.cuda_graph import CudaGraphDecoder

        dec = CudaGraphDecoder(model, max_batch=len(ids), max_seqlen=max(map(len, ids)) + n_new,
                               state_checkpoint=run["state_checkpoint"])
        dec.capture(len(ids))  # before the first token (smaller batches, after rows end, capture when they occur)
        run = {"cache": dec.cache, "decode_fn": dec}
    clock = TokenClock()
    if len(prompts) == 1:  # stream: print the new text as each token arrives
        print(prompts[0], end="", flush=True)
        out: list[int] = []
        shown = ""
        for _, t in clock.ticks(stream_generate(model, ids, params, **run)):
            out.append(t)
            text = tok.decode(out)
            print(text[len(shown):], end="", flush=True)
            shown = text
        print()
    else:
        outs: list[list[int]] = [[] for _ in prompts]
        for row, t in clock.ticks(stream_generate(model, ids, params, **run)):
            outs[row].append(t)
        for prompt, out in zip(prompts, outs):
            print(f"--- {prompt!r}\n{prompt}{tok.decode(out)}")
    if args.timing:
        print(clock.summary(len(ids), max(map(len, ids))), file=sys.stderr)


class TokenClock:
    """Wall-clock times of a generation as its caller sees the tokens: from the first request to the first token
    (TTFT), and between the steps that follow (a step: the tokens of every running row, which arrive together)."""

    def __init__(self):
        self.start = 0.0
        self.steps: list[float] = []  # arrival time of each step's first token
        self.tokens = 0
        self.first_step_tokens = 0

    def ticks(self, pairs):
        """Pass ``(row, token)`` pairs through, timing them; a step begins where a row repeats."""
        self.start = time.perf_counter()
        seen: set[int] = set()
        for row, t in pairs:
            if row in seen or not self.steps:
                self.steps.append(time.perf_counter())
                seen.clear()
            seen.add(row)
            self.tokens += 1
            self.first_step_tokens += len(self.steps) == 1
            yield row, t

    def summary(self, rows: int, prompt_len: int) -> str:
        ttft = (self.steps[0] - self.start) * 1e3
        gaps = sorted(b - a for a, b in zip(self.steps, self.steps[1:]))
        line = f"timing: {rows} x {prompt_len} prompt tokens, TTFT {ttft:.1f} ms, {self.tokens} tokens"
        if gaps:
            median, mean = gaps[len(gaps) // 2] * 1e3, sum(gaps) / len(gaps) * 1e3
            rate = (self.tokens - self.first_step_tokens) / (self.steps[-1] - self.steps[0])
            line += f", TPOT {median:.3f} ms median ({mean:.3f} mean) over {len(gaps)} steps, {rate:.0f} tok/s"
        return line


def add_state_checkpoint_arg(p: argparse.ArgumentParser) -> None:
    from ssmq.runtime.command import add_state_checkpoint_arg as add

    add(p)


def add_tp_args(p: argparse.ArgumentParser) -> None:
    from ssmq.runtime.tp_launch import add_tp_args as add

    add(p)


def cmd_quantize(args) -> None:
    from pathlib import Path

    from ssmq.paths import check_output_location, human_bytes
    from ssmq.quant import check, get_recipe, load_calibration, quantize, save_quantized
    from ssmq.quant.checkpoint import predicted_bytes, source_bytes, source_dtype

    recipe = get_recipe(args.recipe)
    out = Path(args.out).expanduser()
    if out.exists() and not args.overwrite:
        raise SSMQError(f"output folder {out} already exists (pass --overwrite to replace it)")
    check_output_location(out)  # writable, before the model loads
    model, tok, path = load_from_args(args)
    targets = check(recipe, model)  # before the (slow) calibration data
    dtype = source_dtype(path)
    extra = [Path(path) / f for f in TOKENIZER_FILES if (Path(path) / f).is_file()]
    need = predicted_bytes(model, targets, recipe.embedding, dtype) + sum(f.stat().st_size for f in extra)
    check_output_location(out, need)  # room for the checkpoint, before the (slow) quantization
    calib = None
    if recipe.needs_calibration():
        calib = load_calibration(args.calib, args.calib_samples, args.calib_seqlen, args.calib_seed, tok)
    quantize(model, recipe, calib, batch_size=args.batch_size)
    with tempfile.TemporaryDirectory() as tmp:
        if Path(path).suffix == ".gguf":  # the tokenizer lives in the GGUF: keep it beside the quantized weights
            extra.append(Path(tmp) / "tokenizer.json")
            tok.backend.save(str(extra[-1]))
        save_quantized(model, out, extra_files=extra, overwrite=args.overwrite, dtype=dtype)
    n = len([m for m in model.modules() if hasattr(m, "wspec")])
    states = len([m for m in model.modules() if getattr(m, "int8_state", False)])
    convs = len([m for m in model.modules() if getattr(m, "conv_format", "")])
    sizes = f"weights {human_bytes(source_bytes(path))} -> {human_bytes(source_bytes(out))}"
    extras = [f"int8 SSM state in {states} layers"] * bool(states) + [f"int8 conv1d in {convs} layers"] * bool(convs)
    print(f"quantized {n} modules with {recipe.name}" + (f" ({', '.join(extras)})" if extras else "")
          + f" -> {out} ({sizes})")


def add_quantize_parser(sub) -> None:
    from ssmq.quant import RECIPES

    p = sub.add_parser("quantize", help="quantize a model by a recipe and save it (safetensors + quantization.json)",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="recipes:\n" + "\n".join(f"  {n:<18} {r.description}" for n, r in RECIPES.items()))
    add_model_args(p)
    p.add_argument("--recipe", required=True, help="a recipe name (below), A+B (a recipe plus a KV-only one, e.g. "
                   "ssdi8-w8a8+kvquant-nuq3-1%%) or a recipe JSON file")
    p.add_argument("--out", required=True, help="output folder (must not exist unless --overwrite)")
    p.add_argument("--calib", default=None, help="calibration text: a .txt or .txt.gz file, or a "
                   "file name in data/train/ of the data folder $SSMQ_SHARED (default wikitext2_train.txt.gz there)")
    p.add_argument("--calib-samples", type=int, default=512, help="calibration windows (default 512)")
    p.add_argument("--calib-seqlen", type=int, default=512, help="tokens per window (default 512)")
    p.add_argument("--calib-seed", type=int, default=0, help="seed of the windows drawn (default 0)")
    p.add_argument("--batch-size", type=int, default=8, help="calibration windows per forward (default 8)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists (atomically)")
    p.set_defaults(func=cmd_quantize)


def build_parser() -> argparse.ArgumentParser:
    from ssmq.version import __version__

    parser = argparse.ArgumentParser(prog="ssmq", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"ssmq {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="architecture, parameters, weight/state/KV bytes of a model")
    add_model_args(p)
    p.add_argument("--plan", action="store_true", help="also load the model and print each layer's decode plan "
                   "(executor, kernels on CUDA, state / KV and linear formats)")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("generate", help="continue a prompt (streams tokens)")
    add_model_args(p)
    p.add_argument("--prompt", action="append", help=f"prompt text; repeat for a batch (default: '{DEFAULT_PROMPT}')")
    p.add_argument("--prompt-file", action="append", metavar="PATH",
                   help="read a prompt from a UTF-8 file (- for stdin; one trailing newline dropped); repeatable, "
                        "after the --prompt texts")
    p.add_argument("--max-new-tokens", type=int, default=48,
                   help="tokens to generate (default 48); past the positions of a model with attention layers it "
                        "is lowered to fit, with a warning")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature; 0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens; 0 = all (default 0)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling: the smallest set of tokens whose "
                   "probability reaches p (default 0.95)")
    p.add_argument("--seed", type=int, default=0,
                   help="sampling seed in [0, 2**63): the same seed gives the same text (default 0)")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-text token")
    p.add_argument("--eager", action="store_true", help="on CUDA, decode without CUDA graphs")
    p.add_argument("--timing", action="store_true", help="print to stderr the time to the first token and per "
                   "token (TPOT) as the tokens arrived, printing included")
    add_state_checkpoint_arg(p)
    add_tp_args(p)
    p.set_defaults(func=cmd_generate)

    add_quantize_parser(sub)
    for module in PLUGIN_COMMANDS:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name is None or not module.startswith(e.name):
                raise
            continue
        mod.register(sub)
    return parser


def environment_error_line(e: BaseException) -> str | None:
    """One line naming the path and the cause of an error of the environment (file system, a corrupt file) that
    reached the CLI, or None for an error of another kind."""
    import errno

    if isinstance(e, OSError):
        cause = "read-only file system" if e.errno == errno.EROFS else (
            "no space left on the device" if e.errno == errno.ENOSPC else (e.strerror or str(e) or type(e).__name__))
        paths = " -> ".join(str(p) for p in (e.filename, e.filename2) if p is not None)
        return f"{paths}: {cause}" if paths else cause
    if type(e).__name__ == "SafetensorError":  # safetensors' Rust errors: a truncated or corrupt file
        return f"unreadable safetensors file: {str(e).splitlines()[0][:200] if str(e) else type(e).__name__}"
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from ssmq.kernels.policy import set_policy
        from ssmq.runtime.kernel_policy import policy_from_env

        set_policy(policy_from_env())  # the kernels' policy, once, before any model runs
        args.func(args)
    except SSMQError as e:
        print(f"ssmq: error: {e}", file=sys.stderr)
        return 1
    except Exception as e:
        line = environment_error_line(e)
        if line is not None:
            print(f"ssmq: error: {line}", file=sys.stderr)
            return 1
        if getattr(args, "tp", 1) <= 1:
            raise
        # a tensor-parallel rank: one line, then torchrun stops the rest
        from ssmq.runtime.tp_launch import failure_line

        print(failure_line(e, int(os.environ.get("RANK", 0))), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("ssmq: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
