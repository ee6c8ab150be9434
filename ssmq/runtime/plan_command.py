"""``ssmq plan``: the memory plan of a model on one GPU — weights, KV bytes per token, SSM-state bytes per
sequence, the longest context at --batch and the largest batch at --context that fit in --gpu-mem.

    ssmq plan --model smollm2-135m --gpu-mem 24GiB --context 8192 --batch 16 --kv nuq3-1% --out plan/
    ssmq plan --model bamba-9b                        # a published architecture (ssmq.models.published)
    ssmq plan --quantized out/mamba2-quamba2          # weights as stored, the recipe's state dtype

The arithmetic is ``ssmq.runtime.plan``; --out writes plan.json and plan.png (memory vs context).
Wire-up: ``register(subparsers)`` (``ssmq.cli`` PLUGIN_COMMANDS).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ssmq.errors import SSMQError
from ssmq.models.config import ModelConfig
from ssmq.paths import check_output_location
from ssmq.runtime.plan import (CacheFormat, Plan, cache_bytes, fit, human, kv_bytes_per_token, make_plan,
                               parse_bytes, parse_reserve, state_bytes)

DESCRIPTION = """The memory plan of a model on one GPU: weights, KV bytes per token, SSM-state bytes per sequence,
the longest context at --batch and the largest batch at --context that fit in --gpu-mem.

  ssmq plan --model smollm2-135m --gpu-mem 24GiB --context 8192 --batch 16 --kv nuq3-1% --out plan/
  ssmq plan --model bamba-9b                        # a published architecture, no weights needed
  ssmq plan --quantized out/mamba2-quamba2          # weights as stored, the recipe's state dtype
"""

# the formats every plan compares (KV rows only for models with attention, int8 state only with SSM layers)
COMPARE_KV = ("fp8", "int8", "int4", "nuq4", "nuq4-1%", "nuq3-1%", "nuq2-1%")  # beside the 16-bit baseline
STATE_DTYPES = ("float32", "float16", "bfloat16", "int8", "int8-rows")  # int8-rows: + a float32 scale a state row
FLOAT_KV = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}  # the KVState of a model in that dtype


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ssmq.runtime.model_args import DTYPES

    p.add_argument("--model", default=None, help="a published architecture name (e.g. mamba2-2.7b, bamba-9b, "
                   "llama-3.1-8b, smollm2-135m), a checkpoint folder, .gguf file or hub id (default: as ssmq info)")
    p.add_argument("--quantized", default=None, help="a quantized folder (ssmq quantize / compressed-tensors): "
                   "its stored weight bytes and its recipe's state dtype; --model may then be left out")
    p.add_argument("--gpu-mem", default="80GiB", help="GPU memory (default 80GiB; GB = 10^9, GiB = 2^30)")
    p.add_argument("--reserve", default="10%", help="CUDA context, workspaces and activations, left out of "
                   "--gpu-mem: a size or a percentage of it (default 10%%, as vLLM's 0.9 memory utilization)")
    p.add_argument("--context", type=int, default=4096, help="tokens per sequence for the largest batch (default 4096)")
    p.add_argument("--batch", type=int, default=1, help="sequences for the longest context (default 1)")
    p.add_argument("--kv", default=None, help="KV format: fp16 / bf16 / fp32, a KV preset (kvquant-nuq3-1%%, "
                   "kv-fp8-e4m3, ...) or its short name (nuq3-1%%, fp8, int8, ...), costed as the quantized cache "
                   "stores it (default: the recipe's, else the float cache of --dtype)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES),
                   help="weights and activations (conv state) of a float model (default bfloat16)")
    p.add_argument("--state-dtype", default=None, choices=STATE_DTYPES,
                   help="SSM state (default: the recipe's, else --dtype)")
    p.add_argument("--out", default=None, help="folder for plan.json and plan.png")


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("plan", help="GPU memory plan: weights, KV per token, SSM state, what fits",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)
    return p


# ---------------------------------------------------------------- inputs

def model_config(name: str) -> tuple[ModelConfig, str]:
    """(config, display name) of a published architecture name or anything ``--model`` loads."""
    from ssmq.models.loading import load_config, resolve_model_path
    from ssmq.models.published import PUBLISHED

    if name in PUBLISHED:
        return PUBLISHED[name], name
    path = resolve_model_path(name)
    return load_config(path)[0], str(name)


def safetensors_bytes(folder: Path) -> int:
    """Bytes of the tensors stored in the folder's *.safetensors files (each file less its header)."""
    import struct

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise SSMQError(f"{folder}: no *.safetensors weights")
    total = 0
    for f in files:
        with open(f, "rb") as fh:
            head = fh.read(8)
        if len(head) < 8:
            raise SSMQError(f"{f} is not a safetensors file")
        total += f.stat().st_size - 8 - struct.unpack("<Q", head)[0]
    return total


