"""Quantized SSM references (CPU, float32): int8 codes + scales in, float out — the contracts of the
Quamba / Quamba2 kernels. Each equals "dequantize, then the float reference" (tests check it); the
scales are folded where a kernel would fold them, so the equality is a real check.

Glossary (as ``ssmq.ops``): b batch, l length, d channels (d_inner), n d_state, h heads, p headdim,
g ngroups (B/C groups), k state groups per B/C group (k | n), T chunk size, s cache slots,
G scale groups of x (1 per-tensor; m·n with sort-and-cluster).

Scale convention: every code tensor ``*_q`` (int8) comes with a float32 ``*_scale`` that broadcasts
against its non-batch dims, e.g. u_q (b, d, l) with u_scale (d, 1) or (); the value is q · scale.
Quantization is symmetric int8 as ``ssmq.quant.primitives.quantize`` does it (round half to even, clamp
[-128, 127]; ops sit below quant, so it is written out here). The SSM state (…, d, n) is quantized either with a
static table, per (x group of its channel, state index): scale table (G, n), channel → group map ``index`` (d,) —
d_state × m × n scales (Quamba2), or with dynamic row scales (``RowScales``): one float32 per (slot, channel) row,
the row's absmax / 127 over n, recomputed at every write (no calibration, no clipping).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ssmq.ops.conv1d import causal_conv1d_ref, causal_conv1d_update_ref
from ssmq.ops.layout import discretize_dt, heads_per_group
from ssmq.ops.norm import rms_norm_ref
# the int8 rounding of the taps lives with the activation quantization of ops.quant_linear (ops.norm uses it too)
from ssmq.ops.quant_linear import dequantize_ref, fake_quantize_ref, quantize_ref  # noqa: F401
from ssmq.ops.state_update import selective_state_update_ref




# ---------------------------------------------------------------------------------------------
# fused producers of int8 activations
# ---------------------------------------------------------------------------------------------
def conv1d_silu_quant_ref(x, weight, bias, out_scale, initial_states=None, return_final_states=False, int8=None,
                          fake_quant=False):
    """Causal depthwise conv + SiLU + output quantization (one kernel in Quamba).

    x: (b, d, l) float; weight: (d, w); bias: (d,); out_scale: (d, 1) or ().
    Returns codes (b, d, l) int8 (``fake_quant``: their values in x's dtype, what fake-quant taps on the output would
    make of it) and, if asked, the float conv state (b, d, w-1). int8: an integer conv (``ssmq.ops.conv1d.ConvInt8``:
    weight and bias are codes).
    """
    out = causal_conv1d_ref(x, weight, bias, initial_states, return_final_states, activation="silu", int8=int8)
    y, final = out if return_final_states else (out, None)
    q = quantize_ref(y.float(), out_scale)
    if fake_quant:
        q = dequantize_ref(q, out_scale).to(x.dtype)
    return (q, final) if return_final_states else q


def conv1d_update_silu_quant_ref(x, conv_state, weight, bias, out_scale, conv_state_indices=None, dequantized=False,
                                 int8=None):
    """One decode step of ``conv1d_silu_quant_ref``: shifts ``conv_state`` (in place, float, the inputs) and
    returns the int8 codes of silu(conv) — what the taps of x, B, C would make of the float output.

    x: (b, d) float; conv_state: (s, d, w-1); weight: (d, w); bias: (d,); out_scale: (d,) or ();
    conv_state_indices: (b,) slot per row. Returns codes (b, d) int8 and, with ``dequantized``, their values
    (b, d) in x's dtype (a fake-quant tap's output). int8: an integer conv (``ssmq.ops.conv1d.ConvInt8``).
    """
    y = causal_conv1d_update_ref(x, conv_state, weight, bias, "silu", conv_state_indices, int8)
    q = quantize_ref(y.float(), out_scale)
    return (q, dequantize_ref(q, out_scale).to(x.dtype)) if dequantized else q


def rms_norm_quant_ref(x, weight, eps, residual, residual_in_fp32, out_scale):
    """Residual add + RMSNorm + per-tensor quantization of the output (the in_proj input).

    x, residual: (..., d_model); out_scale: (). Returns (codes int8 (..., d_model), new residual).
    """
    out, res = rms_norm_ref(x, weight.float(), eps, residual, residual_in_fp32)
    return quantize_ref(out, out_scale), res


# ---------------------------------------------------------------------------------------------
# Mamba-1: quantized selective scan
# ---------------------------------------------------------------------------------------------
def quant_selective_scan_ref(u_q, u_scale, dt_q, dt_scale, A, B_q, B_scale, C_q, C_scale, D=None,
                             z_q=None, z_scale=None, delta_bias=None, delta_softplus=True,
                             initial_state=None, return_last_state=False, out_dtype=None):
    """Selective scan on int8 u, Δ, B, C, z (Quamba): float32 recurrence, y float32 (or cast to ``out_dtype``).

    u_q, dt_q, z_q: (b, d, l) int8 with scales (d, 1) or (); B_q, C_q: (b, n, l) int8 with scales
    (n, 1) or (); A: (d, n); D, delta_bias: (d,); initial_state: (b, d, n). Δ and z may be float with
    scale None (a 16-bit tap), used as they are.
    Returns y (b, d, l) float32 and, if asked, the last state (b, d, n) float32.
    Scale folding as a kernel does it: Δ·u·B uses the product s_u·s_B once per (d, n), and C's
    scale multiplies C's codes inside the state contraction.
    """
    b, d, l = u_q.shape
    n = A.shape[1]
    s_u = u_scale.float().reshape(-1, 1) if u_scale.dim() else u_scale.float().reshape(1, 1)  # (d|1, 1)
    s_B = B_scale.float().reshape(1, -1) if B_scale.dim() else B_scale.float().reshape(1, 1)  # (1, n|1)
    s_C = C_scale.float().reshape(-1) if C_scale.dim() else C_scale.float().reshape(1)
    delta = discretize_dt(_maybe_dequantize(dt_q.float(), dt_scale), None if delta_bias is None else delta_bias[:, None],
                          delta_softplus)
    su_sB = s_u * s_B  # (d|1, n|1): one scale product per (channel, state)
    u_codes, B_codes, C_codes = u_q.float(), B_q.float(), C_q.float()
    h = torch.zeros(b, d, n) if initial_state is None else initial_state.float().clone()
    ys = []
    for t in range(l):
        dA = torch.exp(delta[:, :, t, None] * A.float())  # (b, d, n)
        h = dA * h + (delta[:, :, t] * u_codes[:, :, t])[:, :, None] * B_codes[:, None, :, t] * su_sB
        ys.append((h * (C_codes[:, :, t] * s_C)[:, None, :]).sum(-1))
    y = torch.stack(ys, -1) if l else torch.zeros(b, d, 0)
    u = u_codes * s_u
    if D is not None:
        y = y + u * D.float()[:, None]
    if z_q is not None:
        y = y * F.silu(_maybe_dequantize(z_q.float(), z_scale))
    y = y if out_dtype is None else y.to(out_dtype)
    return (y, h) if return_last_state else y


# ---------------------------------------------------------------------------------------------
# Mamba-2: quantized SSD (int8 x, B, C; Δ float)
# ---------------------------------------------------------------------------------------------
def _int_dot_per_state_group(Cq, Bq, k):
    """Cq (b, c, T, g, n), Bq (b, c, T, g, n) int8 -> (b, c, t, s, g, k) exact integer C_t·B_s per state group."""
    b, c, T, g, n = Cq.shape
    Cg = Cq.reshape(b, c, T, g, k, n // k).to(torch.int32)
    Bg = Bq.reshape(b, c, T, g, k, n // k).to(torch.int32)
    # int32 sums of at most n products of |127·128|: exact; einsum on int32 runs on CPU
    return torch.einsum("bctgkj,bcsgkj->bctsgk", Cg, Bg)


def quant_ssd_ref(x_q, x_scale, dt, A, B_q, B_scale, C_q, C_scale, chunk_size, D=None, dt_bias=None,
                  dt_softplus=True, dt_limit=(0.0, math.inf), initial_states=None, return_final_states=False,
                  out_dtype=None):
    """Chunked SSD on int8 x, B, C (Quamba2): C·Bᵀ inside a chunk is an exact int32 dot product per state
    group, scaled by s_C·s_B; the rest in float32.

    x_q: (b, l, h, p) int8, x_scale: (h, p) or (); dt: (b, l, h) float; A: (h,);
    B_q, C_q: (b, l, g, n) int8 with scales (g, k) (k state groups, k | n); D: (h,);
    initial_states: (b, h, p, n). Returns y (b, l, h, p) float32, or cast to ``out_dtype`` as a kernel writes it
    (+ final states (b, h, p, n) float32).
    """
    b, l, h, p = x_q.shape
    g, n = B_q.shape[2], B_q.shape[3]
    k = B_scale.shape[-1]
    T = chunk_size
    dtf = discretize_dt(dt, dt_bias, dt_softplus, dt_limit)  # (b, l, h)
    x = dequantize_ref(x_q, x_scale)
    Bf = (B_q.float().reshape(b, l, g, k, n // k) * B_scale.float()[..., None]).reshape(b, l, g, n)
    Cf = (C_q.float().reshape(b, l, g, k, n // k) * C_scale.float()[..., None]).reshape(b, l, g, n)
    pad = (-l) % T
    nc = (l + pad) // T
    xdt = F.pad(x * dtf[..., None], (0, 0, 0, 0, 0, pad)).reshape(b, nc, T, h, p)
    Acs = F.pad(dtf * A.float(), (0, 0, 0, pad)).reshape(b, nc, T, h).cumsum(2)
    padq = lambda t: F.pad(t, (0, 0, 0, 0, 0, pad)).reshape(b, nc, T, g, n)  # noqa: E731
    rep = heads_per_group(h, g)

    # 1. intra-chunk "attention": (C_t·B_s) exp(Acs_t - Acs_s), C·B from integer codes
    cb_int = _int_dot_per_state_group(padq(C_q), padq(B_q), k)  # (b, c, t, s, g, k)
    cb = (cb_int.float() * (C_scale.float() * B_scale.float())).sum(-1).repeat_interleave(rep, -1)  # (b,c,t,s,h)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    L = torch.exp((Acs[:, :, :, None] - Acs[:, :, None, :]).masked_fill(~causal[:, :, None], -math.inf))
    y = torch.einsum("bctsh,bcshp->bcthp", cb * L, xdt)

    # 2-3. chunk states and their carry across chunks (float: a kernel keeps states in float32)
    Bh = padq(Bf).repeat_interleave(rep, 3)
    Ch = padq(Cf).repeat_interleave(rep, 3)
    chunk_states = torch.einsum("bcshn,bcsh,bcshp->bchpn", Bh, torch.exp(Acs[:, :, -1:] - Acs), xdt)
    state = torch.zeros(b, h, p, n) if initial_states is None else initial_states.float()
    entering = []
    for c in range(nc):
        entering.append(state)
        state = torch.exp(Acs[:, c, -1])[:, :, None, None] * state + chunk_states[:, c]
    # 4. output of the state entering each chunk
    y = y + torch.einsum("bcthn,bchpn,bcth->bcthp", Ch, torch.stack(entering, 1), torch.exp(Acs))
    y = y.reshape(b, nc * T, h, p)[:, :l]
    if D is not None:
        y = y + x * D.float()[:, None]
    y = y if out_dtype is None else y.to(out_dtype)
    return (y, state) if return_final_states else y


# ---------------------------------------------------------------------------------------------
# int8 SSM state (decode cache)
# ---------------------------------------------------------------------------------------------
def _state_scale(scale: torch.Tensor, index: torch.Tensor | None, shape) -> torch.Tensor:
    """Scale table (G, n) + channel map (d,) -> scales broadcastable to a state (..., d, n) or (..., h, p, n)."""
    per_channel = scale if index is None else scale[index]  # (d|1, n)
    if len(shape) >= 3 and per_channel.shape[0] > 1 and per_channel.shape[0] != shape[-2]:
        per_channel = per_channel.reshape(shape[-3], shape[-2], shape[-1])  # multi-head layout (h, p, n)
    return per_channel


def quantize_state_ref(state: torch.Tensor, scale: torch.Tensor, index: torch.Tensor | None = None):
    """state (..., d, n) | (..., h, p, n) float -> int8 codes; scale (G, n), index (d,) (None: G = 1)."""
    return quantize_ref(state.float(), _state_scale(scale, index, state.shape))


def dequantize_state_ref(q: torch.Tensor, scale: torch.Tensor, index: torch.Tensor | None = None):
    return dequantize_ref(q, _state_scale(scale, index, q.shape))


@dataclass(frozen=True)
class RowScales:
    """Dynamic scales of an int8 state: ``scale`` (s, d) | (s, h, p) float32, one per (slot, channel) row of the
    state (s, d, n) | (s, h, p, n), the row's absmax / 127 over n, rewritten with the codes at every write. Given
    where a static (G, n) table goes (``state_scale``, ``state_index`` None)."""

    scale: torch.Tensor


def quantize_state_rows_ref(state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """state (..., n) float -> int8 codes (..., n) and row scales (...,) float32: scale = amax / 127, codes =
    rne(state · (127 / amax)) (|codes| <= 127; a zero row: scale 0, codes 0). A kernel computes the same: the
    reciprocal once a row, a multiply and a rounding a value."""
    state = state.float()
    amax = state.abs().amax(-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return torch.round(state * inv[..., None]).clamp(-127, 127).to(torch.int8), amax / 127.0


def dequantize_state_rows_ref(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 codes (..., n) and row scales (...,) -> float32 (..., n)."""
    return q.float() * scale.float()[..., None]


