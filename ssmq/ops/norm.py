"""RMSNorm references: the block norm with fused residual add, and Mamba-2's gated norm."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-5,
    residual: torch.Tensor | None = None,
    residual_in_fp32: bool = True,
):
    """Residual add then RMSNorm, as mamba_ssm's fused ``RMSNorm(prenorm=True)``.

    x: (..., d); residual: (..., d) or None (first block). The sum is the new
    residual stream (float32 when ``residual_in_fp32``) and is normalised in
    float32. Returns (out in weight's dtype, new_residual).
    """
    r = x.float() if residual is None else x.float() + residual.float()
    out = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    new_residual = r if residual_in_fp32 else r.to(x.dtype)
    return out.to(weight.dtype), new_residual


def rmsnorm_gated_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    z: torch.Tensor | None = None,
    eps: float = 1e-6,
    group_size: int | None = None,
    norm_before_gate: bool = False,
) -> torch.Tensor:
    """Mamba-2's gated RMSNorm: ``norm(x * silu(z)) * weight`` per group of channels.

    x, z: (..., d); weight: (d,); group_size divides d (None: one group, d).
    With ``norm_before_gate`` the gate is applied after the norm instead.
    Returns x's dtype.
    """
    dtype_in = x.dtype
    xf = x.float()
    if z is not None and not norm_before_gate:
        xf = xf * F.silu(z.float())
    d = xf.shape[-1]
    g = d if group_size is None else group_size
    if d % g:
        raise ValueError(f"group_size {g} does not divide {d}")
    xg = xf.unflatten(-1, (d // g, g))
    out = (xg * torch.rsqrt(xg.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2) * weight.float()
    if z is not None and norm_before_gate:
        out = out * F.silu(z.float())
    return out.to(dtype_in)
