"""The causal conv in front of every SSM, in prefill, continuing from and writing the cache's conv state."""

from __future__ import annotations

import torch
import torch.nn as nn

from ssmq import kernels


def conv_prefill(conv1d: nn.Conv1d, x: torch.Tensor, cache=None, layer_idx: int = 0, slots=None) -> torch.Tensor:
    """x: (b, l, c) → silu(causal_conv(x)): (b, l, c). With a cache, rows ``slots`` start from their conv state
    (the last w - 1 inputs seen) and leave the new one there."""
    weight = conv1d.weight.squeeze(1)
    if cache is None:
        out = kernels.causal_conv1d(x.transpose(1, 2), weight, conv1d.bias, activation="silu")
    else:
        states = cache.conv_states[layer_idx]
        out, final = kernels.causal_conv1d(x.transpose(1, 2), weight, conv1d.bias, initial_states=states[slots],
                                           return_final_states=True, activation="silu")
        states[slots] = final.to(states.dtype)
    return out.transpose(1, 2)
