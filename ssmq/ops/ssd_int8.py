"""SSDi8: the Mamba-2 SSD chunked scan with an integer path inside (after the SSDi8 paper), exact CPU reference.

Glossary as ``ssmq.ops.ssd_stages`` (b, l, c chunks, T, t / s, h, p, g, r = h / g, n, dt, Acs), plus
    *_q        int8 codes (torch.int8); accumulators are torch.int32, so "exact" is integer arithmetic
               (``int_einsum``: int8 in, int32 out; summed on float64 BLAS, where every partial sum is an integer
               below 2^53, so the integers are exact — the route ``int_matmul_ref`` takes on CUDA; torch's int32
               einsum has no BLAS and is 10-50x slower on CPU. A test checks both routes give the same integers)
    B_scale, C_scale  (g,)    early B / C quantization: one scale per group (N excluded), done ONCE per layer
                              and reused by chunk_state, chunk_bmm and chunk_scan_off (no re-quantization
                              after the G -> H broadcast: the integer stages index groups directly)
    xs_scale   (h, p)         scale of X_scaled = LUT_state ⊙ X, LUT_state[s] = exp(Acs_end - Acs_s)·Δ_s
    state_scale (h, p)        the persistent int8 state, shared by every chunk (and by the decode cache)
    x_scale    (h, p)         plain X quantization: only for the "no reformulation" ablation
    S = 2^7                   fixed-point scale of the chunk decay in state passing (division = shift)

Stages and their integer contracts (each has a float twin in ``ssd_stages``; tests bound the difference):
    chunk_state_int8     Xs_q = Q(LUT_state ⊙ X / xs_scale); acc = Σ_s Xs_q · B_q            int32 (b,c,h,p,n)
    requantize_state     state_q = Q(float32(acc) · (xs_scale·B_scale / state_scale))       int8
    state_passing_int8   decay_q = round(exp(Acs_end)·S) in [0, S];
                         s_{c+1} = clamp(((decay_q·s_c + S/2) >> 7) + chunk_q_c, -128, 127)  int8
    chunk_bmm_int8       CB = Σ_n C_q · B_q on the G axis                                      int32 (b,c,t,s,g)
    chunk_scan_off_int8  acc = Σ_n C_q · state_q;  y = float32(acc) · LUT_off · state_scale,
                         LUT_off[t, h] = exp(Acs_t)·C_scale[g(h)]
    chunk_scan_diag      y = Σ_{s<=t} (float32(CB)·LUT_diag) X_s, LUT_diag = C_scale·B_scale·L[t,s]·Δ_s:
                         X and Acs stay float (FP16 on the GPU), as in the paper
Q(v) is ``ssmq.quant.primitives.quantize`` (symmetric int8, round half to even, clamp [-128, 127]).
The int32 sums cannot overflow: T·127·128 (T <= 2^17) and n·127·128 (n <= 2^17).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from ssmq.ops.layout import heads_per_group
from ssmq.ops.quant_ssm import dequantize_ref, quantize_ref
from ssmq.ops.ssd import _skip_and_gate
from ssmq.ops.ssd_stages import (causal_decay, chunk_bmm, chunk_cumsum, chunk_scan_off, chunk_state,
                                 chunk_tokens, heads_of_groups, state_passing)

DECAY_BITS = 7  # S = 2^7


@dataclass(frozen=True)
class SSDi8Options:
    """Which integer components run (all True = SSDi8; the others are the ablation rows).

    reformulate   chunk_state on Q(LUT_state ⊙ X) × Q(B) in int32; False: X quantized plainly (x_scale)
                  and chunk_state in float on the dequantized codes (int8 inputs, float inside, as Quamba2)
    int8_state    chunk states and passed states stored int8 (state_scale); False: float32 states
    int8_passing  state passing in fixed point (needs int8_state); False: dequantize, decay in float, requantize
    """

    reformulate: bool = True
    int8_state: bool = True
    int8_passing: bool = True

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def int_einsum(eq: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Exact integer contraction of two int8 tensors -> int32 (the sums stay below 2^31: see the module notes)."""
    return torch.einsum(eq, a.to(torch.float64), b.to(torch.float64)).to(torch.int32)