def read_state_ref(state, state_scale, state_index, idx) -> torch.Tensor:
    """The rows ``idx`` of a stored SSM state as float32: float as is, int8 codes dequantized with the (G, n) table
    (+ index) or with their ``RowScales``."""
    rows = state[idx]
    if state_scale is None:
        return rows.float()
    if isinstance(state_scale, RowScales):
        return dequantize_state_rows_ref(rows, state_scale.scale[idx])
    return dequantize_state_ref(rows, state_scale, state_index).float()


def write_state_ref(state, state_scale, state_index, idx, values) -> None:
    """Store float ``values`` in the rows ``idx`` of a stored SSM state, in its format (row scales rewritten)."""
    if state_scale is None:
        state[idx] = values.to(state.dtype)
    elif isinstance(state_scale, RowScales):
        state[idx], state_scale.scale[idx] = quantize_state_rows_ref(values)
    else:
        state[idx] = quantize_state_ref(values, state_scale, state_index)


def quant_state_update_ref(state_q, state_scale, state_index, x_q, x_scale, dt, A, B_q, B_scale, C_q, C_scale,
                           D=None, z=None, dt_bias=None, dt_softplus=True, state_batch_indices=None, out_dtype=None):
    """One decode step that reads and writes an int8 state (Quamba2's 8-bit cache).

    state_q: (s, d, n) | (s, h, p, n) int8, updated in place; state_scale (G, n) with state_index (d,), or
    ``RowScales`` (updated in place too).
    x_q: (b, d) | (b, h, p) int8, x_scale broadcastable; B_q, C_q: (b, n) | (b, g, n) int8 with
    scales; dt, z float, other arguments as ``selective_state_update_ref``. Returns y float32.
    The state is dequantized, advanced in float32, and re-quantized before it is written.

    Either side may be float: ``state_scale`` None is a float state (any dtype, stored back in it), a scale
    None a float input used as it is (then y has x's dtype) — every mix of taps and cache one decode kernel runs.
    ``out_dtype`` (e.g. the model's fp16) casts y, as a kernel writes it.
    """
    idx = torch.arange(x_q.shape[0]) if state_batch_indices is None else state_batch_indices.long()
    work = read_state_ref(state_q, state_scale, state_index, idx)
    y = selective_state_update_ref(work, _maybe_dequantize(x_q, x_scale), dt, A, _maybe_dequantize(B_q, B_scale),
                                   _maybe_dequantize(C_q, C_scale), D, z, dt_bias, dt_softplus)
    write_state_ref(state_q, state_scale, state_index, idx, work)
    return y if out_dtype is None else y.to(out_dtype)


def _maybe_dequantize(t, scale):
    return t if scale is None else dequantize_ref(t, scale)
