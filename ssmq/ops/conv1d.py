"""Depthwise causal conv1d (the short convolution in front of every SSM).

Cache convention: the conv state of a sequence is its last ``w - 1`` inputs,
``conv_state: (s, d, w - 1)``, oldest first. Prefill writes it, decode shifts it.

int8 weights (``ConvInt8``, Quamba's and Quamba2's integer conv): ``weight`` holds int8 codes, the inputs are
quantized to int8 codes by one static per-tensor scale (the conv state keeps the inputs as they came, so their
codes are the same at every step), the products are summed exactly in int32, and the sum is rescaled once in
float32: ``acc * (act_scale * weight_scale) + bias``, then SiLU. The bias is int8 codes with a per-tensor scale
(``bias_scale``) or, with ``bias_scale`` None, float. Against the float conv of the dequantized codes the result
differs only by float32 rounding (the integer sum is exact).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ssmq.errors import SSMQError
from ssmq.ops.quant_linear import quantize_ref


@dataclass(frozen=True)
class ConvInt8:
    """Scales of an int8 conv: weight_scale () per tensor or (d,) per channel (float32), act_scale () (the input's
    static per-tensor scale), bias_scale () for int8 bias codes or None for a float bias."""
    weight_scale: torch.Tensor
    act_scale: torch.Tensor
    bias_scale: torch.Tensor | None = None

    def check(self, weight: torch.Tensor) -> "ConvInt8":
        d = weight.shape[0]
        if weight.dtype != torch.int8:
            raise SSMQError(f"an int8 conv needs int8 weight codes, got {weight.dtype}")
        if tuple(self.weight_scale.shape) not in ((), (d,)):
            raise SSMQError(f"conv weight scale must be () or ({d},), got {tuple(self.weight_scale.shape)}")
        if self.act_scale.dim() != 0 or (self.bias_scale is not None and self.bias_scale.dim() != 0):
            raise SSMQError("conv input and bias scales are per tensor: ()")
        return self


def int8_conv_epilogue(acc: torch.Tensor, q: ConvInt8, bias: torch.Tensor | None, channel_dim: int) -> torch.Tensor:
    """acc: int32 sums with channels at ``channel_dim`` -> float32 ``acc * (act_scale * weight_scale) + bias``."""
    shape = [1] * acc.dim()
    shape[channel_dim] = -1
    scale = (q.act_scale.float() * q.weight_scale.float()).reshape(-1)
    out = acc.float() * scale.reshape(shape if scale.numel() > 1 else [1] * acc.dim())
    if bias is not None:
        b = bias.float() if q.bias_scale is None else bias.float() * q.bias_scale.float()
        out = out + b.reshape(shape)
    return out


def _activate(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return x
    if activation in ("silu", "swish"):
        return F.silu(x)
    raise ValueError(f"unsupported conv1d activation {activation!r} (use 'silu' or None)")


def causal_conv1d_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    return_final_states: bool = False,
    activation: str | None = None,
    int8: ConvInt8 | None = None,
):
    """Causal depthwise conv over the sequence.

    x: (b, d, l); weight: (d, w); bias: (d,); initial_states: (b, d, w-1), the
    inputs before x (zeros when None). Returns out (b, d, l) in x's dtype and,
    if asked, final_states (b, d, w-1): the last w-1 inputs, for decode.
    int8: weight (and bias) are int8 codes with these scales (the module docstring's integer conv).
    """
    dtype_in = x.dtype
    w = weight.shape[1]
    xf = x.float()
    if initial_states is None:
        xp = F.pad(xf, (w - 1, 0))
    else:
        xp = torch.cat([initial_states.float(), xf], dim=-1)
    if int8 is None:
        out = F.conv1d(xp, weight.float().unsqueeze(1), None if bias is None else bias.float(), groups=x.shape[1])
    else:  # integer sums of codes (exact in float64: |sum| < 2^24), then the float32 rescale
        codes = quantize_ref(xp, int8.check(weight).act_scale).double()
        acc = F.conv1d(codes, weight.double().unsqueeze(1), groups=x.shape[1]).to(torch.int32)
        out = int8_conv_epilogue(acc, int8, bias, 1)
    out = _activate(out, activation).to(dtype_in)
    if not return_final_states:
        return out
    return out, xp[..., xp.shape[-1] - (w - 1):].to(dtype_in)


def causal_conv1d_update_ref(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    conv_state_indices: torch.Tensor | None = None,
    int8: ConvInt8 | None = None,
) -> torch.Tensor:
    """One decode step of the causal conv; updates ``conv_state`` in place.

    x: (b, d); conv_state: (s, d, w-1) with s >= b; conv_state_indices: (b,)
    int, the cache slot of each row (rows 0..b-1 when None). Returns (b, d).
    int8: weight (and bias) are int8 codes with these scales; the state keeps the float inputs.
    """
    idx = torch.arange(x.shape[0], device=x.device) if conv_state_indices is None else conv_state_indices.long()
    window = torch.cat([conv_state[idx].float(), x.float().unsqueeze(-1)], dim=-1)  # (b, d, w)
    if int8 is None:
        out = (window * weight.float()).sum(-1)
        if bias is not None:
            out = out + bias.float()
    else:
        codes = quantize_ref(window, int8.check(weight).act_scale)
        acc = (codes.to(torch.int32) * weight.to(torch.int32)).sum(-1, dtype=torch.int32)  # (b, d)
        out = int8_conv_epilogue(acc, int8, bias, 1)
    conv_state[idx] = window[..., 1:].to(conv_state.dtype)
    return _activate(out, activation).to(x.dtype)
