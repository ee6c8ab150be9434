"""The Mamba-2 SSD chunked scan as the six stages of its kernels (float reference).

Glossary (shapes in every docstring of this module and of ``ssd_int8``):
    b batch   l length   c chunks (ceil(l / T))   T chunk size   t, s target / source token inside a chunk
    h heads   p headdim   g ngroups (B/C groups)   r = h / g heads per group   n d_state
    dt        Δ after bias / softplus / limits, (b, c, T, h)
    Acs       dA_cumsum: inclusive cumulative sum of Δ·A inside each chunk, (b, c, T, h)

Stages (the names of mamba_ssm's kernels and of the SSDi8 paper):
    chunk_cumsum     dt, A            -> dt, Acs
    chunk_state      B, x, dt, Acs    -> state contributed by each chunk, decayed to its end (b, c, h, p, n)
    state_passing    chunk states     -> state entering each chunk (b, c, h, p, n), final state (b, h, p, n)
    chunk_bmm        C, B             -> C_t·B_s per group (b, c, t, s, g)
    chunk_scan_off   C, entering, Acs -> off-diagonal output: what the entering state gives (b, c, T, h, p)
    chunk_scan_diag  CB, x, dt, Acs   -> diagonal output: the masked in-chunk "attention" (b, c, T, h, p)
``ssd_stages_ref`` composes them and equals ``ssd_chunk_scan_ref`` bit for bit in float32 (a test checks
it), so the int8 stages of ``ssd_int8`` can be compared stage by stage with a float twin.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ssmq.ops.layout import discretize_dt, heads_per_group
from ssmq.ops.ssd import _skip_and_gate


def chunk_cumsum(dt, A, chunk_size, dt_bias=None, dt_softplus=False, dt_limit=(0.0, math.inf)):
    """dt: (b, l, h) raw; A: (h,) -> (dt (b, c, T, h) float32, Acs (b, c, T, h)); padded steps have Δ = 0."""
    b, l, h = dt.shape
    T = chunk_size
    pad = (-l) % T
    dtf = F.pad(discretize_dt(dt, dt_bias, dt_softplus, dt_limit), (0, 0, 0, pad))
    nc = (l + pad) // T
    return dtf.reshape(b, nc, T, h), (dtf * A.float()).reshape(b, nc, T, h).cumsum(dim=2)


def chunk_tokens(t: torch.Tensor, T: int) -> torch.Tensor:
    """(b, l, k, m) -> zero-padded (b, c, T, k, m)."""
    b, l = t.shape[:2]
    pad = (-l) % T
    return F.pad(t, (0, 0, 0, 0, 0, pad)).reshape(b, (l + pad) // T, T, *t.shape[2:])


def heads_of_groups(t: torch.Tensor, h: int) -> torch.Tensor:
    """(..., g, n) -> (..., h, n): each group serves h / g consecutive heads."""
    return t.repeat_interleave(heads_per_group(h, t.shape[-2]), dim=-2)


def chunk_state(B, xdt, Acs):
    """B: (b, c, T, h, n) per head; xdt = Δ·x: (b, c, T, h, p) -> (b, c, h, p, n) float32."""
    return torch.einsum("bcshn,bcsh,bcshp->bchpn", B, torch.exp(Acs[:, :, -1:] - Acs), xdt)


def state_passing(chunk_states, Acs, initial_states=None):
    """chunk_states: (b, c, h, p, n); Acs: (b, c, T, h) -> (entering (b, c, h, p, n), final (b, h, p, n))."""
    b, _, h, p, n = chunk_states.shape
    state = chunk_states.new_zeros(b, h, p, n) if initial_states is None else initial_states.float()
    chunk_decay = torch.exp(Acs[:, :, -1])  # (b, c, h)
    entering = []
    for c in range(chunk_states.shape[1]):
        entering.append(state)
        state = chunk_decay[:, c, :, None, None] * state + chunk_states[:, c]
    return torch.stack(entering, dim=1), state


def chunk_bmm(C, B):
    """C, B: (b, c, T, k, n) (k = g, or h after the broadcast) -> C_t·B_s (b, c, t, s, k)."""
    return torch.einsum("bcthn,bcshn->bctsh", C, B)


def causal_decay(Acs):
    """L[t, s] = exp(Acs_t - Acs_s) for s <= t, else 0: (b, c, t, s, h)."""
    T = Acs.shape[2]
    causal = torch.ones(T, T, dtype=torch.bool, device=Acs.device).tril()
    return torch.exp((Acs.unsqueeze(3) - Acs.unsqueeze(2)).masked_fill(~causal[:, :, None], -math.inf))


def chunk_scan_diag(CB, xdt, Acs):
    """CB: (b, c, t, s, h); xdt: (b, c, T, h, p) -> sum_{s<=t} CB L xdt_s (b, c, T, h, p)."""
    return torch.einsum("bctsh,bcshp->bcthp", CB * causal_decay(Acs), xdt)


def chunk_scan_off(C, entering, Acs):
    """C: (b, c, T, h, n); entering: (b, c, h, p, n) -> exp(Acs_t) C_t · state (b, c, T, h, p)."""
    return torch.einsum("bcthn,bchpn,bcth->bcthp", C, entering, torch.exp(Acs))


def ssd_stages_ref(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, dt_softplus=False,
                   dt_limit=(0.0, math.inf), initial_states=None, return_final_states=False):
    """``ssd_chunk_scan_ref`` (same signature and shapes) built from the six stages."""
    b, l, h, p = x.shape
    heads_per_group(h, B.shape[2])
    T = chunk_size
    dtc, Acs = chunk_cumsum(dt, A, T, dt_bias, dt_softplus, dt_limit)
    xdt = chunk_tokens(x.float(), T) * dtc.unsqueeze(-1)
    Bh, Ch = (heads_of_groups(chunk_tokens(t.float(), T), h) for t in (B, C))
    y = chunk_scan_diag(chunk_bmm(Ch, Bh), xdt, Acs)
    entering, final = state_passing(chunk_state(Bh, xdt, Acs), Acs, initial_states)
    y = y + chunk_scan_off(Ch, entering, Acs)
    y = _skip_and_gate(y.reshape(b, -1, h, p)[:, :l], x, D, z).to(x.dtype)
    return (y, final) if return_final_states else y
