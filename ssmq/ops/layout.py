"""Layout facts of the Mamba mixers, written once: how projections and conv channels are split, how B/C
groups map to heads and norm groups, the layer kinds, and how Δ is discretized.

Models, references, kernel wrappers, quantization transforms, loaders and tensor parallelism read these
instead of spelling the offsets out (a split that disagrees with the model is a silent bug).

Glossary (as ``ssmq.ops``): d d_inner, n d_state, h SSM heads, g ngroups (B/C groups), r dt_rank.

    Mamba-2 in_proj output   [z (d) | x (d) | B (g·n) | C (g·n) | dt (h)]
    Mamba-2 conv channels    [x (d) | B (g·n) | C (g·n)]      (the middle of in_proj's output)
    Mamba-1 in_proj output   [x (d) | z (d)]
    Mamba-1 x_proj output    [dt (r) | B (n) | C (n)]
    Mamba-1 conv channels    [x (d)]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

import torch
import torch.nn.functional as F


class LayerKind(str, Enum):
    """What a layer's mixer is. A ``str`` enum: equal to its value, so JSON and old comparisons keep working."""

    MAMBA1 = "mamba1"
    MAMBA2 = "mamba2"
    ATTENTION = "attention"

    def __str__(self) -> str:
        return self.value

    # hash as the plain string, so dicts keyed by "mamba1" etc. (old code, JSON) find a LayerKind key too
    __hash__ = str.__hash__

    @property
    def is_ssm(self) -> bool:
        return self is not LayerKind.ATTENTION


SSM_KINDS = (LayerKind.MAMBA1, LayerKind.MAMBA2)


@dataclass(frozen=True)
class Segments:
    """Named, contiguous pieces of one dimension, in order (e.g. the rows of in_proj's weight)."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]

    @property
    def total(self) -> int:
        return sum(self.sizes)

    def offset(self, name: str) -> int:
        i = self.names.index(name)
        return sum(self.sizes[:i])

    def size(self, name: str) -> int:
        return self.sizes[self.names.index(name)]

    def slice(self, name: str) -> slice:
        start = self.offset(name)
        return slice(start, start + self.size(name))

    def slices(self) -> dict[str, slice]:
        return {name: self.slice(name) for name in self.names}

    def fuse(self, names: tuple[str, ...], as_name: str) -> Segments:
        """The same layout with the adjacent segments ``names`` seen as one, e.g. Mamba-2's x, B, C as xBC."""
        i = self.names.index(names[0])
        if self.names[i:i + len(names)] != tuple(names):
            raise ValueError(f"segments {names} are not adjacent in {self.names}")
        size = sum(self.sizes[i:i + len(names)])
        return Segments(self.names[:i] + (as_name,) + self.names[i + len(names):],
                        self.sizes[:i] + (size,) + self.sizes[i + len(names):])

    def split(self, t: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, ...]:
        """t: (..., total, ...) -> one view per segment, in order, along ``dim``."""
        if t.shape[dim] != self.total:
            raise ValueError(f"cannot split {t.shape[dim]} channels into {dict(zip(self.names, self.sizes))}")
        return tuple(t.split(list(self.sizes), dim=dim))


def mamba2_in_proj_segments(d_inner: int, ngroups: int, d_state: int, nheads: int) -> Segments:
    """Mamba-2 in_proj output (…, 2d + 2gn + h) = [z | x | B | C | dt]."""
    gn = ngroups * d_state
    return Segments(("z", "x", "B", "C", "dt"), (d_inner, d_inner, gn, gn, nheads))


def mamba2_conv_segments(d_inner: int, ngroups: int, d_state: int) -> Segments:
    """Mamba-2 conv channels (…, d + 2gn) = [x | B | C] (``xBC``), contiguous in in_proj's output."""
    gn = ngroups * d_state
    return Segments(("x", "B", "C"), (d_inner, gn, gn))


def mamba1_in_proj_segments(d_inner: int) -> Segments:
    """Mamba-1 in_proj output (…, 2d) = [x | z]."""
    return Segments(("x", "z"), (d_inner, d_inner))


def mamba1_x_proj_segments(dt_rank: int, d_state: int) -> Segments:
    """Mamba-1 x_proj output (…, r + 2n) = [dt | B | C] (dt is low rank; dt_proj lifts it to d)."""
    return Segments(("dt", "B", "C"), (dt_rank, d_state, d_state))


def mamba1_conv_segments(d_inner: int) -> Segments:
    """Mamba-1 conv channels (…, d) = [x]."""
    return Segments(("x",), (d_inner,))


def heads_per_group(nheads: int, ngroups: int) -> int:
    """Heads sharing one B/C group (h // g); the one place ``h % g == 0`` is checked."""
    if ngroups < 1 or nheads % ngroups:
        raise ValueError(f"nheads {nheads} is not a multiple of ngroups {ngroups}")
    return nheads // ngroups


def norm_group_size(d_inner: int, ngroups: int, group_size: int | None = None) -> int:
    """Channels per gated-RMSNorm group: ``group_size`` when set, else d // g (mamba_ssm's default)."""
    size = group_size or d_inner // ngroups
    if d_inner % size:
        raise ValueError(f"gated-norm group {size} does not divide d_inner {d_inner}")
    return size


NO_DT_LIMIT = (0.0, math.inf)


def discretize_dt(dt: torch.Tensor, dt_bias: torch.Tensor | None = None, softplus: bool = True,
                  dt_limit: tuple[float, float] = NO_DT_LIMIT) -> torch.Tensor:
    """Δ = clamp(softplus(dt + dt_bias), *dt_limit), in float32 — the discretization of every SSM.

    dt: (b, l, h) | (b, h) | (b, d, l) | …; dt_bias broadcastable against dt (reshape it first, e.g.
    ``bias[:, None]`` for the channel-first (b, d, l) scan). Returns float32, dt's shape.
    """
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if softplus:
        dt = F.softplus(dt)
    if tuple(dt_limit) != NO_DT_LIMIT:
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    return dt


def has_dt_limit(dt_limit) -> bool:
    return tuple(dt_limit) != NO_DT_LIMIT
