"""The calibrated KV quantizer of one attention layer: its ``KVSpec`` (``.kv``) and the tensors calibration gave it.

Glossary: hkv kv heads, e head dim, C codebook entries, b batch, l length.

Buffers, for each side X in (k, v):
    X_codebook (C,)                sorted levels in [-1, 1] (uniform grid, fp8 values, or nuq k-means levels)
    X_lo, X_hi (hkv, e) | ()       offline range of per_channel / per_tensor scales (outlier thresholds when
                                   the side has outliers); absent for per_token scales
    X_signs    (e,)                ±1 of the random rotation (rotate only)
The attention layer calls ``fake_quant`` when it runs without a cache (perplexity: the keys and values a
quantized cache would hand back) and allocates a ``QuantKVState`` with it; both run ``ssmq.ops.kv_quant``.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from ssmq.models.kv_format import KVSpec
from ssmq.ops.kv_quant import KVParams, fake_quant_kv_ref, fp8_codebook, uniform_codebook

SPEC_KIND = "KVQuantizer"
SIDES = ("keys", "values")


def initial_codebook(side) -> torch.Tensor:
    """The codebook before calibration: fp8 values, or a uniform grid (nuq starts from it)."""
    return fp8_codebook() if side.dtype == "fp8" else uniform_codebook(side.bits, side.symmetric)


class KVQuantizer(nn.Module):
    def __init__(self, spec: KVSpec, kv_heads: int, head_dim: int, layer_idx: int = 0):
        super().__init__()
        self.kv, self.hkv, self.e, self.layer_idx = spec.validate(), kv_heads, head_dim, layer_idx
        for x, side in zip("kv", (spec.keys, spec.values)):
            self.register_buffer(f"{x}_codebook", initial_codebook(side))
            shape = {"per_channel": (kv_heads, head_dim), "per_tensor": ()}.get(side.granularity)
            if shape is not None:
                self.register_buffer(f"{x}_lo", -torch.ones(shape))
                self.register_buffer(f"{x}_hi", torch.ones(shape))
            if side.rotate:
                g = torch.Generator().manual_seed(1000 * layer_idx + (x == "v"))  # fixed per layer and side
                self.register_buffer(f"{x}_signs", torch.randint(0, 2, (head_dim,), generator=g).float() * 2 - 1)

    def side(self, which: str):
        return self.kv.keys if which == "keys" else self.kv.values

    @torch.no_grad()
    def keep_heads_(self, heads: torch.Tensor) -> None:
        """Keep the kv heads ``heads`` (a tensor-parallel rank's, ``ssmq.runtime.tp``): the per-channel ranges'
        rows; codebooks, per-tensor ranges and rotation signs are shared by the heads. The outlier slots follow
        (a fraction of the heads kept), so a rank picks a token's outliers among its own heads: a sharded model
        quantizes its KV per rank, exactly as one GPU does for formats without outliers, not for those with them."""
        for x, side in zip("kv", (self.kv.keys, self.kv.values)):
            if side.granularity == "per_channel":
                for name in (f"{x}_lo", f"{x}_hi"):
                    setattr(self, name, getattr(self, name)[heads.to(getattr(self, name).device)].contiguous())
        self.hkv = len(heads)

    def outlier_slots(self, which: str) -> int:
        """k: sparse outlier slots per token of one side (``KVSideSpec.outlier_slots``)."""
        return self.side(which).outlier_slots(self.hkv * self.e)

    def params(self, which: str) -> KVParams:
        side, x = self.side(which), which[0]
        return KVParams(getattr(self, f"{x}_codebook").float(), side.granularity, side.symmetric,
                        getattr(self, f"{x}_lo", None), getattr(self, f"{x}_hi", None), self.outlier_slots(which),
                        getattr(self, f"{x}_signs", None))

    def fake_quant(self, x: torch.Tensor, positions: torch.Tensor, which: str) -> torch.Tensor:
        """x (b, l, hkv, e) at ``positions`` (b, l) → quantize-dequantize, the first ``sink`` positions kept."""
        out = fake_quant_kv_ref(x, self.params(which))
        if self.kv.sink:
            out = torch.where((positions < self.kv.sink)[..., None, None], x, out)
        return out

    def bits_per_token(self, as_stored: bool = False) -> float:
        """Bits per token of this layer's K and V (``KVSpec.bits_per_token``)."""
        return self.kv.bits_per_token(self.hkv, self.e, as_stored)

    def spec(self) -> dict:
        """The checkpoint's record (``ssmq.quant.checkpoint`` collects every module's ``spec()``)."""
        return {"kind": SPEC_KIND, "kv": self.kv.to_dict(), "kv_heads": self.hkv, "head_dim": self.e,
                "layer_idx": self.layer_idx}

    @classmethod
    def from_spec(cls, spec: dict, dtype=None, device=None) -> "KVQuantizer":
        return cls(KVSpec.from_dict(spec["kv"]), spec["kv_heads"], spec["head_dim"], spec.get("layer_idx", 0))

    def extra_repr(self) -> str:
        k, v = self.kv.keys, self.kv.values
        return (f"keys={k.dtype}{k.bits}/{k.granularity}{'/pre-rope' if k.pre_rope else ''}/{k.outliers:g}, "
                f"values={v.dtype}{v.bits}/{v.granularity}/{v.outliers:g}, sink={self.kv.sink}, "
                f"bits/token={math.ceil(self.bits_per_token())}")
