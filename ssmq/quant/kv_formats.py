"""KV-cache storage formats as data: what one cached token costs, per KV head, for memory plans (``ssmq plan``).

One row per format: bits per element of the codes, the per-token overhead of each key and each value vector
(its scales / zero points, in bits), and whether the format keeps sparse FP16 outliers. A name with a suffix
``-X%`` (``nuq3-1%``) is that format with X% of the elements kept as outliers. Costs that do not grow with
the context (per-channel key scales calibrated offline, per-layer nuq codebooks, a per-tensor fp8 scale, the
FP16 attention-sink token) are left out: they are bytes per layer, not per token.

Glossary: e head dim; a "vector" is the e channels of one KV head of one token (one key or one value).

The quantized-KV implementation (KVQuant, issue #17) plugs its exact formats in here; until then the rows
are the storage the papers and serving engines describe:
    fp16 / bf16, fp32   the float cache (KVState)
    fp8                 e4m3 codes, one static per-tensor scale (vLLM kv_cache_dtype=fp8)
    int8                per-token-head: one fp16 scale per vector
    int4 / int3 / int2  per-token-head asymmetric: fp16 scale + fp16 zero point per vector
    nuq4 / nuq3 / nuq2  KVQuant: keys per-channel (scales offline: nothing per token), values per-token
                        (fp16 scale + fp16 offset per value vector), non-uniform codebook per layer
Outliers (KVQuant's dense-and-sparse): each outlier an fp16 value + an int16 index within its vector
(OUTLIER_BITS), plus one int32 row pointer per vector (ROW_POINTER_BITS), CSR-style.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from ssmq.errors import SSMQError

OUTLIER_BITS = 16 + 16  # fp16 value + int16 position within the vector
ROW_POINTER_BITS = 32  # where each vector's outliers start (int32)


@dataclass(frozen=True)
class KVFormat:
    name: str
    bits: float  # per element of the dense codes
    key_vector_bits: int = 0  # per-token overhead of each key vector (scales, zero points)
    value_vector_bits: int = 0  # per-token overhead of each value vector
    outliers: float = 0.0  # fraction of the elements kept in fp16 as sparse outliers
    description: str = ""

    def bytes_per_vector_pair(self, head_dim: int) -> float:
        """Bytes of one key vector + one value vector (e elements each) of one token and KV head."""
        bits = 2 * head_dim * self.bits + self.key_vector_bits + self.value_vector_bits
        if self.outliers:
            bits += 2 * (head_dim * self.outliers * OUTLIER_BITS + ROW_POINTER_BITS)
        return bits / 8

    @property
    def is_float(self) -> bool:
        return self.bits >= 16


def _row(name, bits, k=0, v=0, description=""):
    return name, KVFormat(name, bits, k, v, 0.0, description)


KV_FORMATS: dict[str, KVFormat] = dict([
    _row("fp32", 32, description="float32 cache"),
    _row("fp16", 16, description="16-bit float cache (fp16 or bf16): the KVState of a 16-bit model"),
    _row("bf16", 16, description="same bytes as fp16"),
    _row("fp8", 8, description="fp8 e4m3, one per-tensor scale (vLLM kv_cache_dtype=fp8)"),
    _row("int8", 8, 16, 16, "int8 per token-head, fp16 scale per vector"),
    _row("int4", 4, 32, 32, "int4 per token-head, fp16 scale + zero per vector"),
    _row("int3", 3, 32, 32, "int3 per token-head, fp16 scale + zero per vector"),
    _row("int2", 2, 32, 32, "int2 per token-head, fp16 scale + zero per vector"),
    _row("nuq4", 4, 0, 32, "KVQuant nuq4: per-channel keys (offline scales), per-token values (fp16 scale + offset)"),
    _row("nuq3", 3, 0, 32, "KVQuant nuq3: as nuq4 with 3-bit codes"),
    _row("nuq2", 2, 0, 32, "KVQuant nuq2: as nuq4 with 2-bit codes"),
])


def kv_format(name: str) -> KVFormat:
    """The format named ``name``: a row of KV_FORMATS, optionally with an outlier suffix (``nuq3-1%``)."""
    m = re.fullmatch(r"(?P<base>[a-z0-9]+)(?:-(?P<pct>\d+(?:\.\d+)?)%)?", name.strip().lower())
    if m is None or m["base"] not in KV_FORMATS:
        raise SSMQError(f"unknown KV format {name!r}; known: {', '.join(KV_FORMATS)} "
                        "(a quantized one may take an outlier suffix, e.g. nuq3-1%)")
    fmt = KV_FORMATS[m["base"]]
    if m["pct"] is None:
        return fmt
    pct = float(m["pct"])
    if fmt.is_float or not 0 < pct < 100:
        raise SSMQError(f"KV format {name!r}: outliers are for quantized formats, as a percentage in (0, 100)")
    return replace(fmt, name=f"{fmt.name}-{m['pct']}%", outliers=pct / 100,
                   description=f"{fmt.description}; {m['pct']}% of elements as fp16 sparse outliers")