def _by_group(t: torch.Tensor, g: int) -> torch.Tensor:
    """(..., h, p) -> (..., g, r, p): heads split into their B/C groups."""
    return t.reshape(*t.shape[:-2], g, t.shape[-2] // g, t.shape[-1])


def _group_scale_per_head(scale: torch.Tensor, h: int) -> torch.Tensor:
    """(g,) -> (h,)."""
    return scale.float().repeat_interleave(heads_per_group(h, scale.numel()))


# ---------------------------------------------------------------------------------------------- stages
def state_lut(dtc: torch.Tensor, Acs: torch.Tensor) -> torch.Tensor:
    """LUT_state = exp(Acs_end - Acs_s)·Δ_s: (b, c, T, h)."""
    return torch.exp(Acs[:, :, -1:] - Acs) * dtc


def chunk_state_int8(xs_q: torch.Tensor, B_q: torch.Tensor) -> torch.Tensor:
    """xs_q: (b, c, T, h, p) int8 (the quantized X_scaled); B_q: (b, c, T, g, n) int8 -> int32 (b, c, h, p, n)."""
    g = B_q.shape[3]
    acc = int_einsum("bcsgrp,bcsgn->bcgrpn", _by_group(xs_q, g), B_q)
    return acc.flatten(2, 3)


def requantize_state(acc: torch.Tensor, mult: torch.Tensor) -> torch.Tensor:
    """int32 (b, c, h, p, n) -> int8 Q(float32(acc)·mult[h, p]); mult = xs_scale·B_scale / state_scale."""
    return quantize_ref(acc.float() * mult.float()[..., None], torch.ones(()))


def decay_fixed_point(Acs: torch.Tensor) -> torch.Tensor:
    """Chunk decay exp(Acs_end) (b, c, h) in fixed point: int32 in [0, 2^7]."""
    return torch.round(torch.exp(Acs[:, :, -1]) * (1 << DECAY_BITS)).to(torch.int32)


def state_passing_int8(chunk_q: torch.Tensor, decay_q: torch.Tensor, initial_q: torch.Tensor | None = None):
    """chunk_q: (b, c, h, p, n) int8; decay_q: (b, c, h) int32 -> (entering (b, c, h, p, n) int8, final int8).

    s <- clamp(((decay_q·s + 2^6) >> 7) + chunk_q): integer only (round half up by the added 2^6).
    """
    b, nc, h, p, n = chunk_q.shape
    state = (torch.zeros(b, h, p, n, dtype=torch.int32, device=chunk_q.device) if initial_q is None
             else initial_q.to(torch.int32))
    half = 1 << (DECAY_BITS - 1)
    entering = []
    for c in range(nc):
        entering.append(state.to(torch.int8))
        decayed = torch.bitwise_right_shift(decay_q[:, c, :, None, None] * state + half, DECAY_BITS)
        state = (decayed + chunk_q[:, c].to(torch.int32)).clamp(-128, 127)
    return torch.stack(entering, dim=1), state.to(torch.int8)


def chunk_bmm_int8(C_q: torch.Tensor, B_q: torch.Tensor) -> torch.Tensor:
    """C_q, B_q: (b, c, T, g, n) int8 -> C_t·B_s int32 (b, c, t, s, g), on the G axis (no broadcast)."""
    return int_einsum("bctgn,bcsgn->bctsg", C_q, B_q)


def off_lut(Acs: torch.Tensor, C_scale: torch.Tensor) -> torch.Tensor:
    """LUT_off[t, h] = exp(Acs_t)·C_scale[g(h)]: (b, c, T, h)."""
    return torch.exp(Acs) * _group_scale_per_head(C_scale, Acs.shape[-1])


def chunk_scan_off_int8(C_q, entering_q, lut, state_scale):
    """C_q: (b, c, T, g, n) int8; entering_q: (b, c, h, p, n) int8; lut: (b, c, T, h) -> y_off (b, c, T, h, p) f32.

    int32 acc = Σ_n C_q·state_q, then float32(acc)·LUT_off[t, h]·state_scale[h, p] (in this order).
    """
    b, nc, h, p, n = entering_q.shape
    g = C_q.shape[3]
    acc = int_einsum("bctgn,bcgrpn->bctgrp", C_q, entering_q.reshape(b, nc, g, h // g, p, n))
    return acc.flatten(3, 4).float() * lut[..., None] * state_scale.float()


def chunk_scan_diag_int8(CB, x, dtc, Acs, C_scale, B_scale):
    """CB: (b, c, t, s, g) int32; x: (b, c, T, h, p) float -> y_diag (b, c, T, h, p) float32.

    The scales, the causal decay and Δ_s fold into one float LUT (b, c, t, s, h); X stays float.
    """
    h = x.shape[3]
    cb = CB.float().repeat_interleave(h // CB.shape[-1], dim=-1)  # exact: integers below 2^24 (n·127·128 < 2^21)
    lut = causal_decay(Acs) * dtc[:, :, None] * _group_scale_per_head(C_scale.float() * B_scale.float(), h)
    return torch.einsum("bctsh,bcshp->bcthp", cb * lut, x.float())


def chunk_state_q(xs_q: torch.Tensor, B_q: torch.Tensor, mult: torch.Tensor) -> torch.Tensor:
    """chunk_state_int8 with the requantization fused: int8 chunk states Q(float32(acc)·mult[h, p]) (b, c, h, p, n)."""
    return requantize_state(chunk_state_int8(xs_q, B_q), mult)


@dataclass(frozen=True)
class IntStages:
    """The integer stages, as a set: the references here, the Triton kernels in ``ssmq.kernels.ssdi8``."""

    chunk_state_q: Callable  # (xs_q, B_q, mult (h, p)) -> int8 (b, c, h, p, n)
    state_passing: Callable  # (chunk_q, decay_q, initial_q) -> (entering int8, final int8)
    chunk_bmm: Callable  # (C_q, B_q) -> int32 (b, c, t, s, g)
    chunk_scan_off: Callable  # (C_q, entering_q, lut (b, c, T, h), state_scale (h, p)) -> float32 (b, c, T, h, p)


# ---------------------------------------------------------------------------------------------- the scan
def ssd_int8_ref(*args, **kwargs):
    """SSDi8 prefill on the reference integer stages; arguments as ``run_ssd_int8`` after ``stages``."""
    return run_ssd_int8(REF_STAGES, *args, **kwargs)


def run_ssd_int8(stages: IntStages, x, dt, A, B_q, B_scale, C_q, C_scale, xs_scale, state_scale, chunk_size, D=None, z=None,
                 dt_bias=None, dt_softplus=False, dt_limit=(0.0, math.inf), initial_states=None,
                 return_final_states=False, x_scale=None, options: SSDi8Options = SSDi8Options()):
    """SSDi8 prefill: x (b, l, h, p) float; dt (b, l, h); A (h,); B_q, C_q (b, l, g, n) int8 with scales (g,);
    xs_scale, state_scale, x_scale (h, p); D (h,); z (b, l, h, p); initial_states (b, h, p, n): int8 codes at
    state_scale (or float when ``options.int8_state`` is off).

    Returns y (b, l, h, p) float32 and, if asked, the final state: int8 codes (b, h, p, n) at state_scale
    (float32 when ``int8_state`` is off). Stage by stage each integer result is within its rounding bound of
    the float stage on the dequantized codes (tests state the bounds).
    """
    b, l, h, p = x.shape
    heads_per_group(h, B_q.shape[2])
    if options.int8_passing and not options.int8_state:
        raise ValueError("int8 state passing needs the int8 state")
    T = chunk_size
    dtc, Acs = chunk_cumsum(dt, A, T, dt_bias, dt_softplus, dt_limit)
    xc = chunk_tokens(x.float(), T)  # (b, c, T, h, p)
    Bc, Cc = chunk_tokens(B_q, T), chunk_tokens(C_q, T)  # int8 (b, c, T, g, n), zero padded
    s_state = state_scale.float()

    # ChunkState
    if options.reformulate:
        xs_q = quantize_ref(xc * state_lut(dtc, Acs)[..., None], xs_scale.float())
        acc_scale = xs_scale.float() * _group_scale_per_head(B_scale, h)[:, None]  # (h, p)
        if options.int8_state:
            chunk_states = stages.chunk_state_q(xs_q, Bc, acc_scale / s_state)
        else:
            chunk_states = chunk_state_int8(xs_q, Bc).float() * acc_scale[..., None]
    else:
        xq = dequantize_ref(quantize_ref(xc, x_scale.float()), x_scale.float())
        Bh = heads_of_groups(dequantize_ref(Bc, B_scale.float()[:, None]), h)
        chunk_states = chunk_state(Bh, xq * dtc[..., None], Acs)
        if options.int8_state:
            chunk_states = quantize_ref(chunk_states, s_state[..., None])

    # StatePassing
    if not options.int8_state:
        entering, final = state_passing(chunk_states, Acs, initial_states)
    elif options.int8_passing:
        entering, final = stages.state_passing(chunk_states, decay_fixed_point(Acs), initial_states)
    else:
        entering, final = _state_passing_requantized(chunk_states, Acs, s_state, initial_states)

    # ChunkScan1 (off-diagonal) and ChunkScan2 (diagonal)
    if options.int8_state:
        y = stages.chunk_scan_off(Cc, entering, off_lut(Acs, C_scale), s_state)
    else:
        Ch = heads_of_groups(dequantize_ref(Cc, C_scale.float()[:, None]), h)
        y = chunk_scan_off(Ch, entering, Acs)
    y = chunk_scan_diag_int8(stages.chunk_bmm(Cc, Bc), xc, dtc, Acs, C_scale, B_scale) + y
    y = _skip_and_gate(y.reshape(b, -1, h, p)[:, :l], x, D, z)
    return (y, final) if return_final_states else y


REF_STAGES = IntStages(chunk_state_q, state_passing_int8, chunk_bmm_int8, chunk_scan_off_int8)


def _state_passing_requantized(chunk_q, Acs, state_scale, initial_q=None):
    """Ablation: int8 states, but each step dequantized, decayed in float32 and re-quantized."""
    s = state_scale[..., None]
    state = None if initial_q is None else dequantize_ref(initial_q, s)
    b, nc, h, p, n = chunk_q.shape
    state = torch.zeros(b, h, p, n, device=chunk_q.device) if state is None else state
    decay = torch.exp(Acs[:, :, -1])
    entering = []
    for c in range(nc):
        q = quantize_ref(state, s)
        entering.append(q)
        state = decay[:, c, :, None, None] * dequantize_ref(q, s) + dequantize_ref(chunk_q[:, c], s)
    return torch.stack(entering, 1), quantize_ref(state, s)


# ---------------------------------------------------------------------------------------------- calibration
@torch.no_grad()
def ssd_int8_ranges(x, dt, A, B, C, chunk_size, dt_bias=None, dt_softplus=False, dt_limit=(0.0, math.inf),
                    initial_states=None) -> dict[str, torch.Tensor]:
    """Absolute maxima the static scales are set from, on the float stages:
    {"B": (g,), "C": (g,), "x": (h, p), "xs": (h, p) of LUT_state ⊙ X, "state": (h, p) over every chunk state,
    entering state and the final state}."""
    h = x.shape[2]
    T = chunk_size
    dtc, Acs = chunk_cumsum(dt, A, T, dt_bias, dt_softplus, dt_limit)
    xc = chunk_tokens(x.float(), T)
    chunk_states = chunk_state(heads_of_groups(chunk_tokens(B.float(), T), h), xc * dtc[..., None], Acs)
    entering, final = state_passing(chunk_states, Acs, initial_states)
    amax = lambda t, keep: t.abs().reshape(-1, *t.shape[-keep:]).amax(0)  # noqa: E731
    state = torch.maximum(torch.maximum(amax(chunk_states, 3), amax(entering, 3)), amax(final, 3)).amax(-1)
    return {"B": amax(B.float(), 2).amax(-1), "C": amax(C.float(), 2).amax(-1), "x": amax(x.float(), 2),
            "xs": amax(xc * state_lut(dtc, Acs)[..., None], 2), "state": state}
