"""What a quantized KV cache looks like: ``KVSideSpec`` (keys or values) and ``KVSpec``, dataclasses <-> JSON.

    {"keys":   {"bits": 3, "dtype": "nuq", "granularity": "per_channel", "pre_rope": true, "outliers": 0.01},
     "values": {"bits": 3, "dtype": "nuq", "granularity": "per_token", "outliers": 0.01},
     "sink": 1}

One parametrized format covers KVQuant and the engines' KV formats: every entry x is normalized to
u = (x - mid) / half in [-1, 1] and stored as the index of its nearest entry of a sorted codebook
(``ssmq.ops.kv_quant``):
    dtype       int: a uniform grid (2^bits levels; symmetric: 2^bits - 1 levels around 0)
                nuq: a per-layer codebook of 2^bits levels (Fisher-weighted k-means, ``ssmq.quant.kvquant``)
                fp8: the e4m3 values / 448 (bits 8, symmetric)
    granularity per_channel: mid / half per (kv head, channel), calibrated offline (KVQuant's keys)
                per_token:   mid / half per (token, kv head), computed when the token is written (values)
                per_tensor:  one offline mid / half (engines' fp8 KV scales)
    outliers    fraction of entries kept exactly (float16) in a sparse (index, value) list per token: offline
                per-channel thresholds for per_channel (values beyond them), the largest |x| of each token
                for per_token
    qnorm       the codebook's mean / std matched to the calibration data's (KVQuant's Q-Norm, for 2-bit)
    rotate      TurboQuant-style: a random-sign Hadamard rotation of each head before a scalar quantizer
    pre_rope    (keys) quantize keys before RoPE; RoPE is applied after dequantization
    sink        the first ``sink`` tokens of each sequence are kept in float (attention sink)
Stored in ``Recipe.cache.kv`` (or named there by a KV preset, ``ssmq.quant.recipe``).

Named formats (``KV_PRESETS``, data; ``ssmq.quant.recipe`` registers each as a KV-only recipe, so
``--recipe kvquant-nuq3-1%`` quantizes only the KV cache and ``ssdi8-w8a8+kvquant-nuq3-1%`` adds it to an SSM recipe):
    kvquant-{int,nuq}{4,3,2}[-1%]  KVQuant: per-channel keys before RoPE (offline scales), per-token values
                                   (online), attention sink 1, Q-Norm at 2 bits; -1%: 1% dense-and-sparse outliers
    kv-fp8-e4m3                    fp8 e4m3 keys and values, one calibrated scale per tensor (vLLM's fp8 KV)
    kv-int8-pth, kv-int4-pth       symmetric int per token and head, post-RoPE keys (engines' int KV)
    kv-turbo4, kv-turbo3           TurboQuant-style: random-sign Hadamard rotation per head, then uniform
                                   per-token-head scalar quantization, post-RoPE keys

What one cached token costs (``KVFormat``, for ``ssmq plan``): the float cache (2 · hkv · e elements of its dtype per
layer and token) or a ``KVSpec`` costed as ``QuantKVState`` stores it (``bits_per_token(..., as_stored=True)``);
costs that do not grow with the context (offline key scales, codebooks, the sink tokens) are per layer and left
out. ``kv_format`` names: fp32 / fp16 / bf16, any preset, and the short names ``nuq3-1%`` / ``int3``
(= ``kvquant-…``), ``fp8`` (= ``kv-fp8-e4m3``), ``int8`` / ``int4`` (= ``kv-int8-pth`` / ``kv-int4-pth``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ssmq.errors import SSMQError
from ssmq.errors import from_json_object as _from

DTYPES = ("int", "nuq", "fp8")
GRANULARITIES = ("per_channel", "per_token", "per_tensor")


@dataclass(frozen=True)
class KVSideSpec:
    """How one side (keys or values) of an attention layer's cache is quantized (see the module docstring)."""

    bits: int = 4
    dtype: str = "int"
    granularity: str = "per_token"
    symmetric: bool = False
    outliers: float = 0.0
    qnorm: bool = False
    rotate: bool = False
    pre_rope: bool = False  # keys only

    def validate(self, side: str) -> "KVSideSpec":
        what = f"KV spec {side}"
        if self.dtype not in DTYPES:
            raise SSMQError(f"{what}: unknown dtype {self.dtype!r}; known: {', '.join(DTYPES)}")
        if self.granularity not in GRANULARITIES:
            raise SSMQError(f"{what}: unknown granularity {self.granularity!r}; known: {', '.join(GRANULARITIES)}")
        if self.dtype == "fp8" and (self.bits != 8 or not self.symmetric):
            raise SSMQError(f"{what}: fp8 (e4m3) is 8 bits and symmetric")
        if self.dtype != "fp8" and not (isinstance(self.bits, int) and 2 <= self.bits <= 8):
            raise SSMQError(f"{what}: bits must be an integer in 2..8, got {self.bits!r}")
        if self.dtype == "nuq" and self.bits > 4:
            raise SSMQError(f"{what}: nuq codebooks have at most 4 bits (16 levels), got {self.bits}")
        if not (isinstance(self.outliers, (int, float)) and 0.0 <= self.outliers < 0.5):
            raise SSMQError(f"{what}: outliers is a fraction in [0, 0.5), got {self.outliers!r}")
        if self.outliers and (self.rotate or self.granularity == "per_tensor"):
            raise SSMQError(f"{what}: sparse outliers go with per_channel or per_token scales, without rotation")
        if self.pre_rope and side != "keys":
            raise SSMQError(f"{what}: pre_rope is a property of keys")
        return self

    @property
    def levels(self) -> int:
        """Codebook entries (the fp8 codebook has 253 distinct finite values: ``ssmq.ops.kv_quant``)."""
        return 2 ** self.bits - (1 if self.symmetric and self.dtype == "int" else 0)

    def outlier_slots(self, n: int) -> int:
        """k: sparse outlier slots per token of a layer's n = hkv · e entries. Per-token outliers take exactly
        round(f·n) (at least 1); offline per-channel thresholds leave a variable count, so they get twice that
        many slots (the excess beyond is clipped)."""
        if not self.outliers:
            return 0
        k = max(1, round(self.outliers * n))
        return min(n, 2 * k) if self.granularity == "per_channel" else k

    def bits_per_token(self, hkv: int, e: int, as_stored: bool = False) -> int:
        """Bits of one token of this side in a layer: codes (``bits`` each, or as ``QuantKVState`` stores them:
        2 / 3 / 4 bits for codebooks of <= 4 / 8 / 16 entries, else 8, each head's row padded to whole bytes:
        ``ssmq.ops.kv_quant.pack_codes``), float16 per-token mid and half, (int16, float16) outliers."""
        n = hkv * e
        if as_stored:
            from ssmq.ops.kv_quant import code_bits, packed_bytes

            codes = hkv * 8 * packed_bytes(e, code_bits(self.levels))
        else:
            codes = n * self.bits
        return codes + (32 * hkv if self.granularity == "per_token" else 0) + 32 * self.outlier_slots(n)


