"""Triton RMSNorms: fused residual add + RMSNorm (block norm) and Mamba-2's gated RMSNorm.

Same signatures as ``ssmq.ops.norm``. One program normalises one row (or one
group of a row); rows are flattened over the leading dims.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ssmq.kernels._common import gdc_enter, pdl_args, pow2, silu


@triton.jit
def _rms_norm(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, d, eps,
    s_x, s_r, s_o, s_ro,
    HAS_RES: tl.constexpr, BLOCK: tl.constexpr, USE_GDC: tl.constexpr = False,
):
    gdc_enter(USE_GDC)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < d
    r = tl.load(x_ptr + row * s_x + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_RES:
        r += tl.load(res_ptr + row * s_r + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(res_out_ptr + row * s_ro + offs, r.to(res_out_ptr.dtype.element_ty), mask=m)
    # the float32 sum is normalised even when the stored residual is rounded, as in the reference
    rstd = 1.0 / tl.sqrt(tl.sum(r * r, axis=0) / d + eps)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * s_o + offs, (r * rstd * w).to(out_ptr.dtype.element_ty), mask=m)


def _rows(t, d):
    """(..., d) -> (M, d) with unit stride on d (a copy only when the view can't be made)."""
    t2 = t.reshape(-1, d)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def rms_norm(x, weight, eps=1e-5, residual=None, residual_in_fp32=True):
    """Residual add then RMSNorm, as ``rms_norm_ref``.

    x, residual: (..., d). Returns (out in weight's dtype, new_residual: float32
    when ``residual_in_fp32`` else x's dtype), both shaped like x.
    """
    d = x.shape[-1]
    x2 = _rows(x, d)
    r2 = _rows(residual, d) if residual is not None else x2
    out = torch.empty(x.shape, device=x.device, dtype=weight.dtype)
    res_out = torch.empty(x.shape, device=x.device, dtype=torch.float32 if residual_in_fp32 else x.dtype)
    M = x2.shape[0]
    BLOCK = pow2(d, 16)
    if M:
        _rms_norm[(M,)](
            x2, r2, weight, out, res_out, d, eps, x2.stride(0), r2.stride(0), d, d,
            HAS_RES=residual is not None, BLOCK=BLOCK, num_warps=min(16, max(1, BLOCK // 256)), **pdl_args(x2),
        )
    return out, res_out


@triton.jit
def _rmsnorm_gated(
    x_ptr, z_ptr, w_ptr, out_ptr, gsize, eps,
    s_x, s_z, s_o,
    HAS_Z: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr, BLOCK: tl.constexpr, USE_GDC: tl.constexpr = False,
):
    gdc_enter(USE_GDC)
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * gsize + tl.arange(0, BLOCK)
    m = tl.arange(0, BLOCK) < gsize
    x = tl.load(x_ptr + row * s_x + col, mask=m, other=0.0).to(tl.float32)
    if HAS_Z:
        gate = silu(tl.load(z_ptr + row * s_z + col, mask=m, other=0.0).to(tl.float32))
        if not NORM_BEFORE_GATE:
            x *= gate
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / gsize + eps)
    y = x * rstd * tl.load(w_ptr + col, mask=m, other=0.0).to(tl.float32)
    if HAS_Z:
        if NORM_BEFORE_GATE:
            y *= gate
    tl.store(out_ptr + row * s_o + col, y.to(out_ptr.dtype.element_ty), mask=m)


def rmsnorm_gated(x, weight, z=None, eps=1e-6, group_size=None, norm_before_gate=False):
    """Gated RMSNorm ``norm(x * silu(z)) * weight`` per group, as ``rmsnorm_gated_ref``.

    x, z: (..., d); weight: (d,); group_size divides d (None: d). Returns x's dtype.
    """
    d = x.shape[-1]
    gs = d if group_size is None else group_size
    if d % gs:
        raise ValueError(f"group_size {gs} does not divide {d}")
    x2 = _rows(x, d)
    z2 = _rows(z, d) if z is not None else x2
    out = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    M = x2.shape[0]
    BLOCK = pow2(gs, 16)
    if M:
        _rmsnorm_gated[(M, d // gs)](
            x2, z2, weight, out, gs, eps, x2.stride(0), z2.stride(0), d,
            HAS_Z=z is not None, NORM_BEFORE_GATE=norm_before_gate, BLOCK=BLOCK,
            num_warps=min(16, max(1, BLOCK // 256)), **pdl_args(x2),
        )
    return out
