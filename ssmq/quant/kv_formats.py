"""What one cached token costs in a KV format, for memory plans (``ssmq plan``).

A format is either the float cache (``KVState``: 2 · hkv · e elements of its dtype per layer and token) or a
``KVSpec`` — the KV presets of ``ssmq.quant.kv_presets``, the same data the quantizer runs — costed as
``QuantKVState`` stores it (``KVSpec.bits_per_token(..., as_stored=True)``: codes of up to 4 / 8 / 16 levels
at 2 / 3 / 4 bits, each head's row of e codes padded to whole bytes (ceil(e·bits/8)), else one byte a code; fp16
per-token scale and offset on per_token sides; an (int16, fp16) pair per outlier slot). Costs that do not grow with the context (per-channel key scales calibrated offline, per-layer codebooks,
the FP16 attention-sink tokens) are left out: they are bytes per layer, not per token.

Names: fp32 / fp16 / bf16, any KV preset (``kvquant-nuq3-1%``, ``kv-fp8-e4m3``, ``kv-int8-pth`` …), and the
short names ``nuq3-1%`` / ``int3`` (= ``kvquant-…``), ``fp8`` (= ``kv-fp8-e4m3``), ``int8`` / ``int4``
(= ``kv-int8-pth`` / ``kv-int4-pth``: the engines' per-token-head formats).

Glossary: hkv KV heads of a layer, e head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

from ssmq.errors import SSMQError
from ssmq.models.kv_format import KVSpec
from ssmq.quant.kv_presets import KV_PRESETS

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
