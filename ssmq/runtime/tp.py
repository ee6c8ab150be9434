"""Tensor parallelism: ``apply_tp(model, comm)`` shards a loaded SSMLM in place across the ranks of a group.

gpt-fast style: every linear is either column-parallel (a subset of its output rows; no communication)
or row-parallel (a slice of its input columns, then one all-reduce of the output). The embedding, the
block norms, the final norm and lm_head are replicated, so the residual stream is identical on every rank.

Glossary: W ranks, r this rank, d d_inner, h SSM heads, p headdim, g B/C groups, n d_state, e head dim,
hq / hkv query / key-value heads; "_l" = this rank's share.

    Mamba-2   heads sharded (h_l = h / W). in_proj column-parallel, rows picked from each of its segments
              [z | x | B | C | dt] (ssmq.ops.layout): this rank's channels of z and x, its heads' dt, and
              the B/C groups its heads read: sharded when g % W == 0, else the one group all its heads
              share (replicated across the ranks of that group; g = 1: B/C everywhere). conv1d per channel
              (x, then the same B/C groups). Gated norm: local when its groups do not straddle ranks; else
              the per-group sum of squares is all-reduced (2 all-reduces per block), or, with one norm
              group spanning d and nothing quantized between norm and out_proj, sent as one extra column
              of out_proj's all-reduce and divided after it (1 all-reduce per block). out_proj row-parallel.
    Mamba-1   d sharded. in_proj rows of this rank's x and z channels; conv, dt_proj rows, dt_bias, A, D per
              channel; x_proj row-parallel: its all-reduce gives Δ (low rank), B, C on every rank, and
              dt_proj lifts Δ to this rank's channels. 2 all-reduces per block (x_proj, out_proj).
    Hybrid    attention: query heads sharded; KV heads sharded when hkv % W == 0, else each rank keeps the
              one KV head its query heads read; o_proj row-parallel. MLP: gate/up column, down row.
              2 all-reduces per attention block (o_proj, down_proj), Mamba-2 blocks as above (+1 for MLP).
    Falcon-H1 attention in parallel with each Mamba-2 mixer: both sharded as above; their row-parallel outputs are
              scaled by the µP multipliers (scalars: they commute with the sums) and added in ONE all-reduce
              (two where out_proj's all-reduce carries the norm's sum of squares: the norm's rstd applies after
              it). 1 (that sum) + the norm's, if split + 1 (MLP) all-reduces per block. The mixer's
              per-segment in_proj multipliers follow in_proj's rows; its norm, gate first or norm first (or none),
              is local or sharded as Mamba-2's.
    Zamba2    a shared transformer block (stored once, sharded once) is attention + MLP as above. Each use's LoRA
              adapters: down (r, ·) replicated, up column-parallel by the rows of the projection it adds to (q, k,
              v heads; the MLP's [gate | up] rows), so a rank adds exactly its own rows of each delta with no
              communication; sharding down instead would cost an all-reduce of r values for r·d MACs of work. The
              per-use output linear (d, d) reads the MLP's all-reduced output and is replicated (its output joins
              the mixer's input on every rank). 2 all-reduces per use (o_proj, down_proj) + the mixer's.

Quantized modules are split exactly like the float weights they replace: codes by the same rows/columns,
per-channel scales with their rows, per-group scales with their column groups (a shard boundary must
fall on a group boundary), static activation scales replicated, dynamic activation scales of row-parallel
inputs reduced (max) over ranks, SSM tap and int8-state channel maps (``index``, ``state_index``) with
their channels (Quamba2's clusters and permutations are baked into those maps and the weights). An online
Hadamard input of a row-parallel linear spans all ranks: the input is all-gathered, rotated, and this
rank's slice of the rotated input multiplies its columns (one all-gather more).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn as nn

from ssmq import kernels
from ssmq.errors import SSMQError
from ssmq.models.linear import Linear
from ssmq.ops.layout import mamba1_in_proj_segments, mamba2_conv_segments, mamba2_in_proj_segments, norm_group_size
from ssmq.quant.hadamard import RotatedLinear, hadamard_transform
from ssmq.quant.linear import QuantLinear
from ssmq.quant.primitives import PerGroup
from ssmq.runtime.tp_comm import Communicator


# ---------------------------------------------------------------------------------------------
# tensors
# ---------------------------------------------------------------------------------------------
def _put(module: nn.Module, name: str, t: torch.Tensor | None) -> None:
    if t is None:
        return
    if name == "weight_q" and getattr(module, "weight_words", None) is not None:
        module.weight_words = None  # the decode GEMV's copy of the unsharded codes: bound again at decode set-up
    t = t.contiguous()
    if name in module._parameters:
        module._parameters[name] = nn.Parameter(t, requires_grad=False)
    else:
        module._buffers[name] = t


def _rows(t: torch.Tensor | None, idx: torch.Tensor) -> torch.Tensor | None:
    return None if t is None else t.index_select(0, idx.to(t.device))


def _span(start: int, size: int) -> torch.Tensor:
    return torch.arange(start, start + size)


class ShardView:
    """A ModelConfig seen by one rank: the sharded sizes given here, everything else from the full config."""

    def __init__(self, cfg, **local):
        self._cfg = cfg
        self.__dict__.update(local)

    def __getattr__(self, name):
        return getattr(self._cfg, name)


# ---------------------------------------------------------------------------------------------
# linears
# ---------------------------------------------------------------------------------------------
def column_parallel_(lin: nn.Module, rows: torch.Tensor) -> None:
    """Keep output rows ``rows`` (and their bias, per-channel / per-group weight scales) of a linear."""
    if isinstance(lin, QuantLinear):
        _put(lin, "weight_q", _rows(lin.weight_q, rows))
        if lin.weight_scale.dim():
            _put(lin, "weight_scale", _rows(lin.weight_scale, rows))
            _put(lin, "weight_zero", _rows(lin.weight_zero, rows))
    else:
        _put(lin, "weight", _rows(lin.weight, rows))
    _put(lin, "bias", _rows(lin.bias, rows))
    lin.out_features = len(rows)


def _cols(t: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    return t[:, start:stop]


def row_parallel_(lin: nn.Module, start: int, stop: int, keep_bias: bool) -> None:
    """Keep input columns [start, stop) of a linear; its bias only where ``keep_bias`` (added once)."""
    if isinstance(lin, QuantLinear):
        gran = lin.wspec.granularity
        if lin.wspec.dtype == "int4":
            if start % 2 or stop % 2:
                raise SSMQError(f"int4 shard boundary {start}:{stop} splits a packed byte")
            _put(lin, "weight_q", _cols(lin.weight_q, start // 2, stop // 2))
        else:
            _put(lin, "weight_q", _cols(lin.weight_q, start, stop))
        if isinstance(gran, PerGroup):
            g = gran.group_size
            if start % g or stop % g:
                raise SSMQError(f"the shard {start}:{stop} of a {lin.in_features}-column weight splits a "
                                f"quantization group of {g}: choose a tensor-parallel degree whose shards are "
                                f"whole groups")
            _put(lin, "weight_scale", _cols(lin.weight_scale, start // g, stop // g))
            if lin.weight_zero is not None:
                _put(lin, "weight_zero", _cols(lin.weight_zero, start // g, stop // g))
    else:
        _put(lin, "weight", _cols(lin.weight, start, stop))
    if lin.bias is not None and not keep_bias:
        _put(lin, "bias", torch.zeros_like(lin.bias))
    lin.in_features = stop - start


def _is_rotated(lin: nn.Module) -> bool:
    return isinstance(lin, RotatedLinear) or (isinstance(lin, QuantLinear) and lin.rotate_input)


def _plain(lin: nn.Module) -> nn.Module:
    """The same weights without the online rotation (the row-parallel wrapper rotates the gathered input)."""
    if isinstance(lin, RotatedLinear):
        new = nn.Linear(lin.in_features, lin.out_features, lin.bias is not None, device="meta")
        new.weight, new.bias = lin.weight, lin.bias
        return new
    lin.rotate_input = False
    return lin


def _dynamic_act(lin: nn.Module) -> bool:
    return isinstance(lin, QuantLinear) and lin.act is not None and lin.act_scale is None


class RowParallel(nn.Module):
    """A row-parallel shard: y = all_reduce(linear(x_l)). x: (..., k_l) -> (..., n).

    rotated: the full linear had an online Hadamard on its input: x is all-gathered, rotated, and the
    columns [start, stop) of the rotated input are used. Dynamic activation scales are those of the full
    input (max over ranks; or of the gathered input when rotated).
    """

    # partial: return this rank's partial sum, left to a later all-reduce that adds it with others (Falcon-H1's
    # mixer and attention outputs, ``fuse_parallel_sums_``)
    partial = False

    def __init__(self, inner: nn.Module, comm: Communicator, start: int, stop: int, name: str):
        super().__init__()
        self.rotated = _is_rotated(inner)
        row_parallel_(inner, start, stop, keep_bias=comm.rank == 0)
        self.inner = _plain(inner) if self.rotated else inner
        self.comm, self.start, self.stop, self.name = comm, start, stop, name
        self._full_scale = None
        if _dynamic_act(self.inner):
            self.inner.scale_hook = self._full_scale_of if self.rotated else self._reduced_scale

    def _reduced_scale(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce_max(self.inner.dynamic_scale(x), name=f"{self.name}.scale")

    def _full_scale_of(self, x: torch.Tensor) -> torch.Tensor:
        return self._full_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rotated:
            full = hadamard_transform(self.comm.all_gather(x, name=f"{self.name}.gather"))
            if _dynamic_act(self.inner):
                self._full_scale = self.inner.dynamic_scale(full)
            x = full[..., self.start:self.stop]
        y = self.inner(x)
        return y if self.partial else self.comm.all_reduce(y, name=self.name)


# ---------------------------------------------------------------------------------------------
# Mamba-2 gated norm across ranks
# ---------------------------------------------------------------------------------------------
class ShardedGatedNorm(nn.Module):
    """norm(y · silu(z)) · w where this rank's channels lie inside norm group ``group`` of ``n_groups``
    (of ``group_size`` channels each): the group's sum of squares is all-reduced. y, z: (..., d_l).

    partial (the fused path): returns u · w (u = y · silu(z), unnormalised) and leaves ``self.part``, the
    (..., send_cols) float32 tensor that ``FusedNormOutProj`` all-reduces, with this rank's partial sum of
    squares already in its last column (``kernels.rmsnorm_gated_partial``: one kernel, no cast or cat).
    """

    def __init__(self, weight: torch.Tensor, eps: float, group_size: int, group: int, n_groups: int,
                 comm: Communicator, partial: bool = False, norm_before_gate: bool = False):
        super().__init__()
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.eps, self.group_size, self.group, self.n_groups, self.comm = eps, group_size, group, n_groups, comm
        self.partial, self.norm_before_gate = partial, norm_before_gate
        self.send_cols = None  # out_proj's outputs + 1, set by FusedNormOutProj
        self.part = None

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        if self.partial:
            self.part = torch.empty(*y.shape[:-1], self.send_cols, dtype=torch.float32, device=y.device)
            return kernels.rmsnorm_gated_partial(y, self.weight, z, self.part[..., -1:], 0,
                                                 norm_before_gate=self.norm_before_gate)
        sums = torch.empty(*y.shape[:-1], self.n_groups, dtype=torch.float32, device=y.device)
        kernels.rmsnorm_gated_partial(y, self.weight, z, sums, self.group, with_out=False,
                                      norm_before_gate=self.norm_before_gate)
        ss = self.comm.all_reduce(sums, name="gated_norm")
        return kernels.rmsnorm_gated_reduced(y, self.weight, z, ss, self.group, self.group_size, self.eps,
                                             self.norm_before_gate)


class FusedNormOutProj(nn.Module):
    """out_proj of a Mamba-2 mixer whose one norm group spans all ranks, with ONE all-reduce.

    The norm left u·w (unnormalised) and its partial sum of squares; since out_proj is linear and the
    norm factor rsqrt(mean + eps) is one scalar per token, out_proj(u·w)·factor == out_proj(norm(u)·w):
    out_proj writes its (float32) partial output beside the partial sum of squares in the norm's send
    tensor, one all-reduce adds both up, and ``kernels.rstd_scale`` applies the factor (and the bias, once).
    """

    def __init__(self, inner: nn.Module, norm: ShardedGatedNorm, comm: Communicator, start: int, stop: int):
        super().__init__()
        self.bias = None if inner.bias is None else nn.Parameter(inner.bias.detach().clone(), requires_grad=False)
        row_parallel_(inner, start, stop, keep_bias=True)
        inner.bias = None
        self.inner, self.norm, self.comm = inner, norm, comm
        norm.send_cols = inner.out_features + 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        part = self.norm.part
        if type(self.inner) in (Linear, nn.Linear):  # float: the GEMV writes float32 sums straight into part
            kernels.linear_into(x, self.inner.weight, part[..., :-1])
        else:
            part[..., :-1] = self.inner(x)
        red = self.comm.all_reduce(part, name="out_proj+norm", exact_cols=1)
        return kernels.rstd_scale(red, self.norm.group_size, self.norm.eps, self.bias, x.dtype)


# ---------------------------------------------------------------------------------------------
# per-family sharding
# ---------------------------------------------------------------------------------------------
def _divide(what: str, total: int, world: int) -> int:
    if total % world:
        raise SSMQError(f"tensor parallelism over {world} ranks needs {what} ({total}) divisible by {world}")
    return total // world


def _tap_(mixer: nn.Module, tap: str, idx: torch.Tensor) -> None:
    """An SSM activation quantizer keeps the channel -> scale-group map of its channels (scales replicated)."""
    q = getattr(mixer, tap, None)
    if q is None or isinstance(q, nn.Identity):
        return
    if getattr(q, "index", None) is not None:
        _put(q, "index", _rows(q.index, idx))
    q.d = len(idx)


def _state_index_(mixer: nn.Module, channels: torch.Tensor) -> None:
    if getattr(mixer, "state_index", None) is not None:
        _put(mixer, "state_index", _rows(mixer.state_index, channels))


def _conv_(conv: nn.Conv1d, idx: torch.Tensor) -> None:
    _put(conv, "weight", _rows(conv.weight, idx))
    _put(conv, "bias", _rows(conv.bias, idx))
    scale = getattr(conv, "weight_scale", None)  # an int8 conv's per-channel weight scales go with their rows
    if scale is not None and scale.dim():
        _put(conv, "weight_scale", _rows(scale, idx))
    conv.in_channels = conv.out_channels = conv.groups = conv.channels = len(idx)


def shared_groups(heads: str, groups: str, n_heads: int, n_groups: int, rank: int, world: int) -> torch.Tensor:
    """The groups (B/C groups of SSM heads, KV heads of query heads) read by this rank's heads: sharded when
    n_groups % world == 0, else the one group all of this rank's heads share (replicated over its ranks)."""
    h_l = _divide(f"the {heads}", n_heads, world)
    per_group = n_heads // n_groups
    if n_groups % world == 0:
        return _span(rank * n_groups // world, n_groups // world)
    if per_group % h_l == 0:
        return torch.tensor([rank * h_l // per_group])
    raise SSMQError(f"{n_groups} {groups} over {world} ranks: a rank's {h_l} {heads} would straddle {groups} "
                    f"of {per_group} {heads}")


def bc_groups(nheads: int, ngroups: int, rank: int, world: int) -> torch.Tensor:
    return shared_groups("SSM heads", "B/C groups", nheads, ngroups, rank, world)


@torch.no_grad()
def shard_mamba2_(mixer: nn.Module, comm: Communicator, fuse_norm: bool = True) -> int:
    """Shard a Mamba-2 mixer in place; returns its all-reduces per call."""
    c = mixer.cfg
    r, W = comm.rank, comm.world
    d, h, p, g, n = c.d_inner, c.nheads, c.headdim, c.ngroups, c.d_state
    h_l = _divide("the SSM heads", h, W)
    d_l = h_l * p
    heads, ch = _span(r * h_l, h_l), _span(r * d_l, d_l)
    groups = bc_groups(h, g, r, W)
    g_l = len(groups)
    bc = (groups[:, None] * n + torch.arange(n)).reshape(-1)
    seg = mamba2_in_proj_segments(d, g, n, h)
    rows = torch.cat([seg.offset("z") + ch, seg.offset("x") + ch, seg.offset("B") + bc, seg.offset("C") + bc,
                      seg.offset("dt") + heads])
    column_parallel_(mixer.in_proj, rows)
    if mixer._proj_scale is not None:  # Falcon-H1's in_proj multipliers, one per output row
        mixer._proj_scale, mixer._proj_scales = [mixer._proj_scale[i] for i in rows.tolist()], {}
    conv = mamba2_conv_segments(d, g, n)
    _conv_(mixer.conv1d, torch.cat([conv.offset("x") + ch, conv.offset("B") + bc, conv.offset("C") + bc]))
    for name in ("dt_bias", "A_log", "D"):
        _put(mixer, name, _rows(getattr(mixer, name), heads))
    for tap, idx in (("act_x", ch), ("act_z", ch), ("act_y", ch), ("act_dt", heads), ("act_B", bc), ("act_C", bc)):
        _tap_(mixer, tap, idx)
    _state_index_(mixer, ch)
    mixer.cfg = ShardView(c, d_inner=d_l, nheads=h_l, ngroups=g_l, conv_dim=d_l + 2 * g_l * n)
    mixer.proj_segments = mamba2_in_proj_segments(d_l, g_l, n, h_l).fuse(("x", "B", "C"), "xBC")
    mixer.conv_segments = mamba2_conv_segments(d_l, g_l, n)

    ng = norm_group_size(d, g, c.norm_group_size)
    if getattr(mixer.norm, "weight", None) is None:  # the gate alone, no norm: per channel, local
        mixer.out_proj = RowParallel(mixer.out_proj, comm, r * d_l, (r + 1) * d_l, "out_proj")
        return 1
    weight = _rows(mixer.norm.weight, ch)
    before = mixer.norm.norm_before_gate
    if d_l % ng == 0:  # whole norm groups on this rank: the norm is local
        mixer.norm.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        mixer.out_proj = RowParallel(mixer.out_proj, comm, r * d_l, (r + 1) * d_l, "out_proj")
        return 1
    if ng % d_l:
        raise SSMQError(f"gated-norm groups of {ng} channels straddle the {d_l}-channel shards of {W} ranks")
    fusable = (ng == d and fuse_norm and isinstance(mixer.act_y, nn.Identity) and not _is_rotated(mixer.out_proj)
               and (not isinstance(mixer.out_proj, QuantLinear) or mixer.out_proj.act is None))
    mixer.norm = ShardedGatedNorm(weight, mixer.norm.eps, ng, r * d_l // ng, d // ng, comm, partial=fusable,
                                  norm_before_gate=before)
    if fusable:
        mixer.out_proj = FusedNormOutProj(mixer.out_proj, mixer.norm, comm, r * d_l, (r + 1) * d_l)
        return 1
    mixer.out_proj = RowParallel(mixer.out_proj, comm, r * d_l, (r + 1) * d_l, "out_proj")
    return 2


@torch.no_grad()
def shard_mamba1_(mixer: nn.Module, comm: Communicator) -> int:
    r, W = comm.rank, comm.world
    d = mixer.d_inner
    d_l = _divide("d_inner", d, W)
    ch = _span(r * d_l, d_l)
    seg = mamba1_in_proj_segments(d)
    column_parallel_(mixer.in_proj, torch.cat([seg.offset("x") + ch, seg.offset("z") + ch]))
    _conv_(mixer.conv1d, ch)
    mixer.x_proj = RowParallel(mixer.x_proj, comm, r * d_l, (r + 1) * d_l, "x_proj")
    column_parallel_(mixer.dt_proj, ch)
    for name in ("dt_bias", "A_log", "D"):
        _put(mixer, name, _rows(getattr(mixer, name), ch))
    for tap in ("act_x", "act_z", "act_y", "act_dt"):
        _tap_(mixer, tap, ch)
    _state_index_(mixer, ch)
    mixer.d_inner = d_l
    mixer.proj_segments = mamba1_in_proj_segments(d_l)
    mixer.out_proj = RowParallel(mixer.out_proj, comm, r * d_l, (r + 1) * d_l, "out_proj")
    return 2


def kv_heads(hq: int, hkv: int, rank: int, world: int) -> torch.Tensor:
    return shared_groups("attention query heads", "KV heads", hq, hkv, rank, world)


def _head_rows(heads: torch.Tensor, e: int) -> torch.Tensor:
    return (heads[:, None] * e + torch.arange(e)).reshape(-1)


@torch.no_grad()
def shard_attention_(attn: nn.Module, comm: Communicator) -> int:
    r, W = comm.rank, comm.world
    hq_l = _divide("the attention query heads", attn.hq, W)
    q = _span(r * hq_l, hq_l)
    kv = kv_heads(attn.hq, attn.hkv, r, W)
    column_parallel_(attn.q_proj, _head_rows(q, attn.e))
    column_parallel_(attn.k_proj, _head_rows(kv, attn.e))
    column_parallel_(attn.v_proj, _head_rows(kv, attn.e))
    attn.o_proj = RowParallel(attn.o_proj, comm, r * hq_l * attn.e, (r + 1) * hq_l * attn.e, "o_proj")
    attn.hq, attn.hkv = hq_l, len(kv)
    if getattr(attn, "kv_quant", None) is not None:  # a quantized KV cache: the rank's heads of its quantizer
        attn.kv_quant.keep_heads_(kv)
    return 1


@torch.no_grad()
def shard_shared_use_(use: nn.Module, cfg, comm: Communicator) -> int:
    """Shard a Zamba2 block's use of a shared transformer block in place (the block itself by its owning use, once):
    attention and MLP as any, the use's LoRA ups column-parallel with the rows they add to, downs and the output
    linear replicated (the module docstring says why). Returns its all-reduces per call."""
    r, W = comm.rank, comm.world
    e, f_l = cfg.attn_head_dim, _divide("the MLP hidden size", cfg.mlp_hidden, W)
    hq_l = _divide("the attention query heads", cfg.attn_heads, W)
    q = _head_rows(_span(r * hq_l, hq_l), e)
    kv = _head_rows(kv_heads(cfg.attn_heads, cfg.attn_kv_heads, r, W), e)
    for adapter, rows in ((use.q_adapter, q), (use.k_adapter, kv), (use.v_adapter, kv),
                          (use.mlp_adapter, torch.cat([_span(r * f_l, f_l), cfg.mlp_hidden + _span(r * f_l, f_l)]))):
        if adapter is not None:
            column_parallel_(adapter.up, rows)
    if use.block is not None:
        shard_attention_(use.block.attn, comm)
        shard_mlp_(use.block.mlp, comm)
    return 2


def fuse_parallel_sums_(layer: nn.Module, comm: Communicator) -> int:
    """Falcon-H1: the mixer's out_proj and the parallel attention's o_proj give partial sums, and one all-reduce adds
    m_ssm · Σ out_proj + m_attn · Σ o_proj (the µP multipliers are scalars: they commute with the sum; a bias counted
    on rank 0 only is scaled the same). Not where out_proj's all-reduce also carries the norm's sum of squares, or an
    input is rotated. Returns the all-reduces it saves a call (0 or 1)."""
    out, o = layer.mixer.out_proj, layer.attn.o_proj
    if not (type(out) is RowParallel and type(o) is RowParallel) or out.rotated or o.rotated:
        return 0
    out.partial = o.partial = True
    layer.side_sum = functools.partial(comm.all_reduce, name="out_proj+o_proj")
    return 1


@torch.no_grad()
def shard_mlp_(mlp: nn.Module, comm: Communicator) -> int:
    if hasattr(mlp, "experts"):  # a mixture of experts is replicated: every rank runs all of it, no all-reduce
        return 0
    r, W = comm.rank, comm.world
    f_l = _divide("the MLP hidden size", mlp.up_proj.out_features, W)
    rows = _span(r * f_l, f_l)
    if hasattr(mlp, "gate_proj"):  # the squared-ReLU MLP has none
        column_parallel_(mlp.gate_proj, rows)
    column_parallel_(mlp.up_proj, rows)
    mlp.down_proj = RowParallel(mlp.down_proj, comm, r * f_l, (r + 1) * f_l, "down_proj")
    return 1


# ---------------------------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------------------------
@dataclass
class TPInfo:
    rank: int
    world: int
    all_reduces_per_layer: list[int]

    @property
    def all_reduces_per_token(self) -> int:
        return sum(self.all_reduces_per_layer)


def check_tp(cfg, world: int) -> None:
    """Raise SSMQError when ``cfg`` cannot be split over ``world`` ranks (before any loading)."""
    for r in range(world) if cfg.side_attention_layers() else ():  # Falcon-H1's parallel attention, Zamba2's blocks
        kv_heads(cfg.attn_heads, cfg.attn_kv_heads, r, world)
    for i in range(cfg.n_layer):
        kind = cfg.layer_kind(i)
        for r in range(world):
            if kind == "mamba2":
                bc_groups(cfg.nheads, cfg.ngroups, r, world)
            elif kind == "attention":
                kv_heads(cfg.attn_heads, cfg.attn_kv_heads, r, world)
        if kind == "mamba1":
            _divide("d_inner", cfg.d_inner, world)
    if cfg.has_mlp:
        _divide("the MLP hidden size", cfg.mlp_hidden, world)


@torch.no_grad()
def apply_tp(model: nn.Module, comm: Communicator, fuse_norm: bool = True) -> nn.Module:
    """Shard ``model`` (an SSMLM, float or quantized, on any device) in place for ``comm``'s rank.

    fuse_norm: one all-reduce per Mamba-2 block where the maths allows (see the module docstring);
    False keeps two (to measure the difference). Returns the model, with ``model.tp`` (TPInfo); its
    ``allocate_cache`` allocates this rank's share of the cache, since each (sharded) mixer allocates its own
    state from its own sizes: conv (s, conv_dim_l, w-1), SSM (s, d_l, n) | (s, h_l, p, n), KV (s, L, hkv_l, e).
    """
    if getattr(model, "tp", None) is not None:
        raise SSMQError("this model is already sharded")
    check_tp(model.config, comm.world)
    per_layer = []
    for layer in model.layers:
        kind = str(layer.kind)
        if kind == "mamba2":
            k = shard_mamba2_(layer.mixer, comm, fuse_norm)
        elif kind == "mamba1":
            k = shard_mamba1_(layer.mixer, comm)
        else:
            k = shard_attention_(layer.mixer, comm)
        if layer.attn is not None:  # Falcon-H1: attention in parallel with the mixer, their sums added in one
            k += shard_attention_(layer.attn, comm) - fuse_parallel_sums_(layer, comm)
        if layer.shared is not None:  # Zamba2: a shared transformer block before the mixer
            k += shard_shared_use_(layer.shared, model.config, comm)
        if layer.mlp is not None:
            k += shard_mlp_(layer.mlp, comm)
        per_layer.append(k)
    model.tp = TPInfo(comm.rank, comm.world, per_layer)
    model.comm = comm
    return model
