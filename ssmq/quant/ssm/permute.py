"""Reorder the SSM channels of a float mixer offline; the mixer computes the same function.

Glossary: d d_inner, h heads, p headdim, g ngroups, n d_state; perm (d,) maps new channel -> old channel.

What moves with a channel of x (and of y, z, which share its position):
    Mamba-1  in_proj rows of x and of z, conv1d channel, x_proj column, dt_proj row, dt_bias, A_log
             row, D, out_proj column
    Mamba-2  in_proj rows of z and of x, conv1d channel (x part), gated-norm weight, out_proj column;
             whole heads also move their Δ row of in_proj, dt_bias, A_log and D (``head_perm``)
B and C are never permuted (they are shared by all channels of a group).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ssmq.errors import SSMQError


def _rows_(linear: nn.Linear, start: int, perm: torch.Tensor) -> None:
    """Permute output rows [start, start + len(perm)) of a linear (and its bias)."""
    sl = slice(start, start + len(perm))
    linear.weight[sl] = linear.weight[sl][perm]
    if linear.bias is not None:
        linear.bias[sl] = linear.bias[sl][perm]


def _vec_(param: torch.Tensor, perm: torch.Tensor) -> None:
    param.copy_(param[perm])


@torch.no_grad()
def permute_mamba1_(mixer: nn.Module, perm: torch.Tensor) -> None:
    d = mixer.d_inner
    if sorted(perm.tolist()) != list(range(d)):
        raise SSMQError("permute_mamba1_: perm is not a permutation of the d_inner channels")
    seg = mixer.proj_segments
    _rows_(mixer.in_proj, seg.offset("x"), perm)
    _rows_(mixer.in_proj, seg.offset("z"), perm)
    mixer.conv1d.weight.copy_(mixer.conv1d.weight[perm])
    if mixer.conv1d.bias is not None:
        _vec_(mixer.conv1d.bias, perm)
    mixer.x_proj.weight.copy_(mixer.x_proj.weight[:, perm])
    _rows_(mixer.dt_proj, 0, perm)
    for p in (mixer.dt_bias, mixer.A_log, mixer.D):
        _vec_(p, perm)
    mixer.out_proj.weight.copy_(mixer.out_proj.weight[:, perm])


@torch.no_grad()
def permute_mamba2_(mixer: nn.Module, perm: torch.Tensor, head_perm: torch.Tensor) -> None:
    """perm must keep each head's channels together: perm[i·p:(i+1)·p] ⊂ head head_perm[i]."""
    c = mixer.cfg
    p, h = c.headdim, c.nheads
    if not torch.equal(perm.reshape(h, p) // p, head_perm[:, None].expand(h, p)):
        raise SSMQError("permute_mamba2_: perm moves channels across heads")
    seg = c.in_proj_segments()
    _rows_(mixer.in_proj, seg.offset("z"), perm)
    _rows_(mixer.in_proj, seg.offset("x"), perm)
    _rows_(mixer.in_proj, seg.offset("dt"), head_perm)
    xs = c.conv_segments().slice("x")
    mixer.conv1d.weight[xs] = mixer.conv1d.weight[xs][perm]
    if mixer.conv1d.bias is not None:
        mixer.conv1d.bias[xs] = mixer.conv1d.bias[xs][perm]
    for prm in (mixer.dt_bias, mixer.A_log, mixer.D):
        _vec_(prm, head_perm)
    _vec_(mixer.norm.weight, perm)
    mixer.out_proj.weight.copy_(mixer.out_proj.weight[:, perm])


def permutable_block(cfg) -> int:
    """Heads that may trade places in a Mamba-2 mixer: same B/C group and same gated-norm group."""
    import math

    norm = cfg.norm_group
    if norm % cfg.headdim:
        raise SSMQError(f"sort-and-cluster needs gated-norm groups of whole heads; norm group {norm} "
                        f"is not a multiple of headdim {cfg.headdim}")
    return math.gcd(cfg.heads_per_group, norm // cfg.headdim)
