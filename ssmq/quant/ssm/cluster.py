"""Sort-and-cluster (Quamba2): group the SSM input channels x by their calibrated range so that
m × n static scales fit them, and order the channels so that every group is contiguous.

Glossary: d d_inner channels, h heads, p headdim, g B/C groups, m head groups, n channel groups,
block heads that may be permuted among themselves (they share a B/C group and a gated-norm group).

Mamba-2 (two levels, as the paper): heads are clustered into m groups by their max |x|; inside
each head group, every head's channels are sorted by max |x| and the sorted positions are
clustered into n groups (the profile is the max over the group's heads). Heads only move within
their block, so B/C sharing and the gated norm are unchanged.
Mamba-1 (no heads; every channel is independent): channels are sorted and clustered into m·n groups.
Clusters are 1-D k-means on log max |x| (scales are ratios, so distances are taken in log space).
"""

from __future__ import annotations

import torch


def kmeans_1d(values: torch.Tensor, k: int, iters: int = 50) -> torch.Tensor:
    """values (N,) -> cluster id (N,) long in [0, k'), k' <= k, ids ordered by centre (ascending).

    Deterministic: centres start at evenly spaced quantiles; Lloyd iterations until stable.
    """
    v = values.double()
    k = max(1, min(k, v.numel()))
    centres = torch.quantile(v, torch.linspace(0, 1, k, dtype=torch.float64))
    ids = torch.zeros(v.numel(), dtype=torch.long)
    for _ in range(iters):
        new = (v[:, None] - centres[None]).abs().argmin(1)
        if torch.equal(new, ids) and _ > 0:
            break
        ids = new
        for c in range(k):
            if (ids == c).any():
                centres[c] = v[ids == c].mean()
    used = ids.unique(sorted=True)  # drop empty clusters, keep ascending order of centres
    order = torch.argsort(centres[used])
    remap = torch.empty(k, dtype=torch.long)
    remap[used[order]] = torch.arange(len(used))
    return remap[ids]


def _log(x: torch.Tensor) -> torch.Tensor:
    return torch.log(x.double().clamp(min=1e-12))


def cluster_channels(chan_max: torch.Tensor, m: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba-1: chan_max (d,) -> (perm (d,) new -> old channel, index (d,) group id in the new order)."""
    perm = torch.argsort(chan_max, stable=True)
    ids = kmeans_1d(_log(chan_max[perm]), m * n)
    return perm, ids


def cluster_heads(chan_max: torch.Tensor, h: int, p: int, m: int, n: int, block: int):
    """Mamba-2: chan_max (d = h·p,) -> (perm (d,) new -> old channel, index (d,) group id, head_perm (h,)).

    block: heads [i·block, (i+1)·block) may be permuted among themselves only.
    """
    cmax = chan_max.reshape(h, p)
    head_ids = kmeans_1d(_log(cmax.amax(1)), m)  # (h,)
    # heads ordered by (block, head group, max) so each group is contiguous inside its block
    head_perm = torch.argsort(cmax.amax(1), stable=True)
    for key in (head_ids, torch.arange(h) // block):  # stable sorts: last key is the primary one
        head_perm = head_perm[torch.argsort(key[head_perm], stable=True)]
    chan_perm = torch.argsort(cmax, dim=1, stable=True)  # (h, p): each head's channels by ascending max
    index = torch.empty(h, p, dtype=torch.long)
    n_head_groups = int(head_ids.max()) + 1
    offset = 0
    for hg in range(n_head_groups):
        heads = (head_ids == hg).nonzero().squeeze(1)
        profile = cmax[heads].gather(1, chan_perm[heads]).amax(0)  # (p,) max at each sorted position
        pos_ids = kmeans_1d(_log(profile), n)
        index[heads] = offset + pos_ids
        offset += int(pos_ids.max()) + 1
    perm = (head_perm[:, None] * p + chan_perm[head_perm]).reshape(-1)  # new channel -> old channel
    return perm, index[head_perm].reshape(-1), head_perm
