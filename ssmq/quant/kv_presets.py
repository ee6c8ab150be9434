"""Named KV formats (data): KVQuant's and the engines' baselines. ``ssmq.quant.recipe`` registers each as a
KV-only recipe of the one registry, so ``--recipe kvquant-nuq3-1%`` quantizes only the KV cache and
``ssdi8-w8a8+kvquant-nuq3-1%`` adds it to an SSM recipe (``Recipe.cache.kv`` may also name one).

    kvquant-{int,nuq}{4,3,2}[-1%]  KVQuant: per-channel keys before RoPE (offline scales), per-token values
                                   (online), attention sink 1, Q-Norm at 2 bits; -1%: 1% dense-and-sparse outliers
    kv-fp8-e4m3                    fp8 e4m3 keys and values, one calibrated scale per tensor (vLLM's fp8 KV)
    kv-int8-pth, kv-int4-pth       symmetric int per token and head, post-RoPE keys (engines' int KV)
    kv-turbo4, kv-turbo3           TurboQuant-style: random-sign Hadamard rotation per head, then uniform
                                   per-token-head scalar quantization, post-RoPE keys
"""

from __future__ import annotations

from ssmq.models.kv_format import KVSideSpec, KVSpec


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
