"""Weighted 1-D k-means (Lloyd) for nuqX codebooks: levels that minimize the Fisher-weighted squared error.

Glossary: N samples, C levels. u (N,) normalized values in [-1, 1], w (N,) >= 0 their weights (diagonal Fisher:
squared gradients of the loss w.r.t. the cached activations), c (C,) sorted levels.
"""

from __future__ import annotations

import torch

from ssmq.ops.kv_quant import nearest_code


def weighted_error(u: torch.Tensor, w: torch.Tensor, codebook: torch.Tensor) -> float:
    """Σ w (u - c[nearest])² / Σ w."""
    q = codebook[nearest_code(u, codebook).long()]
    return float((w * (u - q) ** 2).sum() / w.sum().clamp(min=1e-30))


def weighted_kmeans(u: torch.Tensor, w: torch.Tensor, init: torch.Tensor, iters: int = 40,
                    pin_ends: bool = False) -> torch.Tensor:
    """Lloyd iterations from ``init`` (C,) sorted: assign each u to its nearest level, move each level to the
    weighted mean of its samples (an empty level stays). The weighted error never increases. Returns (C,) sorted.
    ``pin_ends``: the first and last levels stay at -1 and 1 (for min-max normalized vectors, whose extremes are
    at exactly ±1: a level pulled inward would miss every vector's largest entries)."""
    u, w, c = u.float(), w.float(), init.float().clone()
    if pin_ends:
        c[0], c[-1] = -1.0, 1.0
    for _ in range(iters):
        a = nearest_code(u, c).long()
        mass = torch.zeros_like(c).index_add_(0, a, w)
        total = torch.zeros_like(c).index_add_(0, a, w * u)
        new = torch.where(mass > 0, total / mass.clamp(min=1e-30), c)
        if pin_ends:
            new[0], new[-1] = -1.0, 1.0
        new = new.sort().values
        if torch.equal(new, c):
            break
        c = new
    return c


def q_norm(u: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """KVQuant's Q-Norm: shift and scale the levels so that the quantized values of u have u's mean and std."""
    q = codebook[nearest_code(u, codebook).long()]
    std = q.std().clamp(min=1e-12)
    return ((codebook - q.mean()) * (u.std() / std) + u.mean()).sort().values
