"""The quantized activation taps of a mixer at decode: which taps quantize, and their scales in the shapes the
int8 decode kernels take, computed once (not per step) and refreshed when a quantizer's scales change.

Glossary: d channels of a tap, G its scale groups, c conv channels, h heads, p headdim, g ngroups, n d_state.

A quantizing tap is ``ssmq.quant.ssm.ActQuantizer`` (models sit below quant, so it is recognised by its interface:
``codes(x)`` and ``channel_scale()``, () or (d,)). Its output is dequantize(codes): a kernel fed its codes and
``channel_scale()`` computes on the same values.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn


def is_quantizer(tap: nn.Module) -> bool:
    return callable(getattr(tap, "codes", None)) and callable(getattr(tap, "channel_scale", None))


def unobserved_quantizers(taps) -> bool:
    """Whether every tap is a quantizer that no forward hook observes, so that a kernel may apply it in place of its
    call (calibration observes taps through forward hooks, which a call skipped would not run)."""
    from torch.nn.modules import module as torch_module

    if getattr(torch_module, "_global_forward_hooks", None) or getattr(torch_module, "_global_forward_pre_hooks", None):
        return False
    return all(is_quantizer(t) and not t._forward_hooks and not t._forward_pre_hooks for t in taps)


def shaped(scale: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A tap's channel scale () or (d,) as () or ``shape`` (d = prod(shape)): broadcastable against the codes."""
    return scale if scale.dim() == 0 else scale.reshape(shape)


def _key(t: torch.Tensor | None):
    if t is None:
        return None
    return id(t), t.data_ptr(), None if t.is_inference() else t._version, t.device


class TapScaleCache:
    """name -> a value built from some taps' scales, rebuilt when one of their ``scale`` / ``index`` buffers is
    replaced or edited in place (calibration, loading, ``.to()``): keyed on storage and version, as
    ``FloatParamCache``. A decode step (and a captured CUDA graph) then reads fixed tensors instead of launching
    gathers and concatenations for every layer."""

    def __init__(self):
        self._cache: dict[str, tuple[tuple, object]] = {}

    def get(self, name: str, taps: tuple[nn.Module, ...], build: Callable[..., object]):
        key = tuple((_key(t.scale), _key(getattr(t, "index", None))) for t in taps)
        hit = self._cache.get(name)
        if hit is not None and hit[0] == key:
            return hit[1]
        with torch.no_grad():
            value = build(*(t.channel_scale().float() for t in taps))
        self._cache[name] = (key, value)
        return value
