"""Activations handed to an A8 linear as int8 codes: the op that produces the activation (block norm, Mamba-2's
gated norm) quantizes in its epilogue and the linear multiplies the codes, so no quantize kernel runs on its own.

Models sit below ``ssmq.quant``: a linear that takes codes says so through a ``code_input()`` method (``QuantLinear``
has one) returning a ``CodeInput``; its forward accepts an ``ActCodes`` in place of the float tensor. The decision
is read off the modules (no registry): a producer quantizes when its one consumer asks for unrotated codes and the
active ``KernelPolicy`` has ``act_quant_fusion`` (the default). A rotated linear (online Hadamard) with a static scale
takes the codes of its rotated input from Mamba-2's gated norm (``kernels.hadamard``: norm, Hadamard and quantize in
one kernel at decode rows); with a dynamic scale it rotates and quantizes its own input.
On CPU the result is bit for bit the unfused one (the same references, in the same order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from ssmq import kernels


@dataclass(frozen=True)
class CodeInput:
    """How a linear takes its input as codes: a static per-tensor scale (), or None for dynamic per-token scales
    (absmax / qmax of each row), both as ``ssmq.ops.quant_linear.quantize_act_ref`` makes them; ``rotate``: the codes
    of the input's online Hadamard (``hadamard_transform``), which the linear's weight was rotated for; ``dtype``:
    int8 or float8_e4m3fn codes (rotated: int8 only)."""

    scale: torch.Tensor | None
    rotate: bool = False
    dtype: torch.dtype = torch.int8


@dataclass(frozen=True)
class ActCodes:
    """An activation as int8 / e4m3 codes q (..., k), its scale (() static or (...) per token, float32) and the float dtype
    it stands for (the linear's output dtype)."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


def code_input(linear: nn.Module | None, rotated: bool = False) -> CodeInput | None:
    """What ``linear`` wants from its producer: a ``CodeInput`` when it takes unrotated codes (and the fusion is
    on), else None; ``rotated``: the producer can also rotate (Mamba-2's gated norm), so codes of a rotated input
    with a static scale too."""
    ask = getattr(linear, "code_input", None)
    codes = ask() if callable(ask) and kernels.act_quant_fusion_enabled() else None
    if codes is not None and codes.rotate and not (rotated and codes.scale is not None):
        return None
    return codes