@dataclass(frozen=True)
class KVSpec:
    keys: KVSideSpec = field(default_factory=KVSideSpec)
    values: KVSideSpec = field(default_factory=KVSideSpec)
    sink: int = 0

    def bits_per_token(self, hkv: int, e: int, as_stored: bool = False) -> int:
        """Bits of one token's keys and values in a layer of hkv heads × e (sink tokens, per-layer codebooks and
        offline scales are per layer, not per token)."""
        return self.keys.bits_per_token(hkv, e, as_stored) + self.values.bits_per_token(hkv, e, as_stored)

    def validate(self) -> "KVSpec":
        self.keys.validate("keys")
        self.values.validate("values")
        if not (isinstance(self.sink, int) and 0 <= self.sink <= 64):
            raise SSMQError(f"KV spec: sink is a number of tokens in 0..64, got {self.sink!r}")
        return self

    def to_dict(self) -> dict:
        return {"keys": asdict(self.keys), "values": asdict(self.values), "sink": self.sink}

    @classmethod
    def from_dict(cls, d) -> "KVSpec":
        spec = _from(cls, d, "KV spec")
        return cls(_from(KVSideSpec, spec.keys, "KV spec keys") if isinstance(spec.keys, dict) else spec.keys,
                   _from(KVSideSpec, spec.values, "KV spec values") if isinstance(spec.values, dict) else spec.values,
                   spec.sink).validate()

    def with_changes(self, keys: dict | None = None, values: dict | None = None, **kw) -> "KVSpec":
        """A copy with some fields of keys / values / sink changed (the ablations are written this way)."""
        d = self.to_dict()
        d["keys"].update(keys or {})
        d["values"].update(values or {})
        return KVSpec.from_dict(d | kw)


