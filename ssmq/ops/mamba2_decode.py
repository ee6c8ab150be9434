"""One Mamba-2 decode step between in_proj and out_proj, as one op (the contract of the fused kernel).

    xBC  <- silu(conv_update(xBC))                      (shifts conv_state)
    Δ     = softplus(dt + dt_bias), clamped to dt_limit
    y     = selective_state_update(x, Δ, A, B, C, D)    (advances ssm_state)
    out   = rmsnorm_gated(y, z) per norm group          (norm(y · silu(z)) · weight)
    [out_q, out_scale = int8 quantization of out]       (A8 recipes: per-token dynamic, or a static scale)

It is exactly the composition of ``causal_conv1d_update_ref``, ``selective_state_update_ref`` and
``rmsnorm_gated_ref`` as ``Mamba2Mixer.step`` ran them one by one (the same fp16 roundings between
the stages), so the unfused path and this op agree bit for bit in float32.

Layout (glossary in ``ssmq.ops``): xbc (b, conv_dim) = [x (h·p) | B (g·n) | C (g·n)], the pre-conv
slice of in_proj's output; z (b, h·p); dt (b, h) raw (before bias and softplus); conv_state
(s, conv_dim, w-1); conv_weight (conv_dim, w); ssm_state (s, h, p, n); A (h,) = -exp(A_log); D,
dt_bias (h,); norm_weight (h·p,); slots (b,) the cache row of each batch row (rows 0..b-1 if None).
"""

from __future__ import annotations

import torch

from ssmq.ops.conv1d import causal_conv1d_update_ref
from ssmq.ops.layout import NO_DT_LIMIT, discretize_dt, has_dt_limit, mamba2_conv_segments
from ssmq.ops.norm import rmsnorm_gated_quant_ref, rmsnorm_gated_ref
from ssmq.ops.quant_linear import quantize_act_ref
from ssmq.ops.state_update import selective_state_update_ref


def mamba2_decode_step_ref(
    xbc: torch.Tensor,
    z: torch.Tensor,
    dt: torch.Tensor,
    conv_state: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    ssm_state: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    ngroups: int,
    norm_group_size: int,
    eps: float,
    dt_limit: tuple[float, float] = NO_DT_LIMIT,
    slots: torch.Tensor | None = None,
    quantize: bool = False,
    out_scale: torch.Tensor | None = None,
):
    """Advance conv_state and ssm_state (in place) one token and return the gated-norm output.

    Returns out (b, h·p) in xbc's dtype; with ``quantize`` also its int8 codes (b, h·p) and float32
    scale, as ``ssmq.ops.quant_linear.quantize_act_ref`` makes them for ``quant_linear``: ``out_scale``
    (a static per-tensor scale, returned as ()) or, when None, per token (b,) = max(|out|, row) / 127.
    """
    return compose(causal_conv1d_update_ref, selective_state_update_ref, rmsnorm_gated_ref,
                   xbc, z, dt, conv_state, conv_weight, conv_bias, ssm_state, A, D, dt_bias, norm_weight,
                   ngroups, norm_group_size, eps, dt_limit, slots, quantize, out_scale, rmsnorm_gated_quant_ref)


def compose(conv_update, state_update, norm, xbc, z, dt, conv_state, conv_weight, conv_bias, ssm_state, A, D,
            dt_bias, norm_weight, ngroups, norm_group_size, eps, dt_limit, slots, quantize, out_scale, norm_quant=None):
    """The decode step from three single-stage ops (references, or their kernels as a fallback); ``norm_quant`` (the
    gated norm with int8 codes out, ``rmsnorm_gated_quant``) quantizes in the norm's epilogue, else the norm's output
    is quantized after it."""
    b = xbc.shape[0]
    _, h, p, n = ssm_state.shape
    xbc = conv_update(xbc, conv_state, conv_weight, conv_bias, "silu", slots)
    x, B, C = mamba2_conv_segments(h * p, ngroups, n).split(xbc)
    if not has_dt_limit(dt_limit):  # the state update applies bias and softplus itself
        dt, bias, softplus = dt, dt_bias, True
    else:  # it knows no clamp: discretize here
        dt, bias, softplus = discretize_dt(dt, dt_bias, True, dt_limit), None, False
    y = state_update(
        ssm_state, x.reshape(b, h, p), dt[:, :, None].expand(b, h, p), A[:, None, None].expand(h, p, n),
        B.reshape(b, ngroups, n), C.reshape(b, ngroups, n), D=D[:, None].expand(h, p),
        dt_bias=None if bias is None else bias[:, None].expand(h, p), dt_softplus=softplus, state_batch_indices=slots,
    )
    if quantize and norm_quant is not None:  # the A8 linear's input: codes + per-token (or static) scale
        q, scale, out = norm_quant(y.reshape(b, h * p), norm_weight, z, eps, norm_group_size, False, out_scale, True,
                                   True)
        return out, q, scale
    out = norm(y.reshape(b, h * p), norm_weight, z, eps, norm_group_size, False)
    if not quantize:
        return out
    q, scale = quantize_act_ref(out, out_scale)
    return out, q, scale
