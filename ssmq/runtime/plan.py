"""Memory plan: what a model needs on one GPU for a batch of sequences, and what fits.

    memory(b, L) = weights + reserve + b · (state + L · kv)

weights: parameters × bytes of --dtype, or the bytes of a quantized folder's tensors as stored; state: per
sequence, conv (activation dtype) + SSM state (the recipe's state dtype: int8 = 1 byte); kv: per token of one
sequence, every attention layer's keys and values in a KV format (``ssmq.models.kv_format``); reserve: the
CUDA context, workspaces and activations (decode and chunked prefill), a stated amount. The cache terms are
exactly what ``SSMLM.allocate_cache(b, L)`` allocates (``InferenceCache.nbytes``) for the float formats.

Glossary: b batch (sequences, cache slots), L context (tokens per sequence, the cache's max_seqlen).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from ssmq.errors import SSMQError
from ssmq.models.config import ModelConfig
from ssmq.models.kv_format import KVFormat
from ssmq.runtime.footprint import layers_text, parameter_count, state_elements

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}


@dataclass
class CacheFormat:
    """How one sequence's cache is stored: activation dtype (conv state), SSM state dtype, KV format."""

    act_dtype: str
    state_dtype: str
    kv: KVFormat

    def label(self, cfg: ModelConfig) -> str:
        """'state int8, KV nuq3-1%' — each part only where the model has that kind of layer."""
        parts = ([f"state {self.state_dtype}"] if cfg.ssm_layers() else []) + \
                ([f"KV {self.kv.name}"] if cfg.attention_layers() else [])
        return ", ".join(parts) or "no cache"


