"""Triton depthwise causal conv1d: prefill over a sequence and the one-token decode update.

Same signatures and cache convention as ``ssmq.ops.conv1d``: conv_state is the
last w-1 inputs of a sequence, oldest first. SiLU is fused into the epilogue.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ssmq.kernels._common import pow2, silu


def _check_activation(activation):
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported conv1d activation {activation!r} (use 'silu' or None)")
    return activation is not None


@triton.jit
def _conv1d_fwd(
    x_ptr, w_ptr, bias_ptr, init_ptr, out_ptr,
    d, l,
    sxb, sxd, sxl, swd, sww, sib, sid, siw, sob, sod, sol,
    W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, SILU: tl.constexpr,
    BD: tl.constexpr, BL: tl.constexpr,
):
    pid_b, pid_d, pid_l = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_d = pid_d * BD + tl.arange(0, BD)
    offs_l = pid_l * BL + tl.arange(0, BL)
    mask_d = offs_d < d
    acc = tl.zeros((BD, BL), dtype=tl.float32)
    if HAS_BIAS:
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
        acc += xv * wk[:, None]
    if SILU:
        acc = silu(acc)
    tl.store(out_ptr + pid_b * sob + offs_d[:, None] * sod + offs_l[None, :] * sol,
             acc.to(out_ptr.dtype.element_ty), mask=mask_d[:, None] & (offs_l < l)[None, :])


def causal_conv1d(x, weight, bias=None, initial_states=None, return_final_states=False, activation=None):
    """Causal depthwise conv, as ``causal_conv1d_ref``.

    x: (b, d, l); weight: (d, w); bias: (d,); initial_states: (b, d, w-1).
    Returns out (b, d, l) in x's dtype and, if asked, final_states (b, d, w-1).
    """
    use_silu = _check_activation(activation)
    b, d, l = x.shape
    w = weight.shape[1]
    out = torch.empty((b, d, l), device=x.device, dtype=x.dtype)
    init = initial_states if initial_states is not None else x  # dummy pointer when absent
    BD, BL = 16, min(128, pow2(l, 16))
    grid = (b, triton.cdiv(d, BD), triton.cdiv(l, BL))
    _conv1d_fwd[grid](
        x, weight, bias if bias is not None else weight, init, out, d, l,
        *x.stride(), *weight.stride(),
        *(init.stride() if initial_states is not None else (0, 0, 0)), *out.stride(),
        W=w, HAS_BIAS=bias is not None, HAS_INIT=initial_states is not None, SILU=use_silu,
        BD=BD, BL=BL, num_warps=4,
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
    x_ptr, state_ptr, w_ptr, bias_ptr, idx_ptr, out_ptr,
    d,
    sxb, sxd, ssb, ssd, ssw, swd, sww, sob, sod,
    W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_IDX: tl.constexpr, SILU: tl.constexpr,
    BD: tl.constexpr,
):
    pid_b, pid_d = tl.program_id(0), tl.program_id(1)
    offs_d = pid_d * BD + tl.arange(0, BD)
    mask = offs_d < d
    if HAS_IDX:
        slot = tl.load(idx_ptr + pid_b).to(tl.int64)
    else:
        slot = pid_b.to(tl.int64)
    srow = state_ptr + slot * ssb + offs_d * ssd
    xv = tl.load(x_ptr + pid_b * sxb + offs_d * sxd, mask=mask, other=0.0).to(tl.float32)
    acc = xv * tl.load(w_ptr + offs_d * swd + (W - 1) * sww, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_d, mask=mask, other=0.0).to(tl.float32)
    # read every column before writing any: the shift overwrites what the next tap reads
    for k in tl.static_range(W - 1):
        sk = tl.load(srow + k * ssw, mask=mask, other=0.0)
        acc += sk.to(tl.float32) * tl.load(w_ptr + offs_d * swd + k * sww, mask=mask, other=0.0).to(tl.float32)
        if k > 0:
            tl.store(srow + (k - 1) * ssw, sk, mask=mask)
    tl.store(srow + (W - 2) * ssw, xv.to(state_ptr.dtype.element_ty), mask=mask)
    if SILU:
        acc = silu(acc)
    tl.store(out_ptr + pid_b * sob + offs_d * sod, acc.to(out_ptr.dtype.element_ty), mask=mask)


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, conv_state_indices=None):
    """One decode step, as ``causal_conv1d_update_ref``; updates ``conv_state`` in place.

    x: (b, d); conv_state: (s, d, w-1); conv_state_indices: (b,) slot per row. Returns (b, d).
    """
    use_silu = _check_activation(activation)
    b, d = x.shape
    w = weight.shape[1]
    out = torch.empty((b, d), device=x.device, dtype=x.dtype)
    BD = min(256, pow2(d, 16))
    _conv1d_update[(b, triton.cdiv(d, BD))](
        x, conv_state, weight, bias if bias is not None else weight,
        conv_state_indices if conv_state_indices is not None else x, out, d,
        *x.stride(), *conv_state.stride(), *weight.stride(), *out.stride(),
        W=w, HAS_BIAS=bias is not None, HAS_IDX=conv_state_indices is not None, SILU=use_silu,
        BD=BD, num_warps=4,
    )
    return out
