"""The experts of a mixture-of-experts feed-forward on stacked weights: the reference of ``kernels.moe``.

Glossary: t tokens (b·l flattened), d model width, f expert hidden size, E experts, k experts per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MOE_ACTS = ("silu", "relu2")


def moe_experts_ref(
    x: torch.Tensor,
    weights: torch.Tensor,
    idx: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    w_gate: torch.Tensor | None = None,
    act: str = "silu",
) -> torch.Tensor:
    """Σ_j weights[:, j] · expert_idx[:, j](x) for each token.

    x: (t, d); weights: (t, k) float32 routing weights; idx: (t, k) int, each token's k experts (distinct);
    w_up, w_gate: (E, f, d); w_down: (E, d, f). Expert e is down_e(silu(gate_e(x)) · up_e(x)) with act "silu" (a gated
    MLP), down_e(relu(up_e(x))²) with act "relu2" (no gate: w_gate None). Each product is ``F.linear`` in x's dtype (as
    the expert's linears compute it), the weighted sum over the k experts in float32. Returns (t, d) in x's dtype.
    """
    if act not in MOE_ACTS or (w_gate is None) != (act == "relu2"):
        raise ValueError(f"act {act!r} with{'out' if w_gate is None else ''} a gate: expected silu with a gate or "
                         "relu2 without")
    out = torch.zeros(x.shape[0], w_down.shape[1], dtype=torch.float32, device=x.device)
    for e in range(w_up.shape[0]):
        token, slot = torch.where(idx == e)  # the tokens routed to e, and at which of their k places
        if not token.numel():
            continue
        xe = x[token]
        up = F.linear(xe, w_up[e])
        h = F.silu(F.linear(xe, w_gate[e])) * up if act == "silu" else F.relu(up).square()
        y = F.linear(h, w_down[e])
        out.index_add_(0, token, y.float() * weights[token, slot, None].float())
    return out.to(x.dtype)
