"""Triton RMSNorms: fused residual add + RMSNorm (block norm) and Mamba-2's gated RMSNorm, each also with its output
quantized to int8 or fp8 e4m3 in the epilogue (``*_quant``: the input of an A8 linear, no quantize kernel of its own).

Same signatures as ``ssmq.ops.norm``. One program normalises one row (or one group of a row); rows are flattened
over the leading dims. The quantized epilogue rounds the output to its float dtype first, then takes the
reference's codes (``quantize_act_ref``): IEEE division, round half to even (``_common.quantize_codes``); the
dynamic per-token scale max(|out|) / 127 (e4m3: / 448) is computed in the program that owns the row, so nothing syncs with the
host (CUDA-graph capturable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ssmq.errors import SSMQError
from ssmq.kernels._common import FP8_QMAX, gdc_enter, pdl_args, pow2, quantize_codes, quantize_rne, silu, sm_count
from ssmq.kernels.launch import fast_launch
from ssmq.kernels.quant_gemm import quantize_act
from ssmq.ops.norm import rms_norm_quant_ref, rmsnorm_gated_quant_ref
from ssmq.ops.quant_linear import EPS


QUANT_EPS = tl.constexpr(EPS)  # smallest dynamic scale, as quantize_act_ref


@triton.jit
def _row_scale(y, scale_ptr, row, STATIC: tl.constexpr, FP8: tl.constexpr = False):
    """The row's quantization scale: the static one, or max(|y|) / qmax (at least EPS), stored at scale_ptr[row]."""
    if STATIC:
        return tl.load(scale_ptr)
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(y), axis=0), FP8_QMAX if FP8 else 127.0), QUANT_EPS)
    tl.store(scale_ptr + row, scale)
    return scale


