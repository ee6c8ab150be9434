"""The causal conv in front of every SSM, in prefill, continuing from and writing the cache's conv state."""

from __future__ import annotations

import torch
import torch.nn as nn

from ssmq import kernels


def conv_prefill(conv1d: nn.Conv1d, x: torch.Tensor, state=None, slots=None) -> torch.Tensor:
    """x: (b, l, c) → silu(causal_conv(x)): (b, l, c). With a ``MambaState``, rows ``slots`` start from their conv
    state (the last w - 1 inputs seen) and leave the new one there."""
    weight = conv1d.weight.squeeze(1)
    if state is None:
        out = kernels.causal_conv1d(x.transpose(1, 2), weight, conv1d.bias, activation="silu")
    else:
        out, final = kernels.causal_conv1d(x.transpose(1, 2), weight, conv1d.bias, state.read_conv(slots), True,
                                           activation="silu")
        state.write_conv(slots, final)
    return out.transpose(1, 2)
