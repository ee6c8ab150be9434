"""Triton kernels of a gated RMSNorm whose group is split over tensor-parallel ranks (``ssmq.runtime.tp``).

Same signatures as ``rmsnorm_gated_partial_ref``, ``rmsnorm_gated_reduced_ref`` and ``rstd_scale_ref`` in
``ssmq.ops.norm``. They replace ~15 small torch kernels a layer (casts, silu, pow, sum, cat, rsqrt, ...; a
Mamba2-2.7B TP=2 decode step spent ~1.4 ms a token in them on 2 H200) by one kernel before the all-reduce and one
after it. One program per row (rows flattened over the leading dims), the whole row in registers: d_l and n are at
most a few thousand channels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ssmq.kernels._common import gdc_enter, pdl_args, pow2, silu
from ssmq.kernels.norm import _rows


def _warps(block: int) -> int:
    return min(16, max(1, block // 256))


@triton.jit
def _gated_partial(
    x_ptr, z_ptr, w_ptr, out_ptr, ss_ptr, d, k, col,
    s_x, s_z, s_o, s_ss,
    WITH_OUT: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr = False,
    USE_GDC: tl.constexpr = False,
):
    gdc_enter(USE_GDC)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < d
    x = tl.load(x_ptr + row * s_x + offs, mask=m, other=0.0).to(tl.float32)
    u = x * silu(tl.load(z_ptr + row * s_z + offs, mask=m, other=0.0).to(tl.float32))
    if NORM_BEFORE_GATE:
        ss = tl.sum(x * x, axis=0)
    else:
        ss = tl.sum(u * u, axis=0)
    # the whole row of the all-reduce's send buffer: this rank's group column, zeros elsewhere
    offs_k = tl.arange(0, BLOCK_K)
    tl.store(ss_ptr + row * s_ss + offs_k, tl.where(offs_k == col, ss, 0.0), mask=offs_k < k)
    if WITH_OUT:
        w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * s_o + offs, (u * w).to(out_ptr.dtype.element_ty), mask=m)


def rmsnorm_gated_partial(x, weight, z, ss_out, col=0, with_out=True, norm_before_gate=False):
    """As ``rmsnorm_gated_partial_ref``: writes ss_out (..., k) in place, returns u · weight (..., d_l) or None."""
    d = x.shape[-1]
    k = ss_out.shape[-1]
    x2, z2 = _rows(x, d), _rows(z, d)
    ss2 = ss_out.reshape(-1, k)
    if (k > 1 and ss2.stride(-1) != 1) or ss2.untyped_storage().data_ptr() != ss_out.untyped_storage().data_ptr():
        raise ValueError("ss_out must be a (..., k) view with unit stride on k (the all-reduce's send buffer)")
    out = torch.empty(x.shape, device=x.device, dtype=x.dtype) if with_out else None
    M = x2.shape[0]
    BLOCK = pow2(d, 16)
    if M:
        _gated_partial[(M,)](
            x2, z2, weight, out if with_out else x2, ss2, d, k, col, x2.stride(0), z2.stride(0), d, ss2.stride(0),
            WITH_OUT=with_out, BLOCK=BLOCK, BLOCK_K=pow2(k, 2), NORM_BEFORE_GATE=norm_before_gate,
            num_warps=_warps(BLOCK), **pdl_args(x2),
        )
    return out


@triton.jit
def _gated_reduced(
    x_ptr, z_ptr, w_ptr, ss_ptr, out_ptr, d, col, gsize, eps,
    s_x, s_z, s_ss, s_o,
    BLOCK: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr = False, USE_GDC: tl.constexpr = False,
):
    gdc_enter(USE_GDC)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < d
    x = tl.load(x_ptr + row * s_x + offs, mask=m, other=0.0).to(tl.float32)
    g = silu(tl.load(z_ptr + row * s_z + offs, mask=m, other=0.0).to(tl.float32))
    rstd = 1.0 / tl.sqrt(tl.load(ss_ptr + row * s_ss + col) / gsize + eps)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    if NORM_BEFORE_GATE:
        out = x * rstd * w * g
    else:
        out = x * g * rstd * w
    tl.store(out_ptr + row * s_o + offs, out.to(out_ptr.dtype.element_ty), mask=m)


def rmsnorm_gated_reduced(x, weight, z, ss, col, group_size, eps, norm_before_gate=False):
    """As ``rmsnorm_gated_reduced_ref``: (..., d_l) in x's dtype."""
    d = x.shape[-1]
    x2, z2 = _rows(x, d), _rows(z, d)
    ss2 = _rows(ss, ss.shape[-1])
    out = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    M = x2.shape[0]
    BLOCK = pow2(d, 16)
    if M:
        _gated_reduced[(M,)](
            x2, z2, weight, ss2, out, d, col, group_size, eps, x2.stride(0), z2.stride(0), ss2.stride(0), d,
            BLOCK=BLOCK, NORM_BEFORE_GATE=norm_before_gate, num_warps=_warps(BLOCK), **pdl_args(x2),
        )
    return out


@triton.jit
def _rstd_scale(
    red_ptr, b_ptr, out_ptr, n, gsize, eps, s_r, s_o,
    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, USE_GDC: tl.constexpr = False,
):
    gdc_enter(USE_GDC)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < n
    rstd = 1.0 / tl.sqrt(tl.load(red_ptr + row * s_r + n) / gsize + eps)
    o = tl.load(red_ptr + row * s_r + offs, mask=m, other=0.0) * rstd
    if HAS_BIAS:
        o += tl.load(b_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * s_o + offs, o.to(out_ptr.dtype.element_ty), mask=m)


def rstd_scale(red, group_size, eps, bias=None, out_dtype=None):
    """As ``rstd_scale_ref``: red (..., n + 1) float32 -> (..., n) in out_dtype (None: red's)."""
    n = red.shape[-1] - 1
    r2 = _rows(red, n + 1)
    out = torch.empty((*red.shape[:-1], n), device=red.device, dtype=out_dtype or red.dtype)
    M = r2.shape[0]
    BLOCK = pow2(n, 16)
    if M:
        _rstd_scale[(M,)](
            r2, bias if bias is not None else r2, out, n, group_size, eps, r2.stride(0), n,
            HAS_BIAS=bias is not None, BLOCK=BLOCK, num_warps=_warps(BLOCK), **pdl_args(r2),
        )
    return out