@fast_launch
@triton.jit
def _rms_norm(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, q_ptr, scale_ptr, d, eps,
    s_x, s_r, s_o, s_ro,
    HAS_RES: tl.constexpr, QUANT: tl.constexpr, STATIC: tl.constexpr, BLOCK: tl.constexpr,
    USE_GDC: tl.constexpr = False, FP8: tl.constexpr = False,
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
    y = (r * rstd * w).to(out_ptr.dtype.element_ty)
    if QUANT:  # the codes of the output rounded to its dtype (out_ptr names that dtype; nothing is stored there)
        yf = y.to(tl.float32)
        tl.store(q_ptr + row * d + offs, quantize_codes(yf, _row_scale(yf, scale_ptr, row, STATIC, FP8), FP8), mask=m)
    else:
        tl.store(out_ptr + row * s_o + offs, y, mask=m)


def _rows(t, d):
    """(..., d) -> (M, d) with unit stride on d (a copy only when the view can't be made)."""
    t2 = t.reshape(-1, d)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _warps(block: int) -> int:
    return min(16, max(1, block // 256))


def _quant_out(x, x_scale, per_token, dtype=torch.int8):
    """(codes like x, of ``dtype`` (int8 or float8_e4m3fn); scale: the static one as (), or a per-token (...) buffer
    the kernel fills)."""
    if dtype not in (torch.int8, torch.float8_e4m3fn):
        raise SSMQError(f"activation codes are int8 or float8_e4m3fn, not {dtype}")
    q = torch.empty(x.shape, device=x.device, dtype=dtype)
    if x_scale is not None:
        if x_scale.numel() != 1:
            raise SSMQError(f"a static activation scale is per-tensor (), got shape {tuple(x_scale.shape)}")
        return q, x_scale.float().reshape(())
    return q, torch.empty(x.shape[:-1], device=x.device, dtype=torch.float32)


def _norm(x, weight, eps, residual, residual_in_fp32, quant):
    d = x.shape[-1]
    x2 = _rows(x, d)
    r2 = _rows(residual, d) if residual is not None else x2
    res_out = torch.empty(x.shape, device=x.device, dtype=torch.float32 if residual_in_fp32 else x.dtype)
    if quant is None:
        out = torch.empty(x.shape, device=x.device, dtype=weight.dtype)
        q = scale = out
    else:
        out = torch.empty(0, device=x.device, dtype=weight.dtype)  # names the dtype the codes are taken from
        q, scale = _quant_out(x, *quant)
    M, BLOCK = x2.shape[0], pow2(d, 16)
    if M:
        _rms_norm[(M,)](
            x2, r2, weight, out, res_out, q, scale, d, eps, x2.stride(0), r2.stride(0), d, d,
            HAS_RES=residual is not None, QUANT=quant is not None, STATIC=quant is not None and quant[0] is not None,
            FP8=q.dtype == torch.float8_e4m3fn, BLOCK=BLOCK, num_warps=_warps(BLOCK), **pdl_args(x2),
        )
    return (out, res_out) if quant is None else (q, scale, res_out)


def rms_norm(x, weight, eps=1e-5, residual=None, residual_in_fp32=True):
    """Residual add then RMSNorm, as ``rms_norm_ref``.

    x, residual: (..., d). Returns (out in weight's dtype, new_residual: float32
    when ``residual_in_fp32`` else x's dtype), both shaped like x.
    """
    return _norm(x, weight, eps, residual, residual_in_fp32, None)


def rms_norm_quant(x, weight, eps=1e-5, residual=None, residual_in_fp32=True, x_scale=None, per_token=True,
                   dtype=torch.int8):
    """``rms_norm`` with int8 / e4m3 codes out, as ``rms_norm_quant_ref``: (codes (..., d), scale, new_residual).

    x_scale: a static () scale, or None for dynamic per-token scales (...); dynamic per-tensor scales need the whole
    tensor first and run the reference (not a hot path of any recipe).
    """
    if x_scale is None and not per_token:
        return rms_norm_quant_ref(x, weight, eps, residual, residual_in_fp32, x_scale, per_token, dtype)
    return _norm(x, weight, eps, residual, residual_in_fp32, (x_scale, per_token, dtype))


@triton.jit
def gate(z_ptrs, cols, m, zs_ptr, s_zs, Z_QUANT: tl.constexpr):
    """silu(z) at z_ptrs (float32); Z_QUANT: of z's fake-quantized value (an ``ActQuantizer`` on z, scale () or per
    channel at zs_ptr + cols * s_zs), exactly as ``ops.quant_linear.fake_quantize_ref`` (and kernels.fake_quant)."""
    z = tl.load(z_ptrs, mask=m, other=0.0)
    zf = z.to(tl.float32)
    if Z_QUANT:
        zs = tl.load(zs_ptr + cols * s_zs, mask=m, other=1.0)
        zf = (quantize_rne(zf, zs).to(tl.float32) * zs).to(z.dtype).to(tl.float32)
    return silu(zf)


@triton.jit
def _gated_group(x_ptr, z_ptr, w_ptr, row, col0, gsize, eps, s_x, s_z, zs_ptr, s_zs,
                 HAS_Z: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr, BLOCK: tl.constexpr, Z_QUANT: tl.constexpr):
    """One norm group of a row, from column col0: (y float32 (BLOCK,), its columns, mask)."""
    col = col0 + tl.arange(0, BLOCK)
    m = tl.arange(0, BLOCK) < gsize
    x = tl.load(x_ptr + row * s_x + col, mask=m, other=0.0).to(tl.float32)
    if HAS_Z:
        g = gate(z_ptr + row * s_z + col, col, m, zs_ptr, s_zs, Z_QUANT)
        if not NORM_BEFORE_GATE:
            x *= g
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / gsize + eps)
    y = x * rstd * tl.load(w_ptr + col, mask=m, other=0.0).to(tl.float32)
    if HAS_Z:
        if NORM_BEFORE_GATE:
            y *= g
    return y, col, m


@fast_launch
@triton.jit
def _rmsnorm_gated(
    x_ptr, z_ptr, w_ptr, out_ptr, zs_ptr, gsize, eps,
    s_x, s_z, s_o, s_zs,
    HAS_Z: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr, BLOCK: tl.constexpr, Z_QUANT: tl.constexpr = False,
    USE_GDC: tl.constexpr = False,
):
    gdc_enter(USE_GDC)
    row = tl.program_id(0).to(tl.int64)
    y, col, m = _gated_group(x_ptr, z_ptr, w_ptr, row, tl.program_id(1) * gsize, gsize, eps, s_x, s_z, zs_ptr, s_zs,
                             HAS_Z, NORM_BEFORE_GATE, BLOCK, Z_QUANT)
    tl.store(out_ptr + row * s_o + col, y.to(out_ptr.dtype.element_ty), mask=m)


@fast_launch
@triton.jit
def _rmsnorm_gated_quant(
    x_ptr, z_ptr, w_ptr, out_ptr, q_ptr, scale_ptr, zs_ptr, n_groups, gsize, eps,
    s_x, s_z, s_o, s_q, s_zs,
    HAS_Z: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr, STORE_OUT: tl.constexpr, STATIC: tl.constexpr,
    ONE_GROUP: tl.constexpr, BLOCK: tl.constexpr, Z_QUANT: tl.constexpr = False, USE_GDC: tl.constexpr = False,
    FP8: tl.constexpr = False,
):
    """One program per row (a per-token scale spans all norm groups of the row). One group: normalised, scaled and
    quantized in registers. Several with a dynamic scale: a first pass over the groups finds max |out|, a second
    recomputes each group (its inputs are in cache) and stores its codes."""
    gdc_enter(USE_GDC)
    row = tl.program_id(0).to(tl.int64)
    if ONE_GROUP:
        y, col, m = _gated_group(x_ptr, z_ptr, w_ptr, row, 0, gsize, eps, s_x, s_z, zs_ptr, s_zs, HAS_Z,
                                 NORM_BEFORE_GATE, BLOCK, Z_QUANT)
        y = y.to(out_ptr.dtype.element_ty)
        if STORE_OUT:
            tl.store(out_ptr + row * s_o + col, y, mask=m)
        yf = y.to(tl.float32)
        tl.store(q_ptr + row * s_q + col, quantize_codes(yf, _row_scale(yf, scale_ptr, row, STATIC, FP8), FP8),
                 mask=m)
    else:
        if STATIC:
            scale = tl.load(scale_ptr)
        else:
            amax = 0.0
            for g in range(n_groups):
                y, col, m = _gated_group(x_ptr, z_ptr, w_ptr, row, g * gsize, gsize, eps, s_x, s_z, zs_ptr, s_zs,
                                         HAS_Z, NORM_BEFORE_GATE, BLOCK, Z_QUANT)
                amax = tl.maximum(amax, tl.max(tl.abs(y.to(out_ptr.dtype.element_ty).to(tl.float32)), axis=0))
            scale = tl.maximum(tl.math.div_rn(amax, FP8_QMAX if FP8 else 127.0), QUANT_EPS)
            tl.store(scale_ptr + row, scale)
        for g in range(n_groups):
            y, col, m = _gated_group(x_ptr, z_ptr, w_ptr, row, g * gsize, gsize, eps, s_x, s_z, zs_ptr, s_zs,
                                     HAS_Z, NORM_BEFORE_GATE, BLOCK, Z_QUANT)
            y = y.to(out_ptr.dtype.element_ty)
            if STORE_OUT:
                tl.store(out_ptr + row * s_o + col, y, mask=m)
            tl.store(q_ptr + row * s_q + col, quantize_codes(y.to(tl.float32), scale, FP8), mask=m)


def _gated_args(x, z, group_size):
    d = x.shape[-1]
    gs = d if group_size is None else group_size
    if d % gs:
        raise ValueError(f"group_size {gs} does not divide {d}")
    x2 = _rows(x, d)
    return d, gs, x2, _rows(z, d) if z is not None else x2


def rmsnorm_gated(x, weight, z=None, eps=1e-6, group_size=None, norm_before_gate=False, z_scale=None):
    """Gated RMSNorm ``norm(x * silu(z)) * weight`` per group, as ``rmsnorm_gated_ref``.

    x, z: (..., d); weight: (d,); group_size divides d (None: d); z_scale: z is fake-quantized first with it (() or
    (d,): an ``ActQuantizer`` on z, in registers, so that it needs no kernel of its own). Returns x's dtype.
    """
    d, gs, x2, z2 = _gated_args(x, z, group_size)
    zs, s_zs, z_quant = z_scale_arg(z_scale, z, d, x2)
    out = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    M = x2.shape[0]
    BLOCK = pow2(gs, 16)
    if M:
        _rmsnorm_gated[(M, d // gs)](
            x2, z2, weight, out, zs, gs, eps, x2.stride(0), z2.stride(0), d, s_zs,
            HAS_Z=z is not None, NORM_BEFORE_GATE=norm_before_gate, BLOCK=BLOCK, Z_QUANT=z_quant,
            num_warps=_warps(BLOCK), **pdl_args(x2),
        )
    return out


def z_scale_arg(z_scale, z, d: int, like):
    """(scale tensor, its stride over channels, Z_QUANT) for a z fake-quantization scale () / (d,) or None; none
    without a gate z."""
    if z_scale is None or z is None:
        return like, 0, False
    if z_scale.dim() not in (0, 1) or z_scale.numel() not in (1, d):
        raise SSMQError(f"z's fake-quant scale must be () or ({d},), got {tuple(z_scale.shape)}")
    zs = z_scale.float().reshape(-1)
    return zs, int(zs.numel() > 1), True


def rmsnorm_gated_quant(x, weight, z=None, eps=1e-6, group_size=None, norm_before_gate=False, x_scale=None,
                        per_token=True, with_out=False, z_scale=None, dtype=torch.int8):
    """``rmsnorm_gated`` with int8 / e4m3 codes out, as ``rmsnorm_gated_quant_ref``: (codes (..., d), scale, out or
    None).

    x_scale: a static () scale, or None for dynamic per-token scales (...) (dynamic per tensor: the reference).
    z_scale: z is fake-quantized first with it (() or (d,): an ``ActQuantizer`` on z, in registers).
    The reference's ``rotate`` (codes of the output's online Hadamard): ``ssmq.kernels.hadamard``.
    """
    if x_scale is None and not per_token:
        return rmsnorm_gated_quant_ref(x, weight, z, eps, group_size, norm_before_gate, x_scale, per_token, with_out,
                                       False, z_scale, dtype)
    d, gs, x2, z2 = _gated_args(x, z, group_size)
    M = x2.shape[0]
    if x_scale is None and gs != d and M < sm_count(x.device):
        # a dynamic scale over several norm groups: one program a row walks the row's groups twice, serially, and
        # too few rows leave the SMs idle (Mamba2-8B, 8 groups of 1024, batch 1: 16.2 us against the float norm's
        # program a group, 2.1 us, + the quantize kernel, 4.2; H100). Same arithmetic, same codes.
        out = rmsnorm_gated(x, weight, z, eps, group_size, norm_before_gate, z_scale)
        q, scale = quantize_act(out, None, True, dtype)
        return q, scale, out if with_out else None
    zs, s_zs, z_quant = z_scale_arg(z_scale, z, d, x2)
    out = torch.empty(x.shape if with_out else 0, device=x.device, dtype=x.dtype)
    q, scale = _quant_out(x, x_scale, per_token, dtype)
    BLOCK = pow2(gs, 16)
    if M:
        _rmsnorm_gated_quant[(M,)](
            x2, z2, weight, out, q, scale, zs, d // gs, gs, eps, x2.stride(0), z2.stride(0), d, d, s_zs,
            HAS_Z=z is not None, NORM_BEFORE_GATE=norm_before_gate, STORE_OUT=with_out, STATIC=x_scale is not None,
            ONE_GROUP=gs == d, BLOCK=BLOCK, Z_QUANT=z_quant, FP8=dtype == torch.float8_e4m3fn, num_warps=_warps(BLOCK),
            **pdl_args(x2),
        )
    return q, scale, out if with_out else None