def quantized_info(folder_arg: str) -> dict:
    """{cfg, weights, source, state_dtype, kv} of a quantized folder (state_dtype / kv None: not set by it)."""
    from ssmq.models.loading import load_config
    from ssmq.quant.checkpoint import MANIFEST, read_manifest
    from ssmq.quant.compressed_tensors.load import is_compressed_tensors
    from ssmq.quant.recipe import Recipe

    folder = Path(folder_arg)
    if not folder.is_dir():
        raise SSMQError(f"--quantized {folder} is not a folder")
    if (folder / MANIFEST).exists():
        manifest = read_manifest(folder)
        recipe = Recipe.from_dict(manifest["recipe"])
        cfg = ModelConfig.from_dict(manifest["model_config"])
        state = None if recipe.cache.state_bits != 8 else "int8-rows" if recipe.cache.state_scales == "dynamic" else "int8"
        kv, what = recipe.cache.kv, f"recipe {recipe.name}"
    elif is_compressed_tensors(folder):
        cfg, state, kv, what = load_config(folder)[0], None, None, "compressed-tensors"
    else:
        raise SSMQError(f"--quantized {folder} is not a quantized checkpoint (no {MANIFEST}, not compressed-tensors)")
    return {"cfg": cfg, "weights": safetensors_bytes(folder), "source": f"tensors of {folder} as stored ({what})",
            "state_dtype": state, "kv": kv}


def resolve(args) -> tuple[ModelConfig, str, CacheFormat, dict]:
    """(config, name, the plan's cache format, {weights, source} or {}) from the arguments."""
    from ssmq.paths import default_model
    from ssmq.models.kv_format import kv_format
    from ssmq.runtime.model_args import DTYPES

    act = DTYPES[args.dtype]
    quant = quantized_info(args.quantized) if args.quantized else {}
    if quant:
        cfg, name = quant["cfg"], args.quantized
        if args.model is not None and model_config(args.model)[0] != cfg:
            raise SSMQError(f"--model {args.model} is not the architecture of --quantized {args.quantized}")
    else:
        cfg, name = model_config(args.model or default_model())
    state = args.state_dtype or quant.get("state_dtype") or act
    fmt = CacheFormat(act, state, kv_format(args.kv or quant.get("kv") or FLOAT_KV[act]))
    weights = {"weights": quant["weights"], "weights_source": quant["source"]} if quant else {}
    return cfg, name, fmt, weights


def compared_formats(cfg: ModelConfig, fmt: CacheFormat) -> list[CacheFormat]:
    """The plan's format first, then the 16-bit baseline, int8 state (SSM models), each KV format (attention)."""
    from ssmq.models.kv_format import kv_format

    half = fmt.act_dtype if fmt.act_dtype != "float32" else "bfloat16"
    out = [fmt, CacheFormat(fmt.act_dtype, half, kv_format(FLOAT_KV[half]))]
    if cfg.ssm_layers():
        out.append(CacheFormat(fmt.act_dtype, "int8", kv_format(FLOAT_KV[half])))
    if cfg.attention_layers():
        out += [CacheFormat(fmt.act_dtype, fmt.state_dtype, kv_format(k)) for k in COMPARE_KV]
    unique: dict[str, CacheFormat] = {}
    for f in out:
        unique.setdefault(f.label(cfg), f)
    return list(unique.values())


# ---------------------------------------------------------------- output

