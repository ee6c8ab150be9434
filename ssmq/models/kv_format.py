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
