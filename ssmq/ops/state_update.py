"""One recurrent step of the selective SSM, for Mamba-1 and Mamba-2 (decode).

    h  <- exp(dt * A) * h + dt * B * x        (per channel, per state)
    y   = <h, C> + D * x ;   y <- y * silu(z)

Mamba-1 layout: state (s, d, n), x (b, d), A (d, n), B/C (b, n).
Mamba-2 layout: state (s, h, p, n), x (b, h, p), A (h, p, n), B/C (b, g, n);
per-head scalars (A, dt, D, dt_bias) are passed expanded over p (stride 0 is fine).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ssmq.ops.layout import discretize_dt, heads_per_group


def selective_state_update_ref(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    state_batch_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """Advance the SSM state one token and return y; updates ``state`` in place.

    Shapes (Mamba-1 | Mamba-2): state (s, d, n) | (s, h, p, n); x, dt, z
    (b, d) | (b, h, p); A (d, n) | (h, p, n); B, C (b, n) | (b, g, n);
    D, dt_bias (d,) | (h, p). state_batch_indices: (b,) cache slot per row.
    Returns y shaped like x, in x's dtype. Arithmetic in float32.
    """
    multihead = state.dim() == 4
    if not multihead:  # lift Mamba-1 to the multi-head layout with h = 1
        x, dt, z = (t.unsqueeze(1) if t is not None else None for t in (x, dt, z))
        A, D, dt_bias = (t.unsqueeze(0) if t is not None else None for t in (A, D, dt_bias))
        B, C = B.unsqueeze(1), C.unsqueeze(1)
    idx = torch.arange(x.shape[0], device=x.device) if state_batch_indices is None else state_batch_indices.long()
    h_state = state[idx].float()
    if not multihead:
        h_state = h_state.unsqueeze(1)
    rep = heads_per_group(x.shape[1], B.shape[1])
    Bh = B.float().repeat_interleave(rep, dim=1)  # (b, h, n)
    Ch = C.float().repeat_interleave(rep, dim=1)
    dtf = discretize_dt(dt, dt_bias, dt_softplus)
    dA = torch.exp(dtf.unsqueeze(-1) * A.float())  # (b, h, p, n)
    dBx = (dtf * x.float()).unsqueeze(-1) * Bh.unsqueeze(2)
    h_state = h_state * dA + dBx
    y = (h_state * Ch.unsqueeze(2)).sum(-1)
    if D is not None:
        y = y + x.float() * D.float()
    if z is not None:
        y = y * F.silu(z.float())
    state[idx] = (h_state if multihead else h_state.squeeze(1)).to(state.dtype)
    return (y if multihead else y.squeeze(1)).to(x.dtype)
