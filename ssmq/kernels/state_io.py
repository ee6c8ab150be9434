"""Triton twins of ``ssmq.ops.quant_ssm.read_state_ref`` / ``write_state_ref``: an int8 SSM state's rows read as
float32 (before a prefill) and a prefill's final state written back as codes (after it), one launch each, where the
references take ~10 small torch ops a layer (2.3-2.7 ms of a Mamba2-2.7B prefill on an H100).

Glossary: s cache slots, b rows of the call, R state rows of a slot (d, or h·p), n d_state, G scale groups.
Both formats of ``ssmq.models.state``: dynamic row scales (``RowScales`` (s, R): the write computes each row's
absmax / 127 and stores it with the codes) and a static (G, n) table with a channel -> group index. Bit for bit the
references' arithmetic: IEEE divisions, products rounded to float32 then half to even.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ssmq.errors import SSMQError
from ssmq.kernels._common import cdiv, pow2, quantize_rne, rne_int8
from ssmq.kernels.state_update import _row_scales, _state_table


@triton.jit
def _table(ss_ptr, sidx_ptr, offs_r, offs_n, mr, m2, s_ssg, s_ssn, s_sidx, HAS_SIDX: tl.constexpr):
    """The (BR, BN) table scales of the rows: index[row] (sort-and-cluster groups) or the row itself (s_ssg 0:
    G = 1)."""
    if HAS_SIDX:
        row = tl.load(sidx_ptr + offs_r * s_sidx, mask=mr, other=0).to(tl.int64)
    else:
        row = offs_r.to(tl.int64)
    return tl.load(ss_ptr + row[:, None] * s_ssg + offs_n[None, :] * s_ssn, mask=m2, other=1.0)


@triton.jit
def _state_io(f_ptr, q_ptr, rs_ptr, ss_ptr, sidx_ptr, idx_ptr, R, n,
              s_fb, s_fr, s_fn, s_qs, s_qr, s_qn, s_rss, s_rsr, s_ssg, s_ssn, s_sidx,
              READ: tl.constexpr, ROWS: tl.constexpr, HAS_SIDX: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr):
    """READ: the slot's int8 rows -> float32 f (b, R, n); else f quantized into them (and their row scales)."""
    pid_b, pid_r = tl.program_id(0), tl.program_id(1)
    slot = tl.load(idx_ptr + pid_b).to(tl.int64)
    offs_r = pid_r * BR + tl.arange(0, BR)
    offs_n = tl.arange(0, BN)
    mr = offs_r < R
    m2 = mr[:, None] & (offs_n < n)[None, :]
    f_ptrs = f_ptr + pid_b * s_fb + offs_r[:, None] * s_fr + offs_n[None, :] * s_fn
    q_ptrs = q_ptr + slot * s_qs + offs_r[:, None] * s_qr + offs_n[None, :] * s_qn
    rs_ptrs = rs_ptr + slot * s_rss + offs_r * s_rsr
    if READ:
        if ROWS:
            sc = tl.load(rs_ptrs, mask=mr, other=0.0)[:, None]
        else:
            sc = _table(ss_ptr, sidx_ptr, offs_r, offs_n, mr, m2, s_ssg, s_ssn, s_sidx, HAS_SIDX)
        tl.store(f_ptrs, tl.load(q_ptrs, mask=m2, other=0).to(tl.float32) * sc, mask=m2)
    else:
        v = tl.load(f_ptrs, mask=m2, other=0.0).to(tl.float32)
        if ROWS:
            amax = tl.max(tl.abs(v), axis=1)
            c127 = tl.full(amax.shape, 127.0, tl.float32)
            inv = tl.where(amax > 0, tl.math.div_rn(c127, tl.maximum(amax, 1e-30)), 0.0)
            q = rne_int8(v * inv[:, None])
            tl.store(rs_ptrs, tl.math.div_rn(amax, c127), mask=mr)
        else:
            q = quantize_rne(v, _table(ss_ptr, sidx_ptr, offs_r, offs_n, mr, m2, s_ssg, s_ssn, s_sidx, HAS_SIDX))
        tl.store(q_ptrs, q, mask=m2)


def _slots(idx, count: int, device) -> torch.Tensor:
    """The slot of each row of the call as an int32 device tensor (``idx`` a slice: all ``count`` slots)."""
    if isinstance(idx, slice):
        if idx != slice(None):
            raise SSMQError(f"state rows as a slice must be all of them (slice(None)), got {idx}")
        return torch.arange(count, device=device, dtype=torch.int32)
    return torch.as_tensor(idx, device=device).to(torch.int32)


def _args(state, state_scale, state_index):
    """(row-scale tensor (s, R) or None, table, index, table row stride, the rows-per-slot view of the state), checked
    as the state-update kernel checks them."""
    if state.dtype != torch.int8 or state_scale is None:
        raise SSMQError(f"state_io handles int8 states with their scales, got a {state.dtype} state")
    s, n = state.shape[0], state.shape[-1]
    q = state.view(s, -1, n)
    rs = _row_scales(state, state_scale, state_index)
    table, index, s_ssg = _state_table(state, state_scale, state_index, q.shape[1])
    return None if rs is None else rs.view(s, -1), table, index, s_ssg, q


def _launch(read: bool, data, state, state_scale, state_index, slots) -> None:
    """One program a (row of the call, BR state rows); data (b, R, n) is what is written (write) or read into."""
    rs, table, index, s_ssg, q = _args(state, state_scale, state_index)
    b, R, n = data.shape
    BN = pow2(n, 16)
    BR = max(1, min(pow2(R), 4096 // BN))  # ~4K values a program
    _state_io[(b, cdiv(R, BR))](
        data, q, rs if rs is not None else q, table if table is not None else q, index if index is not None else q,
        slots, R, n, *data.stride(), *q.stride(), *(rs.stride() if rs is not None else (0, 0)), s_ssg,
        table.stride(1) if table is not None else 0, index.stride(0) if index is not None else 0,
        READ=read, ROWS=rs is not None, HAS_SIDX=index is not None, BR=BR, BN=BN, num_warps=4)


def write_state(state, state_scale, state_index, idx, values) -> None:
    """As ``write_state_ref`` for an int8 state: ``values`` (b, …, n) float quantized into the rows ``idx``."""
    slots = _slots(idx, values.shape[0], state.device)
    _launch(False, values.reshape(values.shape[0], -1, state.shape[-1]), state, state_scale, state_index, slots)


def read_state(state, state_scale, state_index, idx) -> torch.Tensor:
    """As ``read_state_ref`` for an int8 state: the rows ``idx`` as float32 (b, …, n)."""
    slots = _slots(idx, state.shape[0], state.device)
    out = torch.empty((slots.shape[0], *state.shape[1:]), device=state.device, dtype=torch.float32)
    _launch(True, out.view(out.shape[0], -1, state.shape[-1]), state, state_scale, state_index, slots)
    return out
