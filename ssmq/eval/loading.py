"""Load a model to evaluate from a spec string, and say how long a sequence it supports.

Specs:
- ``PATH`` — ``ssmq.load_model(PATH)`` (a mamba_ssm / HF checkpoint folder, a quantized checkpoint folder, a Llama
  ``.gguf`` file with its own tokenizer, or a packaged name such as ``smollm2-135m``).
- ``PATH`` with ``quantized=DIR`` — the quantized checkpoint ``DIR`` of the model ``PATH`` (tokenizer from ``PATH``).
- ``hf:PATH`` — the Hugging Face ``transformers`` implementation of ``PATH`` (the independent reference), wrapped so
  that ``forward(input_ids) -> logits`` like ours.
- ``LABEL=SPEC`` — any of the above, shown as ``LABEL`` in reports.

The scorers only need ``forward(input_ids (b, l) long) -> logits (b, l, V)`` and ``.parameters()``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ssmq.errors import SSMQError

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


class HFCausalLM(torch.nn.Module):
    """Adapter: a ``transformers`` causal LM whose ``forward(input_ids)`` returns the logits tensor."""

    def __init__(self, hf_model: torch.nn.Module):
        super().__init__()
        self.hf = hf_model
        self.config = hf_model.config

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # (b, l) -> (b, l, V)
        return self.hf(input_ids=input_ids, use_cache=False).logits


@dataclass
class ModelSpec:
    label: str
    path: str
    backend: str = "ssmq"  # "ssmq" | "hf"
    quantized: str | None = None


def parse_spec(spec: str, quantized: str | None = None) -> ModelSpec:
    label = None
    head, sep, tail = spec.partition("=")
    if sep and head and "/" not in head and ":" not in head:
        label, spec = head, tail
    backend = "ssmq"
    if spec.startswith("hf:"):
        backend, spec = "hf", spec[3:]
    if not spec:
        raise SSMQError("empty model path")
    if label is None:
        label = ("hf:" if backend == "hf" else "") + Path(spec).name + (f"+{Path(quantized).name}" if quantized else "")
    return ModelSpec(label, spec, backend, quantized)


def resolve_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    """Default: bfloat16 on CUDA, float32 elsewhere (as every command)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    if dtype not in DTYPES:
        raise SSMQError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def resolve_device(device: str | None) -> str:
    if device is None or device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SSMQError(f"device {device!r} requested but CUDA is not available")
    return device


def load_for_eval(spec: ModelSpec, dtype: torch.dtype, device: str, tp_comm=None):
    """(model in eval mode, tokenizer) for a spec; with ``tp_comm``, this rank's tensor-parallel shard."""
    from ssmq.paths import PACKAGED
    from ssmq.tokenizer import load_tokenizer

    path = Path(spec.path)
    if not path.exists() and spec.path in PACKAGED:  # smollm2-135m: the GGUF file its package ships
        path = PACKAGED[spec.path].path()
    if not path.exists():
        raise SSMQError(f"model {spec.path} not found")
    if spec.backend == "hf":
        if tp_comm is not None:
            raise SSMQError("--tp shards ssmq models, not the hf: reference")
        try:
            from transformers import AutoModelForCausalLM
        except ImportError:
            raise SSMQError("hf: models need the transformers package (pip install transformers)") from None
        where = dict(pretrained_model_name_or_path=str(path.parent), gguf_file=path.name) if path.suffix == ".gguf" \
            else dict(pretrained_model_name_or_path=str(path))
        model = HFCausalLM(AutoModelForCausalLM.from_pretrained(**where, dtype=dtype)).to(device)
    else:
        from ssmq.quant import load_model

        if spec.quantized is not None and not Path(spec.quantized).exists():
            raise SSMQError(f"quantized checkpoint {spec.quantized} not found")
        if tp_comm is not None:
            from ssmq.runtime.tp_launch import load_tp_model

            model = load_tp_model(spec.quantized or path, tp_comm, dtype=dtype, device=device)
        else:
            model = load_model(spec.quantized or path, dtype=dtype, device=device)
    # a folder's tokenizer.json or a GGUF's own tokenizer; else the fallbacks of load_tokenizer
    tokenizer = load_tokenizer(path if path.is_dir() or path.suffix == ".gguf" else None)
    return model.eval(), tokenizer


def max_model_length(model) -> int | None:
    """Longest sequence the model supports, or None when unbounded (pure SSMs). Read from ``model.config``."""
    cfg = getattr(model, "config", None)
    if getattr(cfg, "arch", None) in ("mamba1", "mamba2"):  # recurrent: no positional limit
        return None
    for name in ("max_seqlen", "max_position_embeddings", "n_positions"):
        v = getattr(cfg, name, None)
        if isinstance(v, int) and v > 0:
            return v
    return None
