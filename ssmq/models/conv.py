"""The causal conv in front of every SSM, in prefill, continuing from and writing the cache's conv state."""

from __future__ import annotations

import torch
import torch.nn as nn

from ssmq import kernels


def conv_prefill(conv1d: nn.Conv1d, x: torch.Tensor, state=None, slots=None,
                 out_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x: (b, l, c) → silu(causal_conv(x)): (b, l, c). With a ``MambaState``, rows ``slots`` start from their conv
    state (the last w - 1 inputs seen) and leave the new one there. With ``out_scale`` (c,) or (), the output's int8
    codes (b, l, c) instead, from one fused conv + SiLU + quantize op (``kernels.conv1d_silu_quant``)."""
    weight = conv1d.weight.squeeze(1)
    if out_scale is None:
        conv = lambda *a: kernels.causal_conv1d(*a, activation="silu")  # noqa: E731
    else:
        scale = out_scale if out_scale.dim() == 0 else out_scale[:, None]  # the op's (c, 1) per channel
        conv = lambda *a: kernels.conv1d_silu_quant(a[0], a[1], a[2], scale, *a[3:])  # noqa: E731
    if state is None:
        out = conv(x.transpose(1, 2), weight, conv1d.bias)
    else:
        out, final = conv(x.transpose(1, 2), weight, conv1d.bias, state.read_conv(slots), True)
        state.write_conv(slots, final)
    return out.transpose(1, 2)
