"""The causal conv in front of every SSM, in prefill, continuing from and writing the cache's conv state.

A mixer's ``conv1d`` is a ``CausalConv1d`` (float weights) or a module with the same interface (``ssmq.quant.conv``'s
``QuantConv1d``: int8 weight codes): ``kernel_weights()`` gives what the conv kernels take, so the mixer's prefill
and decode paths are one each, whatever the weights' format, and ``conv_format`` names it for the layer's plan.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ssmq import kernels


class CausalConv1d(nn.Conv1d):
    """Depthwise conv1d (``nn.Conv1d``: same parameters and state-dict names) with float weights."""

    conv_format = ""  # float: nothing to name in the plan

    def kernel_weights(self):
        """(weight (c, w), bias (c,) | None, int8 scales: None) for the conv kernels."""
        return self.weight.squeeze(1), self.bias, None


def conv_prefill(conv1d: nn.Module, x: torch.Tensor, state=None, slots=None, fake_quant=None) -> torch.Tensor:
    """x: (b, l, c) → silu(causal_conv(x)): (b, l, c). With a ``MambaState``, rows ``slots`` start from their conv
    state (the last w - 1 inputs seen) and leave the new one there. ``fake_quant``: a float32 scale per channel (c,)
    or one (): the output as fake-quant taps with these scales would make it (``ActQuantizer``), in the conv's own
    kernel (a tap's pass reads and writes the output again, and copies a strided one first)."""
    weight, bias, int8 = conv1d.kernel_weights()
    xt, init = x.transpose(1, 2), None if state is None else state.read_conv(slots)
    if fake_quant is None:
        out = kernels.causal_conv1d(xt, weight, bias, init, state is not None, activation="silu", int8=int8)
    else:
        scale = fake_quant.reshape(-1, 1) if fake_quant.dim() else fake_quant
        out = kernels.conv1d_silu_quant(xt, weight, bias, scale, init, state is not None, int8=int8, fake_quant=True)
    if state is not None:
        out, final = out
        state.write_conv(slots, final)
    return out.transpose(1, 2)
