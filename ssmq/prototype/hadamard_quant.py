"""Triton online Hadamard + int8 quantization: the input of a rotated A8 linear (Quamba's Hadamard on y, Quamba2's
and QuaRot's online rotation of out_proj's input) in one kernel, as ``ssmq.ops.hadamard.hadamard_quant_ref``.

The transform is the two-GEMM Kronecker form that CUDA runs unfused (``ops.hadamard.hadamard_transform_gemm``):
x (n,) read as X (t1, r), Y = H_t1 X R^T with the ±1 factor H_t1 and R = (H_{t2} (x) H_b) / sqrt(n) (``kron_factors``),
one program per row with both products on tensor cores (tiles padded to powers of two, zeros outside), rounded
to the work dtype after each product and to x's dtype at the end as the unfused GEMMs are, then quantized in
registers: the per-token scale max |y| / 127 of the whole row or a static one, IEEE division, round half to
even (``_common.quantize_rne``). Replaces two cuBLAS GEMMs and the quantize kernel (three launches) with one; no
host sync (CUDA-graph capturable).

A prototype: no configuration runs it. On an H100 (Quamba2 W8A8 Mamba2-2.7B, batch 1) it took 14.8 us a layer
(20.6 in a coalesced-load variant) against ~9.5 us for the float16 Hadamard GEMMs + the quantize kernel it
replaces: the two small products per row do not fill the tensor cores the way the batched GEMMs do.

Glossary: m rows (all leading dims), n = t1 * r row width, BT / BR the padded t1 / r.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ssmq.kernels._common import dot_precision, gdc_enter, pdl_args, pow2, quantize_rne
from ssmq.kernels.fake_quant import fake_quantize
from ssmq.kernels.norm import _quant_out, _row_scale, gate, rmsnorm_gated, z_scale_arg
from ssmq.ops.hadamard import hadamard_quant_ref, kron_factors, split_order
from ssmq.ops.norm import rmsnorm_gated_quant_ref

MAX_R = 128  # widest right factor tile: larger ones (n > 8192) keep the unfused path (register / smem budget)
CFG = dict(warps=8)  # launch setting (the benchmark sweeps it; 4 measured 14.8 us a row before the coalesced R load)


@triton.jit
def _hadamard_quant(x_ptr, z_ptr, w_ptr, l_ptr, r_ptr, q_ptr, scale_ptr, y_ptr, zs_ptr, s_xm, s_zm, s_zs, eps,
                    T: tl.constexpr, R: tl.constexpr, GATED: tl.constexpr, HAS_Z: tl.constexpr, STATIC: tl.constexpr, STORE_Y: tl.constexpr,
                    PRECISION: tl.constexpr, BT: tl.constexpr, BR: tl.constexpr, Z_QUANT: tl.constexpr = False,
                    USE_GDC: tl.constexpr = False):
    """One row: [gated RMSNorm (GATED: one norm group, the row),] Hadamard, int8 codes. T, R constexpr (a model has
    one or two widths): masks and addresses fold, loads vectorize (4408 -> 2704 SASS instructions a thread, sm_90)."""
    gdc_enter(USE_GDC)
    row = tl.program_id(0).to(tl.int64)
    t = tl.arange(0, BT)
    r = tl.arange(0, BR)
    mt, mr = t < T, r < R
    mx = mt[:, None] & mr[None, :]
    cols = t[:, None] * R + r[None, :]  # (BT, BR): element (i, j) of X is x[i * r + j]
    work = l_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * s_xm + cols, mask=mx, other=0.0)
    if GATED:  # norm(x * silu(z)) * w as rmsnorm_gated_ref, rounded to x's dtype as the unfused norm's output
        u = x.to(tl.float32)
        if HAS_Z:
            u *= gate(z_ptr + row * s_zm + cols, cols, mx, zs_ptr, s_zs, Z_QUANT)
        rstd = 1.0 / tl.sqrt(tl.sum(tl.sum(u * u, axis=1), axis=0) / (T * R) + eps)
        x = (u * rstd * tl.load(w_ptr + cols, mask=mx, other=0.0).to(tl.float32)).to(x_ptr.dtype.element_ty)
    x = x.to(work)
    left = tl.load(l_ptr + t[:, None] * T + t[None, :], mask=mt[:, None] & mt[None, :], other=0.0)
    # R row-major (coalesced; the first version loaded R^T column by column: 14.8 us a row on the H100), transposed
    # as a dot operand
    right = tl.load(r_ptr + r[:, None] * R + r[None, :], mask=mr[:, None] & mr[None, :], other=0.0)
    hx = tl.dot(left, x, input_precision=PRECISION).to(work)
    y = tl.dot(hx, tl.trans(right), input_precision=PRECISION).to(work).to(x_ptr.dtype.element_ty)
    if STORE_Y:
        tl.store(y_ptr + row * (T * R) + cols, y, mask=mx)
    yf = y.to(tl.float32)
    scale = _row_scale(tl.reshape(yf, (BT * BR,)), scale_ptr, row, STATIC)
    tl.store(q_ptr + row * (T * R) + cols, quantize_rne(yf, scale), mask=mx)


def _factors(x):
    """(left, right) Kronecker factors in the work dtype of ``hadamard_transform_gemm`` (bf16: float32), or None
    where this kernel does not run (right factor wider than MAX_R, or x not a float16 / bfloat16 / float32)."""
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return None
    two, b = split_order(x.shape[-1])
    left, right = kron_factors(two, b, x.device, torch.float16 if x.dtype == torch.float16 else torch.float32)
    return None if pow2(right.shape[0], 16) > MAX_R else (left, right)


def _launch(x, z, weight, eps, factors, x_scale, with_y, z_scale=None):
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    z2 = x2 if z is None else z.reshape(-1, n)
    if z2.stride(-1) != 1:
        z2 = z2.contiguous()
    left, right = factors
    T, R = left.shape[0], right.shape[0]
    q, scale = _quant_out(x, x_scale, True)
    y = torch.empty(x.shape if with_y else 0, device=x.device, dtype=x.dtype)
    zs, s_zs, z_quant = z_scale_arg(z_scale, z, n, x2)
    M = x2.shape[0]
    if M:
        _hadamard_quant[(M,)](x2, z2, x2 if weight is None else weight, left, right, q, scale, y, zs,
                              x2.stride(0), z2.stride(0), s_zs, eps, T=T, R=R, GATED=weight is not None, HAS_Z=z is not None,
                              STATIC=x_scale is not None, STORE_Y=with_y, PRECISION=dot_precision(left.dtype),
                              BT=pow2(T, 16), BR=pow2(R, 16), Z_QUANT=z_quant, num_warps=CFG["warps"],
                              **pdl_args(x2))
    return q, scale, y if with_y else None


def hadamard_quant(x, x_scale=None, per_token=True, with_y=False):
    """``hadamard_quant_ref`` on the GPU: x (..., n) float -> (codes (..., n) int8, scale () or (...)); with
    ``with_y`` also the rotated x (..., n) in x's dtype (tests: the codes are exactly those of that y)."""
    factors = _factors(x)
    if factors is None or (x_scale is None and not per_token):
        return hadamard_quant_ref(x, x_scale, per_token, with_y)  # the unfused transform and quantize
    q, scale, y = _launch(x, None, None, 0.0, factors, x_scale, with_y)
    return (q, scale, y) if with_y else (q, scale)


def rmsnorm_gated_hadamard_quant(x, weight, z=None, eps=1e-6, group_size=None, norm_before_gate=False, x_scale=None,
                                 per_token=True, with_out=False, z_scale=None):
    """The gated norm, its Hadamard and int8 codes in one kernel when the norm has one group (the whole row):
    ``ops.norm.rmsnorm_gated_quant_ref(..., rotate=True)`` -> (codes, scale, rotated out or None). Several norm
    groups: the gated-norm kernel, then ``hadamard_quant``."""
    if norm_before_gate:  # no model gates after the norm: the reference
        return rmsnorm_gated_quant_ref(x, weight, z, eps, group_size, True, x_scale, per_token, with_out, True,
                                       z_scale)
    factors = _factors(x)
    if factors is None or (group_size not in (None, x.shape[-1])) or (x_scale is None and not per_token):
        if z is not None and z_scale is not None:
            z = fake_quantize(z, z_scale)
        out = rmsnorm_gated(x, weight, z, eps, group_size, False)
        q, scale, *y = hadamard_quant(out, x_scale, per_token, with_out)
        return q, scale, y[0] if with_out else None
    return _launch(x, z, weight, eps, factors, x_scale, with_out, z_scale)
