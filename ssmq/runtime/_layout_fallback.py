"""Temporary stand-in for ``ssmq.ops.layout`` (issue 20) until it lands on main; delete it then."""

from __future__ import annotations


class _Segments:
    def __init__(self, names, sizes):
        self.names, self.sizes = tuple(names), tuple(sizes)

    def offset(self, name: str) -> int:
        return sum(self.sizes[:self.names.index(name)])


def mamba2_in_proj_segments(d_inner, ngroups, d_state, nheads):
    gn = ngroups * d_state
    return _Segments(("z", "x", "B", "C", "dt"), (d_inner, d_inner, gn, gn, nheads))


def mamba2_conv_segments(d_inner, ngroups, d_state):
    gn = ngroups * d_state
    return _Segments(("x", "B", "C"), (d_inner, gn, gn))


def mamba1_in_proj_segments(d_inner):
    return _Segments(("x", "z"), (d_inner, d_inner))


def norm_group_size(d_inner, ngroups, group_size=None):
    return group_size or d_inner // ngroups
