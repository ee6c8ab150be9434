"""``--model/--dtype/--device``: the arguments of every command that loads a model, and the loader they feed.

Here (runtime) and not in ``ssmq.cli`` so that the subcommands other packages own (``ssmq serve``) can use
them without importing the CLI above them (docs/architecture.md: imports flow one way).
"""

from __future__ import annotations

import argparse

from ssmq.errors import SSMQError
from ssmq.paths import default_model

DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
          "bfloat16": "bfloat16", "bf16": "bfloat16"}


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--model/--dtype/--device, shared by every subcommand that loads a model."""
    p.add_argument("--model", default=None, help="checkpoint folder, .gguf file or hub id (default: $SSMQ_MODEL, "
                   "else models/mamba2 of the data folder $SSMQ_SHARED when present, else the hub id "
                   "state-spaces/mamba2-130m)")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                   help="weights and activations (default: bfloat16 on CUDA, float32 on the CPU)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available)")


def load_from_args(args, load=None):
    """(model, tokenizer, model path) from the --model/--dtype/--device arguments; float or quantized folders.

    ``load(path, dtype, device)`` replaces ``load_model`` (e.g. loading this rank's tensor-parallel shard);
    otherwise ``args.tp`` > 1 starts this rank's tensor-parallel group and loads its shard (< 1 is refused)."""
    import torch

    from ssmq.models.loading import resolve_model_path
    from ssmq.quant import load_model
    from ssmq.tokenizer import load_tokenizer

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SSMQError(f"--device {device} asked for, but CUDA is not available on this machine")
    default_dtype = "bfloat16" if device.startswith("cuda") else "float32"
    dtype = getattr(torch, DTYPES[args.dtype or default_dtype])
    if load is None and getattr(args, "tp", 1) != 1:  # a caller's own ``load`` has already joined its group
        from ssmq.runtime.tp_launch import load_tp_model, start_tp

        # join the group first: a --tp run started without torchrun is told so before any model lookup
        comm, device = start_tp(args, device)
        path = resolve_model_path(args.model or default_model())
        return load_tp_model(path, comm, dtype=dtype, device=device), load_tokenizer(path), path
    path = resolve_model_path(args.model or default_model())
    model = (load or (lambda p, dtype, device: load_model(p, dtype=dtype, device=device)))(path, dtype, device).eval()
    return model, load_tokenizer(path), path
