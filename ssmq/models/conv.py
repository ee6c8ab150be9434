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


def conv_prefill(conv1d: nn.Module, x: torch.Tensor, state=None, slots=None) -> torch.Tensor:
    """x: (b, l, c) → silu(causal_conv(x)): (b, l, c). With a ``MambaState``, rows ``slots`` start from their conv
    state (the last w - 1 inputs seen) and leave the new one there."""
    weight, bias, int8 = conv1d.kernel_weights()
    if state is None:
        out = kernels.causal_conv1d(x.transpose(1, 2), weight, bias, activation="silu", int8=int8)
    else:
        out, final = kernels.causal_conv1d(x.transpose(1, 2), weight, bias, state.read_conv(slots), True,
                                           activation="silu", int8=int8)
        state.write_conv(slots, final)
    return out.transpose(1, 2)
