"""Depthwise causal conv1d (the short convolution in front of every SSM).

Cache convention: the conv state of a sequence is its last ``w - 1`` inputs,
``conv_state: (s, d, w - 1)``, oldest first. Prefill writes it, decode shifts it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
):
    """Causal depthwise conv over the sequence.

    x: (b, d, l); weight: (d, w); bias: (d,); initial_states: (b, d, w-1), the
    inputs before x (zeros when None). Returns out (b, d, l) in x's dtype and,
    if asked, final_states (b, d, w-1): the last w-1 inputs, for decode.
    """
    dtype_in = x.dtype
    w = weight.shape[1]
    xf = x.float()
    if initial_states is None:
        xp = F.pad(xf, (w - 1, 0))
    else:
        xp = torch.cat([initial_states.float(), xf], dim=-1)
    out = F.conv1d(xp, weight.float().unsqueeze(1), None if bias is None else bias.float(), groups=x.shape[1])
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
) -> torch.Tensor:
    """One decode step of the causal conv; updates ``conv_state`` in place.

    x: (b, d); conv_state: (s, d, w-1) with s >= b; conv_state_indices: (b,)
    int, the cache slot of each row (rows 0..b-1 when None). Returns (b, d).
    """
    idx = torch.arange(x.shape[0], device=x.device) if conv_state_indices is None else conv_state_indices.long()
    window = torch.cat([conv_state[idx].float(), x.float().unsqueeze(-1)], dim=-1)  # (b, d, w)
    out = (window * weight.float()).sum(-1)
    if bias is not None:
        out = out + bias.float()
    conv_state[idx] = window[..., 1:].to(conv_state.dtype)
    return _activate(out, activation).to(x.dtype)
