"""RMSNorm references: the block norm with fused residual add, and Mamba-2's gated norm (each also with its output
quantized to int8 for the A8 linear that reads it)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ssmq.ops.hadamard import hadamard_transform
from ssmq.ops.quant_linear import fake_quantize_ref, quantize_act_ref


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
    z_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mamba-2's gated RMSNorm: ``norm(x * silu(z)) * weight`` per group of channels.

    x, z: (..., d); weight: (d,); group_size divides d (None: one group, d).
    With ``norm_before_gate`` the gate is applied after the norm instead.
    z_scale (() or (d,)): z is fake-quantized with it first (``fake_quantize_ref``: an ``ActQuantizer`` on z).
    Returns x's dtype.
    """
    if z is not None and z_scale is not None:
        z = fake_quantize_ref(z, z_scale)
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


# The A8 linear that reads a norm's output takes it as int8 codes + scale (``quant_linear(x_q, ..., x_scale)``):
# these two are the norms with that quantization in their epilogue, so that no quantize runs on its own.
def rms_norm_quant_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-5,
    residual: torch.Tensor | None = None,
    residual_in_fp32: bool = True,
    x_scale: torch.Tensor | None = None,
    per_token: bool = True,
    dtype: torch.dtype = torch.int8,
):
    """``rms_norm_ref`` with its output quantized: (codes (..., d) ``dtype``, scale, new_residual).

    The output is rounded to weight's dtype, then quantized as ``quantize_act_ref(out, x_scale, per_token, dtype)`` (a
    static () scale, or dynamic per token (...) / per tensor ()): the codes of the unfused pair, bit for bit; dtype
    int8 or float8_e4m3fn.
    """
    out, new_residual = rms_norm_ref(x, weight, eps, residual, residual_in_fp32)
    q, scale = quantize_act_ref(out, x_scale, per_token, dtype)
    return q, scale, new_residual


def rmsnorm_gated_quant_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    z: torch.Tensor | None = None,
    eps: float = 1e-6,
    group_size: int | None = None,
    norm_before_gate: bool = False,
    x_scale: torch.Tensor | None = None,
    per_token: bool = True,
    with_out: bool = False,
    rotate: bool = False,
    z_scale: torch.Tensor | None = None,
    dtype: torch.dtype = torch.int8,
):
    """``rmsnorm_gated_ref`` with its output (x's dtype) quantized as ``quantize_act_ref(out, x_scale, per_token,
    dtype)`` (int8 or float8_e4m3fn codes);
    with ``rotate``, the output's online Hadamard (``hadamard_transform``, x's dtype) is what is quantized (the input
    of a rotated A8 out_proj).

    z_scale (() or (d,)): z is fake-quantized with it first (``fake_quantize_ref``: an ``ActQuantizer`` on z).

    Returns (codes (..., d) ``dtype``, scale, the quantized float output (..., d) in x's dtype when ``with_out``, else
    None).
    """
    out = rmsnorm_gated_ref(x, weight, z, eps, group_size, norm_before_gate, z_scale)
    if rotate:
        out = hadamard_transform(out)
    q, scale = quantize_act_ref(out, x_scale, per_token, dtype)
    return q, scale, out if with_out else None


# Tensor parallelism (ssmq.runtime.tp) can split one gated-norm group over ranks (Mamba-2 with ngroups 1): each rank
# holds d_l of the group's channels, and the group's sum of squares is the sum of the ranks' partial sums. These
# three ops are the rank-local pieces around the all-reduce that adds them up.
def rmsnorm_gated_partial_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    z: torch.Tensor,
    ss_out: torch.Tensor,
    col: int = 0,
    with_out: bool = True,
    norm_before_gate: bool = False,
) -> torch.Tensor | None:
    """One rank's share of a gated RMSNorm whose group spans ranks, before the reduction.

    x, z: (..., d_l) this rank's channels; weight: (d_l,) their norm weight; ss_out: (..., k) float32, written in
    place (it is what the all-reduce sends): column ``col`` gets sum(u²) over the rank's channels, u = x · silu(z)
    in float32 (sum(x²) with ``norm_before_gate``), the other columns 0. Returns u · weight in x's dtype (..., d_l):
    out_proj's input on the fused path, where out_proj(u · w) · rstd == out_proj(norm(u) · w) because rstd is one
    number per token (and so with the gate after the norm); None when not ``with_out`` (the two-all-reduce path
    normalises after the reduction, ``rmsnorm_gated_reduced_ref``).
    """
    u = x.float() * F.silu(z.float())
    ss_out.zero_()
    ss_out[..., col] = (x.float() if norm_before_gate else u).pow(2).sum(-1)
    return (u * weight.float()).to(x.dtype) if with_out else None


def rmsnorm_gated_reduced_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    z: torch.Tensor,
    ss: torch.Tensor,
    col: int,
    group_size: int,
    eps: float,
    norm_before_gate: bool = False,
) -> torch.Tensor:
    """This rank's channels of a gated RMSNorm given their group's all-reduced sum of squares ``ss[..., col]``.

    x, z: (..., d_l); weight: (d_l,); ss: (..., k) float32. Returns x · silu(z) · rsqrt(ss / group_size + eps) ·
    weight in x's dtype (..., d_l); with ``norm_before_gate`` (ss a sum of x²) x · rsqrt(…) · weight · silu(z).
    """
    rstd = torch.rsqrt(ss[..., col:col + 1] / group_size + eps)
    if norm_before_gate:
        return (x.float() * rstd * weight.float() * F.silu(z.float())).to(x.dtype)
    u = x.float() * F.silu(z.float())
    return (u * rstd * weight.float()).to(x.dtype)


def rstd_scale_ref(
    red: torch.Tensor,
    group_size: int,
    eps: float,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The fused path after its all-reduce: red (..., n + 1) float32 = [Σ_ranks out_proj(u · w) | Σ_ranks sum(u²)].

    Returns red[..., :n] · rsqrt(red[..., n] / group_size + eps) (+ bias) in ``out_dtype`` (None: red's), (..., n).
    """
    out = red[..., :-1] * torch.rsqrt(red[..., -1:] / group_size + eps)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype or red.dtype)