def state_bytes(cfg: ModelConfig, fmt: CacheFormat) -> dict[str, int]:
    """Per sequence: {"conv", "ssm"} bytes (conv in the activation dtype, SSM state in the state dtype; "int8-rows":
    int8 codes + a float32 scale per row of d_state codes, the dynamic row scales)."""
    n = state_elements(cfg)
    if fmt.state_dtype == "int8-rows":
        ssm = n["ssm"] + 4 * (n["ssm"] // cfg.d_state if n["ssm"] else 0)
    else:
        ssm = n["ssm"] * DTYPE_BYTES[fmt.state_dtype]
    return {"conv": n["conv"] * DTYPE_BYTES[fmt.act_dtype], "ssm": ssm}


def kv_bytes_per_token(cfg: ModelConfig, kv: KVFormat) -> float:
    """Per token of one sequence: Σ over attention layers of that layer's key + value bytes; 0 without attention."""
    n = len(cfg.attention_layers())
    return n * kv.bytes_per_token(cfg.attn_kv_heads, cfg.attn_head_dim) if n else 0.0


def cache_bytes(cfg: ModelConfig, fmt: CacheFormat, batch: int, context: int) -> int:
    """Bytes of a cache of ``batch`` slots × ``context`` tokens (rounded up to whole bytes)."""
    per_seq = sum(state_bytes(cfg, fmt).values()) + context * kv_bytes_per_token(cfg, fmt.kv)
    return math.ceil(batch * per_seq)


def float_weight_bytes(cfg: ModelConfig, dtype: str) -> int:
    """Parameters (tied embeddings counted once) × bytes of ``dtype``."""
    return parameter_count(cfg)["total"] * DTYPE_BYTES[dtype]


@dataclass
class Plan:
    """The inputs and answers of one plan; ``max_context`` None = unbounded (no KV cache: memory is flat in L)."""

    model: str
    arch: str
    layers: str
    weights: int
    weights_source: str
    format: CacheFormat
    gpu_mem: int
    reserve: int
    batch: int
    context: int
    state: dict[str, int] = field(default_factory=dict)
    kv_per_token: float = 0.0
    max_context: int | None = 0
    max_batch: int = 0

    @property
    def budget(self) -> int:
        """Bytes left for the cache: GPU memory − reserve − weights (negative: the weights do not fit)."""
        return self.gpu_mem - self.reserve - self.weights

    def memory(self, batch: int, context: int, cfg: ModelConfig, fmt: CacheFormat | None = None) -> int:
        return self.weights + self.reserve + cache_bytes(cfg, fmt or self.format, batch, context)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["format"] = {"act_dtype": self.format.act_dtype, "state_dtype": self.format.state_dtype,
                       "kv": asdict(self.format.kv)}
        d["budget"] = self.budget
        return d


def fit(budget: int, state_per_seq: int, kv_per_token: float, batch: int, context: int) -> tuple[int | None, int]:
    """(longest context at ``batch``, largest batch at ``context``) with batch · (state + L · kv) ≤ budget.

    Longest context: None when there is no KV cache and the state fits (memory does not grow with L), 0 when
    not even an empty context fits.
    """
    if budget <= 0:
        return 0, 0
    left = budget / batch - state_per_seq
    if left < 0:
        max_context = 0
    elif kv_per_token == 0:
        max_context = None
    else:
        max_context = int(left // kv_per_token)
    per_seq = state_per_seq + context * kv_per_token
    max_batch = int(budget // per_seq) if per_seq > 0 else 0  # a model with no cache at all: batch unbounded
    return max_context, max_batch


def make_plan(cfg: ModelConfig, model: str, fmt: CacheFormat, gpu_mem: int, reserve: int, batch: int, context: int,
              weights: int | None = None, weights_source: str = "") -> Plan:
    """The plan of ``cfg`` in ``fmt`` on ``gpu_mem`` bytes; ``weights`` default: parameters × activation dtype."""
    if batch < 1 or context < 1:
        raise SSMQError(f"--batch and --context must be at least 1 (got {batch}, {context})")
    if reserve >= gpu_mem:
        raise SSMQError(f"the reserve ({human(reserve)}) leaves nothing of --gpu-mem ({human(gpu_mem)})")
    if weights is None:
        weights = float_weight_bytes(cfg, fmt.act_dtype)
        weights_source = (f"{parameter_count(cfg)['total'] / 1e6:.1f} M parameters × {DTYPE_BYTES[fmt.act_dtype]} B, "
                          f"{fmt.act_dtype}")
    if weights + reserve >= gpu_mem:
        raise SSMQError(f"--gpu-mem {human(gpu_mem)} does not hold the weights ({human(weights)}) and the reserve "
                        f"({human(reserve)}): nothing fits")
    plan = Plan(model, cfg.arch, layers_text(cfg), weights, weights_source, fmt, gpu_mem, reserve, batch, context,
                state_bytes(cfg, fmt), kv_bytes_per_token(cfg, fmt.kv))
    plan.max_context, plan.max_batch = fit(plan.budget, sum(plan.state.values()), plan.kv_per_token, batch, context)
    return plan


def human(n: float) -> str:
    """Bytes in binary units: '512 B', '22.50 KiB', '1.25 GiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_bytes(text: str, what: str = "size") -> int:
    """'80GiB' / '80GB' (10^9) / '81920MiB' / '1e9' -> bytes."""
    import re

    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?(?:e\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if m is None or m[2].lower() not in _UNITS:
        raise SSMQError(f"{what} {text!r} is not a size (e.g. 80GiB, 80GB, 40960MiB)")
    n = int(float(m[1]) * _UNITS[m[2].lower()])
    if n <= 0:
        raise SSMQError(f"{what} must be positive, got {text!r}")
    return n


def parse_reserve(text: str, gpu_mem: int) -> int:
    """'10%' of --gpu-mem, or a size ('4GiB')."""
    t = str(text).strip()
    if t.endswith("%"):
        try:
            pct = float(t[:-1])
        except ValueError:
            pct = -1.0
        if not 0 <= pct < 100:
            raise SSMQError(f"--reserve {text!r}: a percentage must be in [0, 100)")
        return int(gpu_mem * pct / 100)
    return parse_bytes(t, "--reserve")
