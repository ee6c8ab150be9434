"""Triton depthwise causal conv1d: prefill over a sequence and the one-token decode update.

Same signatures and cache convention as ``ssmq.ops.conv1d``: conv_state is the
last w-1 inputs of a sequence, oldest first. SiLU is fused into the epilogue, and so is, for the
Quamba / Quamba2 taps, the int8 quantization of the output (``conv1d_silu_quant`` and
``conv1d_update_silu_quant``, the twins of ``ssmq.ops.quant_ssm``'s references): the same two kernels with
a per-channel scale vector (stride 0: one per-tensor scale) and int8 codes out.
With ``int8`` (``ssmq.ops.conv1d.ConvInt8``) the weights (and bias) are int8 codes: the same kernels, specialised
(constexpr ``INT8``), quantize each input they load with the static input scale, sum code products exactly (in
float32: |sum| <= 127 * 127 * w < 2^24, the int32 sum of the reference) and rescale once in the epilogue.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ssmq.errors import SSMQError
from ssmq.kernels._common import cdiv, gdc_enter, pdl_args, pow2, quantize_rne, silu
from ssmq.kernels.launch import fast_launch


def _check_activation(activation):
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported conv1d activation {activation!r} (use 'silu' or None)")
    return activation is not None


@triton.jit
def _quantize_out(acc, x_ptr, scale_ptrs, mask):
    # the reference quantizes the conv output as returned, in x's dtype: round to it first (fp16 / bf16)
    v = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
    return quantize_rne(v, tl.load(scale_ptrs, mask=mask, other=1.0).to(tl.float32))  # int8 codes


@triton.jit
def _int8_rescale(offs_d, mask_d, ws_ptr, swsd, as_ptr, bias_ptr, bs_ptr, HAS_BIAS: tl.constexpr,
                  INT8_BIAS: tl.constexpr):
    # per channel (BD,): act_scale * weight_scale, and the bias (its codes times its scale; 0 without one):
    # the integer sums become acc * scale + bias, in the reference's order
    scale = tl.load(as_ptr).to(tl.float32) * tl.load(ws_ptr + offs_d * swsd, mask=mask_d, other=1.0).to(tl.float32)
    b = tl.zeros(scale.shape, dtype=tl.float32)
    if HAS_BIAS:
        b = tl.load(bias_ptr + offs_d, mask=mask_d, other=0).to(tl.float32)
        if INT8_BIAS:
            b = b * tl.load(bs_ptr).to(tl.float32)
    return scale, b


@fast_launch
@triton.jit
def _conv1d_fwd(
    x_ptr, w_ptr, bias_ptr, init_ptr, out_ptr, qs_ptr, ws_ptr, as_ptr, bs_ptr,
    d, l,
    sxb, sxd, sxl, swd, sww, sib, sid, siw, sob, sod, sol, sqd, swsd,
    W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, SILU: tl.constexpr, QUANT: tl.constexpr,
    BD: tl.constexpr, BL: tl.constexpr, INT8: tl.constexpr = False, INT8_BIAS: tl.constexpr = False,
    DEQ: tl.constexpr = False,
):
    pid_b, pid_d, pid_l = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_d = pid_d * BD + tl.arange(0, BD)
    offs_l = pid_l * BL + tl.arange(0, BL)
    mask_d = offs_d < d
    acc = tl.zeros((BD, BL), dtype=tl.float32)
    if HAS_BIAS and not INT8:
        acc += tl.load(bias_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)[:, None]
    for k in tl.static_range(W):
        # tap k sees input position t - (W-1) + k; negative positions come from the initial state
        pos = offs_l - (W - 1) + k
        wk = tl.load(w_ptr + offs_d * swd + k * sww, mask=mask_d, other=0.0).to(tl.float32)
        in_x = (pos >= 0) & (pos < l)
        xv = tl.load(x_ptr + pid_b * sxb + offs_d[:, None] * sxd + pos[None, :] * sxl,
                     mask=mask_d[:, None] & in_x[None, :], other=0.0).to(tl.float32)
        if HAS_INIT:
            in_s = (pos < 0) & (pos >= -(W - 1))
            sv = tl.load(init_ptr + pid_b * sib + offs_d[:, None] * sid + (pos[None, :] + (W - 1)) * siw,
                         mask=mask_d[:, None] & in_s[None, :], other=0.0).to(tl.float32)
            xv += sv
        if INT8:  # the input's codes (positions before the sequence start are 0 -> code 0)
            xv = quantize_rne(xv, tl.load(as_ptr).to(tl.float32)).to(tl.float32)
        acc += xv * wk[:, None]
    if INT8:
        scale, b = _int8_rescale(offs_d, mask_d, ws_ptr, swsd, as_ptr, bias_ptr, bs_ptr, HAS_BIAS, INT8_BIAS)
        acc = acc * scale[:, None] + b[:, None]
    if SILU:
        acc = silu(acc)
    if QUANT:
        acc = _quantize_out(acc, x_ptr, qs_ptr + offs_d[:, None] * sqd, mask_d[:, None])
        if DEQ:  # the codes' values in x's dtype: fake-quant taps' output without a pass (and a copy) of their own
            acc = acc.to(tl.float32) * tl.load(qs_ptr + offs_d * sqd, mask=mask_d, other=1.0).to(tl.float32)[:, None]
    tl.store(out_ptr + pid_b * sob + offs_d[:, None] * sod + offs_l[None, :] * sol,
             acc.to(out_ptr.dtype.element_ty), mask=mask_d[:, None] & (offs_l < l)[None, :])


def causal_conv1d(x, weight, bias=None, initial_states=None, return_final_states=False, activation=None, int8=None):
    """Causal depthwise conv, as ``causal_conv1d_ref``.

    x: (b, d, l); weight: (d, w); bias: (d,); initial_states: (b, d, w-1).
    Returns out (b, d, l) in x's dtype and, if asked, final_states (b, d, w-1).
    """
    return _conv1d(x, weight, bias, initial_states, return_final_states, _check_activation(activation), None, int8)


def conv1d_silu_quant(x, weight, bias, out_scale, initial_states=None, return_final_states=False, int8=None,
                      fake_quant=False):
    """Causal conv + SiLU + int8 quantization of the output, as ``conv1d_silu_quant_ref``.

    x: (b, d, l) float; weight: (d, w); bias: (d,); out_scale: (d, 1) per channel (``ActQuantizer.channel_scale``
    covers per-group scales) or () per tensor. Returns codes (b, d, l) int8 (``fake_quant``: their values, in x's
    dtype) and, if asked, the float conv state (b, d, w-1).
    """
    return _conv1d(x, weight, bias, initial_states, return_final_states, True,
                   _out_scale(out_scale, x.shape[1], (x.shape[1], 1)), int8, fake_quant)


def _out_scale(scale, d, per_channel_shape):
    """float32 per-channel scale (d,) (a view: stride 0 for one per-tensor scale)."""
    if scale is None or not (scale.dim() == 0 or tuple(scale.shape) == per_channel_shape):
        raise SSMQError(f"conv output scale must be () or {per_channel_shape}, got "
                        f"{None if scale is None else tuple(scale.shape)}")
    return scale.to(torch.float32).reshape(-1).expand(d)


def _int8_args(int8, weight) -> tuple[tuple, dict]:
    """(weight scale, act scale, bias scale pointers, weight scale stride) and the constexprs of an int8 conv."""
    if int8 is None:
        return (weight, weight, weight, 0), {}
    int8.check(weight)
    ws = int8.weight_scale.to(torch.float32).reshape(-1)
    bs = int8.bias_scale if int8.bias_scale is not None else ws
    return (ws, int8.act_scale, bs, 1 if ws.numel() > 1 else 0), {"INT8": True,
                                                                   "INT8_BIAS": int8.bias_scale is not None}


def _conv1d(x, weight, bias, initial_states, return_final_states, use_silu, qscale, int8=None, fake_quant=False):
    b, d, l = x.shape
    (ws, acts, bs, swsd), int8_kw = _int8_args(int8, weight)
    w = weight.shape[1]
    out = torch.empty((b, d, l), device=x.device, dtype=x.dtype if qscale is None or fake_quant else torch.int8)
    init = initial_states if initial_states is not None else x  # dummy pointer when absent
    BD, BL = 16, min(128, pow2(l, 16))
    grid = (b, cdiv(d, BD), cdiv(l, BL))
    _conv1d_fwd[grid](
        x, weight, bias if bias is not None else weight, init, out, qscale if qscale is not None else weight,
        ws, acts, bs, d, l,
        *x.stride(), *weight.stride(),
        *(init.stride() if initial_states is not None else (0, 0, 0)), *out.stride(),
        qscale.stride(0) if qscale is not None else 0, swsd,
        W=w, HAS_BIAS=bias is not None, HAS_INIT=initial_states is not None, SILU=use_silu, QUANT=qscale is not None,
        BD=BD, BL=BL, num_warps=4, DEQ=fake_quant and qscale is not None, **int8_kw,
    )
    if not return_final_states:
        return out
    # the last w-1 inputs: a copy of x's tail, topped up from the initial state when l < w-1
    if l >= w - 1:
        final = x[..., l - (w - 1):].to(x.dtype, copy=True)
    else:
        prev = initial_states.to(x.dtype) if initial_states is not None else x.new_zeros(b, d, w - 1)
        final = torch.cat([prev, x], dim=-1)[..., l:]
    return out, final


@triton.jit
def _conv1d_update(
    x_ptr, state_ptr, w_ptr, bias_ptr, idx_ptr, out_ptr, qs_ptr, deq_ptr, ws_ptr, as_ptr, bs_ptr,
    d,
    sxb, sxd, ssb, ssd, ssw, swd, sww, sob, sod, sqd, sdb, sdd, swsd,
    W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_IDX: tl.constexpr, SILU: tl.constexpr, QUANT: tl.constexpr,
    DEQ: tl.constexpr, BD: tl.constexpr, USE_GDC: tl.constexpr = False, INT8: tl.constexpr = False,
    INT8_BIAS: tl.constexpr = False,
):
    gdc_enter(USE_GDC)
    pid_b, pid_d = tl.program_id(0), tl.program_id(1)
    offs_d = pid_d * BD + tl.arange(0, BD)
    mask = offs_d < d
    if HAS_IDX:
        slot = tl.load(idx_ptr + pid_b).to(tl.int64)
    else:
        slot = pid_b.to(tl.int64)
    srow = state_ptr + slot * ssb + offs_d * ssd
    xv = tl.load(x_ptr + pid_b * sxb + offs_d * sxd, mask=mask, other=0.0).to(tl.float32)
    if INT8:  # the input's codes: the window's taps summed in the reference's order (oldest first), exactly
        a_s = tl.load(as_ptr).to(tl.float32)
        acc = tl.zeros((BD,), dtype=tl.float32)
    else:
        acc = xv * tl.load(w_ptr + offs_d * swd + (W - 1) * sww, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_d, mask=mask, other=0.0).to(tl.float32)
    # read every column before writing any: the shift overwrites what the next tap reads
    for k in tl.static_range(W - 1):
        sk = tl.load(srow + k * ssw, mask=mask, other=0.0)
        wk = tl.load(w_ptr + offs_d * swd + k * sww, mask=mask, other=0.0).to(tl.float32)
        if INT8:
            acc += quantize_rne(sk.to(tl.float32), a_s).to(tl.float32) * wk
        else:
            acc += sk.to(tl.float32) * wk
        if k > 0:
            tl.store(srow + (k - 1) * ssw, sk, mask=mask)
    tl.store(srow + (W - 2) * ssw, xv.to(state_ptr.dtype.element_ty), mask=mask)
    if INT8:
        acc += quantize_rne(xv, a_s).to(tl.float32) * \
            tl.load(w_ptr + offs_d * swd + (W - 1) * sww, mask=mask, other=0.0).to(tl.float32)
        scale, b = _int8_rescale(offs_d, mask, ws_ptr, swsd, as_ptr, bias_ptr, bs_ptr, HAS_BIAS, INT8_BIAS)
        acc = acc * scale + b
    if SILU:
        acc = silu(acc)
    if QUANT:
        acc = _quantize_out(acc, x_ptr, qs_ptr + offs_d * sqd, mask)
        if DEQ:  # the codes' values too, in x's dtype: what a fake-quant tap would output (Mamba-1's x_proj input)
            deq = acc.to(tl.float32) * tl.load(qs_ptr + offs_d * sqd, mask=mask, other=1.0).to(tl.float32)
            tl.store(deq_ptr + pid_b * sdb + offs_d * sdd, deq.to(deq_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + pid_b * sob + offs_d * sod, acc.to(out_ptr.dtype.element_ty), mask=mask)


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, conv_state_indices=None, int8=None):
    """One decode step, as ``causal_conv1d_update_ref``; updates ``conv_state`` in place.

    x: (b, d); conv_state: (s, d, w-1); conv_state_indices: (b,) slot per row. Returns (b, d).
    """
    return _conv1d_update_launch(x, conv_state, weight, bias, _check_activation(activation), conv_state_indices, None,
                                 int8=int8)


def conv1d_update_silu_quant(x, conv_state, weight, bias, out_scale, conv_state_indices=None, dequantized=False,
                             int8=None):
    """One decode step of conv + SiLU + int8 quantization, as ``conv1d_update_silu_quant_ref``; shifts
    ``conv_state`` in place. x: (b, d) float; out_scale: (d,) or (). Returns codes (b, d) int8 and, with
    ``dequantized``, their values (b, d) in x's dtype (written by the same kernel)."""
    return _conv1d_update_launch(x, conv_state, weight, bias, True, conv_state_indices,
                                 _out_scale(out_scale, x.shape[1], (x.shape[1],)), dequantized, int8)


