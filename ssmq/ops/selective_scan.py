"""Mamba-1 selective scan (prefill), written as the sequential recurrence.

    h_t = exp(Δ_t A) h_{t-1} + Δ_t B_t u_t ;   y_t = C_t h_t + D u_t ;   y_t *= silu(z_t)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ssmq.ops.layout import discretize_dt


def selective_scan_ref(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    initial_state: torch.Tensor | None = None,
    return_last_state: bool = False,
):
    """Selective scan over the whole sequence.

    u, delta, z: (b, d, l); A: (d, n); B, C: (b, n, l) or grouped (b, g, n, l);
    D, delta_bias: (d,); initial_state: (b, d, n) float.
    Returns y (b, d, l) in u's dtype and, if asked, the last state (b, d, n) float32.
    """
    dtype_in = u.dtype
    b, d, l = u.shape
    u = u.float()
    delta = discretize_dt(delta, None if delta_bias is None else delta_bias[:, None], delta_softplus)
    Bf, Cf = B.float(), C.float()
    if Bf.dim() == 4:  # grouped B/C: expand groups over channels
        Bf = Bf.repeat_interleave(d // Bf.shape[1], dim=1)  # (b, d, n, l)
        Cf = Cf.repeat_interleave(d // Cf.shape[1], dim=1)
    else:
        Bf, Cf = Bf.unsqueeze(1), Cf.unsqueeze(1)  # (b, 1, n, l)
    deltaA = torch.exp(delta.unsqueeze(2) * A.float()[None, :, :, None])  # (b, d, n, l)
    deltaB_u = (delta * u).unsqueeze(2) * Bf  # (b, d, n, l)
    h = torch.zeros(b, d, A.shape[1], device=u.device) if initial_state is None else initial_state.float().clone()
    ys = []
    for t in range(l):
        h = deltaA[..., t] * h + deltaB_u[..., t]
        ys.append((h * Cf[..., t]).sum(-1))
    y = torch.stack(ys, dim=-1) if l else u.new_zeros(b, d, 0)
    if D is not None:
        y = y + u * D.float()[:, None]
    if z is not None:
        y = y * F.silu(z.float())
    y = y.to(dtype_in)
    return (y, h) if return_last_state else y