def format_rows(plan: Plan, cfg: ModelConfig, formats: list[CacheFormat]) -> list[dict]:
    rows = []
    for f in formats:
        state, kv = sum(state_bytes(cfg, f).values()), kv_bytes_per_token(cfg, f.kv)
        max_context, max_batch = fit(plan.budget, state, kv, plan.batch, plan.context)
        rows.append({"format": f.label(cfg), "state_dtype": f.state_dtype, "kv": f.kv.name, "kv_bytes_per_token": kv,
                     "state_bytes_per_sequence": state, "max_context": max_context, "max_batch": max_batch,
                     "memory_at_batch_context": plan.memory(plan.batch, plan.context, cfg, f)})
    return rows


def _context(n: int | None) -> str:
    return "unbounded (no KV)" if n is None else f"{n:,}"


def report(plan: Plan, rows: list[dict]) -> str:
    """The printed plan: the inputs and answers, then one row per compared format."""
    state = plan.state
    kv_what = f"({plan.format.kv.name})" if plan.kv_per_token else "(no attention layers)"
    state_what = (f"(conv {human(state['conv'])} {plan.format.act_dtype}, ssm {human(state['ssm'])} "
                  f"{plan.format.state_dtype})" if sum(state.values()) else "(no SSM layers)")
    lines = [
        f"{'model':<26} {plan.model} ({plan.arch}; layers {plan.layers})",
        f"{'weights':<26} {human(plan.weights)} ({plan.weights_source})",
        f"{'KV cache per token':<26} {human(plan.kv_per_token)} {kv_what}",
        f"{'SSM state per sequence':<26} {human(sum(state.values()))} {state_what}",
        f"{'GPU memory':<26} {human(plan.gpu_mem)} - reserve {human(plan.reserve)} - weights = "
        f"{human(plan.budget)} for the cache",
        f"{'longest context':<26} " + (f"{plan.max_context:,} tokens" if plan.max_context is not None else
                                        "unbounded (no KV cache: memory does not grow with context)")
        + f" at batch {plan.batch}",
        f"{'largest batch':<26} {plan.max_batch:,} at context {plan.context:,}",
    ]
    head = f"{'format':<30} {'KV/token':>11} {'state/seq':>11} {'ctx @ b=' + str(plan.batch):>24} " \
           f"{'batch @ ' + str(plan.context):>12} {'mem @ b, ctx':>12}"
    lines += ["", head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['format']:<30} {human(r['kv_bytes_per_token']):>11} "
                     f"{human(r['state_bytes_per_sequence']):>11} {_context(r['max_context']):>24} "
                     f"{r['max_batch']:>12,} {human(r['memory_at_batch_context']):>12}")
    return "\n".join(lines)


def run(args) -> None:
    from ssmq.runtime.plan_plot import contexts, plot

    gpu_mem = parse_bytes(args.gpu_mem, "--gpu-mem")
    if args.out is not None:  # before any work: a folder that cannot be written is told at once
        out = Path(args.out)
        if out.exists() and not out.is_dir():
            raise SSMQError(f"--out {out} is a file, not a folder")
        check_output_location(out / "plan.json", what="--out")
    cfg, name, fmt, weights = resolve(args)
    plan = make_plan(cfg, name, fmt, gpu_mem, parse_reserve(args.reserve, gpu_mem), args.batch, args.context,
                     **weights)
    formats = compared_formats(cfg, fmt)
    rows = format_rows(plan, cfg, formats)
    print(report(plan, rows))
    if args.out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    xs = contexts(plan, formats, cfg)
    curves = {f.label(cfg): [plan.memory(plan.batch, x, cfg, f) for x in xs] for f in formats}
    doc = {"plan": plan.to_dict(), "model_config": cfg.to_dict(), "formats": rows,
           "memory_vs_context": {"batch": plan.batch, "context": xs, "bytes": curves},
           "cache_bytes_at_batch_context": cache_bytes(cfg, fmt, plan.batch, plan.context)}
    (out / "plan.json").write_text(json.dumps(doc, indent=2))
    drawn = plot(plan, formats, cfg, out / "plan.png")
    print(f"\nwrote {out / 'plan.json'}" + (f" and {out / 'plan.png'}" if drawn else ""))