def _conv1d_update_launch(x, conv_state, weight, bias, use_silu, conv_state_indices, qscale, dequantized=False,
                          int8=None):
    b, d = x.shape
    (ws, acts, bs, swsd), int8_kw = _int8_args(int8, weight)
    w = weight.shape[1]
    out = torch.empty((b, d), device=x.device, dtype=x.dtype if qscale is None else torch.int8)
    deq = torch.empty((b, d), device=x.device, dtype=x.dtype) if dequantized else None
    BD = min(256, pow2(d, 16))
    _conv1d_update[(b, cdiv(d, BD))](
        x, conv_state, weight, bias if bias is not None else weight,
        conv_state_indices if conv_state_indices is not None else x, out,
        qscale if qscale is not None else weight, deq if deq is not None else out, ws, acts, bs, d,
        *x.stride(), *conv_state.stride(), *weight.stride(), *out.stride(),
        qscale.stride(0) if qscale is not None else 0, *(deq.stride() if deq is not None else (0, 0)), swsd,
        W=w, HAS_BIAS=bias is not None, HAS_IDX=conv_state_indices is not None, SILU=use_silu,
        QUANT=qscale is not None, DEQ=deq is not None, BD=BD, num_warps=4, **int8_kw, **pdl_args(x),
    )
    return out if deq is None else (out, deq)
