"""Mamba-2 SSD (state space duality): chunked scan and the sequential recurrence it must equal.

Per head, with scalar decay a_t = exp(Δ_t A_h):
    H_t = a_t H_{t-1} + Δ_t x_t B_tᵀ     (H: (p, n))
    y_t = H_t C_t + D x_t ;   y_t *= silu(z_t)
The chunked form splits the sequence into chunks of T tokens: inside a chunk the
output is a masked (T × T) "attention" C Bᵀ ∘ L; across chunks only the (p × n)
states are carried, so the cost is linear in l.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ssmq.ops.layout import discretize_dt, heads_per_group
from ssmq.ops.state_update import selective_state_update_ref


def _skip_and_gate(y, x, D, z):
    if D is not None:
        Df = D.float()
        y = y + x.float() * (Df[:, None] if Df.dim() == 1 else Df)
    if z is not None:
        y = y * F.silu(z.float())
    return y


def check_state_rows(state_rows, initial_states, return_final_states: bool, batch: int) -> None:
    """Raise on a ``state_rows`` argument the scan cannot honour (read and written in place, it replaces the
    initial/final state arguments)."""
    if state_rows is None:
        return
    states, rows = state_rows
    if initial_states is not None or return_final_states:
        raise ValueError("state_rows reads and writes the states in place: pass no initial_states and "
                         "return_final_states=False")
    if not states.is_floating_point() or not states.is_contiguous() or states.dim() != 4:
        raise ValueError(f"state_rows needs a contiguous float (s, h, p, n) buffer, got {states.dtype} "
                         f"{tuple(states.shape)}")
    if rows.dtype != torch.int64 or tuple(rows.shape) != (batch,) or rows.device != states.device:
        raise ValueError(f"state_rows needs ({batch},) int64 rows on {states.device}, got {rows.dtype} "
                         f"{tuple(rows.shape)} on {rows.device}")


def ssd_chunk_scan_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    initial_states: torch.Tensor | None = None,
    return_final_states: bool = False,
    state_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
):
    """Chunked SSD scan (Mamba-2 prefill), the contract of ``mamba_chunk_scan_combined``.

    x, z: (b, l, h, p); dt: (b, l, h); A: (h,); B, C: (b, l, g, n);
    D: (h,) or (h, p); dt_bias: (h,); initial_states: (b, h, p, n).
    Returns y (b, l, h, p) in x's dtype and, if asked, final states (b, h, p, n) float32.

    state_rows (states (s, h, p, n) float, contiguous; rows (b,) int64, distinct): the scan continues the cache
    rows ``states[rows]`` and leaves its final states there, in the buffer's dtype; returns y alone (instead of
    ``initial_states`` and ``return_final_states``).
    """
    if state_rows is not None:
        check_state_rows(state_rows, initial_states, return_final_states, x.shape[0])
        states, rows = state_rows
        y, final = ssd_chunk_scan_ref(x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_softplus, dt_limit,
                                      states[rows], True)
        states[rows] = final.to(states.dtype)
        return y
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    rep = heads_per_group(h, g)
    T = chunk_size
    dtf = discretize_dt(dt, dt_bias, dt_softplus, dt_limit)  # (b, l, h)
    pad = (-l) % T
    # zero-padded steps have Δ = 0: decay 1, no input, so they leave the state alone
    xdt = F.pad(x.float() * dtf.unsqueeze(-1), (0, 0, 0, 0, 0, pad))
    Adt = F.pad(dtf * A.float(), (0, 0, 0, pad))
    Bh = F.pad(B.float(), (0, 0, 0, 0, 0, pad)).repeat_interleave(rep, dim=2)
    Ch = F.pad(C.float(), (0, 0, 0, 0, 0, pad)).repeat_interleave(rep, dim=2)
    nc = (l + pad) // T
    xdt, Bh, Ch = (t.reshape(b, nc, T, h, -1) for t in (xdt, Bh, Ch))  # (b, c, T, h, ·)
    Acs = Adt.reshape(b, nc, T, h).cumsum(dim=2)  # (b, c, T, h)

    # 1. intra-chunk: y_t += sum_{s<=t} (C_t·B_s) exp(Acs_t - Acs_s) Δ_s x_s
    seg = Acs.unsqueeze(3) - Acs.unsqueeze(2)  # (b, c, t, s, h)
    causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
    L = torch.exp(seg.masked_fill(~causal[:, :, None], -math.inf))
    scores = torch.einsum("bcthn,bcshn->bctsh", Ch, Bh) * L
    y = torch.einsum("bctsh,bcshp->bcthp", scores, xdt)

    # 2. state contributed by each chunk, decayed to the chunk's end
    decay_to_end = torch.exp(Acs[:, :, -1:] - Acs)  # (b, c, T, h)
    chunk_states = torch.einsum("bcshn,bcsh,bcshp->bchpn", Bh, decay_to_end, xdt)

    # 3. carry states across chunks (c steps, sequential)
    state = x.new_zeros(b, h, p, n, dtype=torch.float32) if initial_states is None else initial_states.float()
    chunk_decay = torch.exp(Acs[:, :, -1])  # (b, c, h)
    entering = []
    for c in range(nc):
        entering.append(state)
        state = chunk_decay[:, c, :, None, None] * state + chunk_states[:, c]
    entering = torch.stack(entering, dim=1)  # (b, c, h, p, n)

    # 4. contribution of the state entering each chunk
    y = y + torch.einsum("bcthn,bchpn,bcth->bcthp", Ch, entering, torch.exp(Acs))
    y = y.reshape(b, nc * T, h, p)[:, :l]
    y = _skip_and_gate(y, x, D, z).to(x.dtype)
    return (y, state) if return_final_states else y


def ssd_sequential_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    initial_states: torch.Tensor | None = None,
    return_final_states: bool = False,
):
    """The SSD recurrence token by token (same shapes as ``ssd_chunk_scan_ref``, no chunk size).

    Built from the decode step itself, so prefill and decode share one definition.
    """
    b, l, h, p = x.shape
    n = B.shape[-1]
    dtf = discretize_dt(dt, dt_bias, dt_softplus, dt_limit)
    state = x.new_zeros(b, h, p, n, dtype=torch.float32) if initial_states is None else initial_states.float().clone()
    A_hpn = A.float()[:, None, None].expand(h, p, n)
    ys = [
        selective_state_update_ref(state, x[:, t].float(), dtf[:, t, :, None].expand(b, h, p), A_hpn, B[:, t], C[:, t])
        for t in range(l)
    ]
    y = torch.stack(ys, dim=1) if l else x.new_zeros(b, 0, h, p, dtype=torch.float32)
    y = _skip_and_gate(y, x, D, z).to(x.dtype)
    return (y, state) if return_final_states else y
