"""State checkpointing after ReplaySSM (reference, CPU float32): a decode step that writes the big SSM state
only once every K steps.

Glossary (as ``ssmq.ops``): s cache slots, b rows served, h heads, p headdim, g ngroups, n d_state,
d d_inner (Mamba-1 is lifted to h = 1, p = d), K checkpoint interval, R = K - 1 ring entries, G scale groups of
an int8 state.

Each slot keeps its state at a checkpoint (s, h, p, n) — float, or int8 codes with the calibrated (G, n)
scales — plus a ring of the inputs of the steps taken since (``StateRing``). A step recomputes the current
state from checkpoint + ring (``replay``), applies the new token, and then
    ring not full: appends the token's inputs to the ring (a few KB) and leaves the checkpoint alone;
    ring full (R entries): writes the new state as the checkpoint and empties the ring.
So the state is read every step but written once every K steps. The ring holds what the state needs, not what
y needs: x, the discretized Δ and B (C, D and z only shape y, which each step returns as it goes).

Same semantics as K plain steps (``selective_state_update_ref`` / ``quant_state_update_ref``): a float32 state
gives the same states and y (the replay is the plain step, entry by entry). A stored state is rounded to its
format (int8 codes, fp16) only when it is written, so it carries the rounding of one write per K steps instead of
one per step: a replayed int8 (or fp16) state is *more* accurate than the write-every-step one (tests bound the
int8 state's error by checkpoints written · scale / 2, and check it stays below the plain int8 state's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ssmq.ops.layout import discretize_dt
from ssmq.ops.quant_ssm import RowScales, dequantize_ref, read_state_ref, write_state_ref
from ssmq.ops.state_update import selective_state_update_ref


@dataclass
class StateRing:
    """The inputs of the last steps of each slot, in the multi-head layout (Mamba-1: h = 1, p = d).

    x: (s, R, h, p) the step's x (dequantized); dt: (s, R, h, q) the discretized Δ (float32; q = 1 when Δ is
    per head, Mamba-2; q = p for Mamba-1's per-channel Δ); B: (s, R, g, n); count: (s,) int32 entries in use;
    done: (s,) int32, the kernel's tally of a slot's programs finished in the current launch (zero between
    launches: the last program to finish advances ``count``, see ``ssmq.kernels.state_update``).
    Buffers of fixed address (CUDA graphs); ``x`` / ``B`` may be stored in a 16-bit dtype (rounded when
    appended), float32 keeps the replay exact.
    """

    x: torch.Tensor
    dt: torch.Tensor
    B: torch.Tensor
    count: torch.Tensor
    done: torch.Tensor

    @classmethod
    def allocate(cls, slots: int, every: int, h: int, p: int, g: int, n: int, per_head_dt: bool, device,
                 dtype=torch.float32) -> StateRing:
        R = every - 1
        return cls(torch.zeros(slots, R, h, p, dtype=dtype, device=device),
                   torch.zeros(slots, R, h, 1 if per_head_dt else p, dtype=torch.float32, device=device),
                   torch.zeros(slots, R, g, n, dtype=dtype, device=device),
                   torch.zeros(slots, dtype=torch.int32, device=device),
                   torch.zeros(slots, dtype=torch.int32, device=device))

    @property
    def capacity(self) -> int:
        return self.x.shape[1]

    @property
    def every(self) -> int:
        """K: a slot's checkpoint is written once every K steps."""
        return self.capacity + 1

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.x, self.dt, self.B, self.count, self.done))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The buffers in field order: ``StateRing(*(f(t) for t in ring.tensors()))`` maps a ring (copy, move)."""
        return self.x, self.dt, self.B, self.count, self.done


def _lift(t, dim):
    return None if t is None else t.unsqueeze(dim)


def _lift_scale(scale):
    """Mamba-1's state scales as h = 1: row scales (s, d) -> (s, 1, d), a view (writes reach the caller's); a table
    as it is."""
    return RowScales(scale.scale.unsqueeze(1)) if isinstance(scale, RowScales) else scale


def _replay_ring(work, ring: StateRing, idx, A):
    """Advance ``work`` (b, h, p, n) float32 through each row's ring entries: entry j is one plain step
    (``selective_state_update_ref``, Δ already discretized) kept for the rows holding more than j entries.
    Masked, not gathered, over all R entries: no device-to-host read (a prefill's CUDA graph can capture it)."""
    count = ring.count[idx].long()
    b, h, p, n = work.shape
    for j in range(ring.capacity):
        x, dt, B = ring.x[idx, j].float(), ring.dt[idx, j].expand(-1, h, p), ring.B[idx, j].float()
        stepped = work.clone()
        selective_state_update_ref(stepped, x, dt, A, B, torch.zeros_like(B))
        work = torch.where((count > j)[:, None, None, None], stepped, work)
    return work


def replay_state_ref(ckpt, state_scale, state_index, ring: StateRing, A, state_batch_indices=None):
    """The current state of rows ``state_batch_indices`` (b,): checkpoint + ring replayed, float32 (b, h, p, n)
    (Mamba-1: ckpt (s, d, n), A (d, n) -> (b, d, n)). Reads only; a prefill's initial state."""
    multihead = ckpt.dim() == 4
    idx = torch.arange(ckpt.shape[0], device=ckpt.device) if state_batch_indices is None else state_batch_indices.long()
    if not multihead:
        ckpt, A, state_scale = ckpt.unsqueeze(1), A.unsqueeze(0), _lift_scale(state_scale)
    work = _replay_ring(read_state_ref(ckpt, state_scale, state_index, idx), ring, idx, A)
    return work if multihead else work.squeeze(1)


def replay_state_update_ref(ckpt, state_scale, state_index, ring: StateRing, x_q, x_scale, dt, A, B_q, B_scale,
                            C_q, C_scale, D=None, z=None, dt_bias=None, dt_softplus=True, state_batch_indices=None,
                            out_dtype=None):
    """One decode step on a checkpointed state; arguments as ``quant_state_update_ref`` plus the ring.

    ckpt: (s, h, p, n) | (s, d, n), float or int8 codes (``state_scale`` (G, n) with ``state_index`` (d,), or
    ``RowScales``), written in
    place only for rows whose ring is full; ring: ``StateRing`` of the same slots, appended in place (its count
    too). x_q: (b, h, p) | (b, d), int8 with x_scale or float (scale None); dt (b, h, p) | (b, d) (Mamba-2: one
    value per head, e.g. expanded over p); B_q, C_q (b, g, n) | (b, n); D, z, dt_bias as there.
    Returns y (b, h, p) | (b, d): ``out_dtype``, else float32 for int8 x, else x's dtype.
    """
    multihead = ckpt.dim() == 4
    idx = torch.arange(x_q.shape[0], device=x_q.device) if state_batch_indices is None else state_batch_indices.long()
    x = x_q.float() if x_scale is None else dequantize_ref(x_q, x_scale)
    B = B_q if B_scale is None else dequantize_ref(B_q, B_scale)
    C = C_q if C_scale is None else dequantize_ref(C_q, C_scale)
    if not multihead:  # lift Mamba-1 to h = 1
        ckpt, A, state_scale = ckpt.unsqueeze(1), A.unsqueeze(0), _lift_scale(state_scale)
        x, dt, z, B, C = (_lift(t, 1) for t in (x, dt, z, B, C))
        D, dt_bias = _lift(D, 0), _lift(dt_bias, 0)
    work = _replay_ring(read_state_ref(ckpt, state_scale, state_index, idx), ring, idx, A)
    dtf = discretize_dt(dt, dt_bias, dt_softplus)  # (b, h, p): what the ring keeps of Δ
    y = selective_state_update_ref(work, x, dtf, A, B, C, D, z)  # the new token, as a plain step

    count = ring.count[idx].long()
    full = count == ring.capacity
    if full.any():  # the new state becomes the checkpoint, the ring empties
        write_state_ref(ckpt, state_scale, state_index, idx[full], work[full])
    keep = ~full
    src, pos = idx[keep], count[keep]
    ring.x[src, pos] = x[keep].to(ring.x.dtype)
    ring.dt[src, pos] = dtf[keep][..., : ring.dt.shape[-1]]
    ring.B[src, pos] = B[keep].float().to(ring.B.dtype)
    ring.count[idx] = torch.where(full, 0, count + 1).to(ring.count.dtype)
    y = y if multihead else y.squeeze(1)
    return y.to(out_dtype or (torch.float32 if x_q.dtype == torch.int8 else x_q.dtype))
