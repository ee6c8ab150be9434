"""Triton online Hadamard + int8 quantization: the input of a rotated A8 linear (Quamba2's and QuaRot's online
rotation of out_proj's input) in one kernel, as ``ssmq.ops.hadamard.hadamard_quant_ref``; with the gated norm before
it (and act_z's fake-quantization of z) as ``ops.norm.rmsnorm_gated_quant_ref(..., rotate=True)``.

The transform is the two-GEMM Kronecker form that CUDA runs unfused (``ops.hadamard.hadamard_transform_gemm``):
x (n,) read as X (t1, r), Y = H_t1 X R^T with the ±1 factor H_t1 and R = (H_{t2} (x) H_b) / sqrt(n) (``kron_factors``),
both products on tensor cores (tiles padded to powers of two, zeros outside), rounded to the work dtype after each
product and to x's dtype at the end as the unfused GEMMs are, then quantized in registers with the static scale
(IEEE division, round half to even: ``_common.quantize_rne``). No host sync (CUDA-graph capturable).

Where it runs: Mamba-2's gated norm hands a rotated out_proj with a static scale its codes through this kernel
(``models.act_codes``) at decode rows (configs/hadamard.json's max_rows), replacing act_z's fake-quant, the norm,
two cuBLAS GEMMs and a quantize kernel. Each program writes one (TT, RT) tile of a row's Y, reading the whole row: a
row on one program is latency-bound (one SM), and a static scale needs nothing from the other tiles. Elsewhere the
pair runs (the Hadamard GEMMs, then the quantize kernel): a dynamic scale needs the row's max, and the row as one
tile measured slower than the pair on an H100 (14.8 us a layer against ~9.5); more rows are cheaper on the GEMMs
than gated and transformed row by row.

Glossary: m rows (all leading dims), n = t1 * r row width, BT / BR the padded t1 / r.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ssmq.kernels import configs
from ssmq.kernels._common import dot_precision, gdc_enter, pdl_args, pow2, quantize_rne
from ssmq.kernels.norm import _quant_out, _rows, gate, rmsnorm_gated, z_scale_arg
from ssmq.kernels.quant_gemm import quantize_act
from ssmq.ops.hadamard import hadamard_transform_gemm, kron_factors, split_order
from ssmq.ops.norm import rmsnorm_gated_quant_ref

MAX_R = 128  # widest right factor tile: larger ones (n > 8192) keep the unfused path (register / smem budget)
CFG = configs.load("hadamard")  # configs/hadamard.json: warps, the tile of Y a program writes, max_rows it serves


@triton.jit
def _hadamard_quant(x_ptr, z_ptr, w_ptr, l_ptr, r_ptr, q_ptr, scale_ptr, y_ptr, zs_ptr, s_xm, s_zm, s_zs, eps,
                    T: tl.constexpr, R: tl.constexpr, GATED: tl.constexpr, HAS_Z: tl.constexpr, STORE_Y: tl.constexpr,
                    PRECISION: tl.constexpr, BT: tl.constexpr, BR: tl.constexpr,
                    TT: tl.constexpr, RT: tl.constexpr, Z_QUANT: tl.constexpr = False, USE_GDC: tl.constexpr = False):
    """One (TT, RT) tile of a row's Y: [gated RMSNorm (GATED: one norm group, the row),] Hadamard, int8 codes with the
    static scale at scale_ptr. Every tile's program reads the whole row (the norm's sum of squares and H_t1 X need
    it) and writes its tile. T, R constexpr (a model has one or two widths): masks and addresses fold, loads
    vectorize."""
    gdc_enter(USE_GDC)
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    n_r: tl.constexpr = (R + RT - 1) // RT
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
    to = (tile // n_r) * TT + tl.arange(0, TT)  # the tile's rows of Y (of H_t1) and columns (rows of R)
    ro = (tile % n_r) * RT + tl.arange(0, RT)
    left = tl.load(l_ptr + to[:, None] * T + t[None, :], mask=(to < T)[:, None] & mt[None, :], other=0.0)
    # R's rows loaded row-major (coalesced), transposed as a dot operand
    right = tl.load(r_ptr + ro[:, None] * R + r[None, :], mask=(ro < R)[:, None] & mr[None, :], other=0.0)
    hx = tl.dot(left, x, input_precision=PRECISION).to(work)
    y = tl.dot(hx, tl.trans(right), input_precision=PRECISION).to(work).to(x_ptr.dtype.element_ty)
    mo = (to < T)[:, None] & (ro < R)[None, :]
    out = to[:, None] * R + ro[None, :]
    if STORE_Y:
        tl.store(y_ptr + row * (T * R) + out, y, mask=mo)
    yf = y.to(tl.float32)
    tl.store(q_ptr + row * (T * R) + out, quantize_rne(yf, tl.load(scale_ptr)), mask=mo)


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
    x2 = _rows(x, n)
    z2 = x2 if z is None else _rows(z, n)
    left, right = factors
    T, R = left.shape[0], right.shape[0]
    q, scale = _quant_out(x, x_scale, True)
    y = torch.empty(x.shape if with_y else 0, device=x.device, dtype=x.dtype)
    zs, s_zs, z_quant = z_scale_arg(z_scale, z, n, x2)
    M = x2.shape[0]
    BT, BR = pow2(T, 16), pow2(R, 16)
    TT, RT = min(CFG["tile_t"], BT), min(CFG["tile_r"], BR)
    if M:
        grid = (M, triton.cdiv(T, TT) * triton.cdiv(R, RT))
        _hadamard_quant[grid](x2, z2, x2 if weight is None else weight, left, right, q, scale, y, zs, x2.stride(0),
                              z2.stride(0), s_zs, eps, T=T, R=R, GATED=weight is not None, HAS_Z=z is not None,
                              STORE_Y=with_y, PRECISION=dot_precision(left.dtype), BT=BT, BR=BR, TT=TT, RT=RT,
                              Z_QUANT=z_quant, num_warps=CFG["warps"], **pdl_args(x2))
    return q, scale, y if with_y else None


def _fused(x, x_scale):
    """The Kronecker factors where this kernel serves x (..., n): a static scale, up to CFG's max_rows rows (every
    program gates and transforms its row whole: more rows, e.g. a prefill, are cheaper on the GEMMs), a right
    factor that fits; else None."""
    if x_scale is None or x.numel() > CFG["max_rows"] * x.shape[-1]:
        return None
    return _factors(x)


def _pair(y, x_scale, per_token, with_y):
    """What a rotated linear runs on its own input: the two Hadamard GEMMs, then the quantize kernel."""
    y = hadamard_transform_gemm(y)
    q, scale = quantize_act(y, x_scale, per_token)
    return q, scale, y if with_y else None


def hadamard_quant(x, x_scale=None, per_token=True, with_y=False):
    """``hadamard_quant_ref`` on the GPU: x (..., n) float -> (codes (..., n) int8, scale () or (...)); with
    ``with_y`` also the rotated x (..., n) in x's dtype (tests: the codes are exactly those of that y)."""
    factors = _fused(x, x_scale)
    q, scale, y = _pair(x, x_scale, per_token, with_y) if factors is None else \
        _launch(x, None, None, 0.0, factors, x_scale, with_y)
    return (q, scale, y) if with_y else (q, scale)


def rmsnorm_gated_hadamard_quant(x, weight, z=None, eps=1e-6, group_size=None, norm_before_gate=False, x_scale=None,
                                 per_token=True, with_out=False, z_scale=None):
    """The gated norm, its Hadamard and int8 codes in one kernel when the norm has one group (the whole row) and
    ``_fused`` serves x: ``ops.norm.rmsnorm_gated_quant_ref(..., rotate=True)`` -> (codes, scale, rotated out or
    None). Otherwise the gated-norm kernel (z's fake-quant inside), then ``hadamard_quant``."""
    if norm_before_gate:  # no model gates after the norm: the reference
        return rmsnorm_gated_quant_ref(x, weight, z, eps, group_size, True, x_scale, per_token, with_out, True,
                                       z_scale)
    factors = _fused(x, x_scale)
    if factors is None or group_size not in (None, x.shape[-1]):
        out = rmsnorm_gated(x, weight, z, eps, group_size, False, z_scale)
        q, scale, *y = hadamard_quant(out, x_scale, per_token, with_out)
        return q, scale, y[0] if with_out else None
    return _launch(x, z, weight, eps, factors, x_scale, with_out, z_scale)