def kvquant(dtype: str, bits: int, outliers: float = 0.0) -> KVSpec:
    qn = bits == 2
    return KVSpec(KVSideSpec(bits, dtype, "per_channel", outliers=outliers, qnorm=qn, pre_rope=True),
                  KVSideSpec(bits, dtype, "per_token", outliers=outliers, qnorm=qn), sink=1)


def engine(side: KVSideSpec) -> KVSpec:
    return KVSpec(side, side)


KV_PRESETS: dict[str, tuple[KVSpec, str]] = {
    **{f"kvquant-{d}{b}{'-1%' if o else ''}": (kvquant(d, b, o),
                                                f"KVQuant {d}{b}{' with 1% sparse outliers' if o else ''}")
       for d in ("nuq", "int") for b in (4, 3, 2) for o in (0.0, 0.01)},
    "kv-fp8-e4m3": (engine(KVSideSpec(8, "fp8", "per_tensor", symmetric=True)), "fp8 e4m3 KV, per-tensor scales"),
    "kv-int8-pth": (engine(KVSideSpec(8, "int", "per_token", symmetric=True)), "int8 KV per token and head"),
    "kv-int4-pth": (engine(KVSideSpec(4, "int", "per_token", symmetric=True)), "int4 KV per token and head"),
    "kv-turbo4": (engine(KVSideSpec(4, "int", "per_token", rotate=True)), "TurboQuant-style rotated 4-bit KV"),
    "kv-turbo3": (engine(KVSideSpec(3, "int", "per_token", rotate=True)), "TurboQuant-style rotated 3-bit KV"),
}
FLOAT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
ALIASES = {"fp8": "kv-fp8-e4m3", "int8": "kv-int8-pth", "int4": "kv-int4-pth"}


@dataclass(frozen=True)
class KVFormat:
    name: str
    float_bytes: int = 0  # the float cache: bytes per element
    spec: KVSpec | None = None  # a quantized cache
    description: str = ""

    def bytes_per_token(self, hkv: int, e: int) -> float:
        """Bytes of one token's keys and values in one attention layer of hkv heads × e."""
        if self.spec is None:
            return 2 * hkv * e * self.float_bytes
        return self.spec.bits_per_token(hkv, e, as_stored=True) / 8

    @property
    def is_float(self) -> bool:
        return self.spec is None


def kv_format(name) -> KVFormat:
    """The format named ``name`` (module docstring), or a ``KVSpec`` as it stands in a recipe."""
    if isinstance(name, KVSpec):
        return KVFormat("custom", spec=name, description="the recipe's KV spec")
    key = name.strip().lower()
    if key in FLOAT_BYTES:
        return KVFormat(key, FLOAT_BYTES[key], description=f"{key} cache")
    for preset in (key, ALIASES.get(key), f"kvquant-{key}"):
        if preset in KV_PRESETS:
            spec, description = KV_PRESETS[preset]
            return KVFormat(key, spec=spec, description=description)
    raise SSMQError(f"unknown KV format {name!r}; known: {', '.join(FLOAT_BYTES)}, {', '.join(ALIASES)}, "
                    f"the KV presets ({', '.join(KV_PRESETS)}) and their short names (nuq3-1%, int2 …)")
