"""Per-layer inference state: what one layer keeps between tokens, in its storage format.

Glossary: s cache slots (max batch), b rows served, c conv channels, w d_conv, d d_inner, n d_state,
h heads, p headdim, G scale groups of the int8 state, L max_seqlen, hkv key/value heads, e head dim,
K checkpoint interval (a checkpointed state's ring holds K - 1 steps).

Each state is allocated by its mixer (so a sharded mixer allocates its shard) and owned by the
slot-indexed ``InferenceCache``. Every buffer has a leading slot dimension s and never moves (CUDA
graphs capture its address). Mixers and kernels use only these ops:
    MambaState   conv (s, c, w-1) buffer for the conv kernels, read_ssm / write_ssm around a prefill,
                 step_ssm (one kernel, any format) or update_ssm (a float step function) for a decode step,
                 reset, nbytes
    KVState      append after the projections, read for attention (decode: the flash-decoding kernel on CUDA),
                 reset, nbytes
Each op touches the rows ``slots`` it serves and nothing else: ``step_ssm`` reads and writes them in place in
their stored format (int8 codes dequantized and re-quantized in registers); ``update_ssm`` on an int8 state
dequantizes them into a (b, …) float32 work copy, never all s slots.

Storage formats (``StateFormat``): float (the buffer's dtype), int8 (SSM state codes with their
calibrated scales, Quamba2, or with a dynamic scale per row, ``row_scale`` (s, d) | (s, h, p), rewritten at every
write). Either SSM format may be checkpointed (``checkpoint_every`` K, ReplaySSM,
``ssmq.ops.replay_ssm``): ``ssm`` then holds each slot's state at its last checkpoint and ``ring`` the inputs of
the steps since; the ops above see the current state (replayed) and write the big buffer once every K steps.
The seams for later formats: a paged KV format replaces KVState's
append/read with a block table (``paged_kv``); the quantized KV format stores codes + scales + sparse
outliers (``quant_kv``, KVQuant and the engines' formats); a tensor-parallel state is the state its sharded
mixer allocates (fewer channels / heads).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import torch

from ssmq import kernels
from ssmq.errors import SSMQError
from ssmq.kernels.dispatch import FLOAT_KV_DECODE, float_kv_launch, select
from ssmq.ops.attention import check_fits, read_extent
from ssmq.ops.replay_ssm import StateRing, replay_state_ref


class StateFormat(str, Enum):
    FLOAT = "float"
    INT8 = "int8"
    PAGED = "paged"  # KV in fixed-size blocks through a block table (ssmq.models.paged_kv)
    QUANT = "quant"  # KV as codes + scales + sparse outliers (ssmq.models.quant_kv)

    def __str__(self) -> str:
        return self.value


@dataclass
class Int8StateScales:
    """Scales of an int8 SSM state: static, ``scale`` (G, n) float32 and the channel -> group map ``index`` (d,)
    (None: G = 1 or G = d), Quamba2's d_state × G scales; or ``rows``: dynamic, one scale per (slot, channel) row
    that the state keeps beside its codes and rewrites at every write (``scale`` None). See ``ssmq.ops.quant_ssm``."""

    scale: torch.Tensor | None
    index: torch.Tensor | None = None
    rows: bool = False


def _rows(slots) -> torch.Tensor | slice:
    return slice(None) if slots is None else slots


def ids_on_device(ids: list, device: torch.device) -> torch.Tensor:
    """Python ints (slots, token ids) as a long tensor on ``device``. On CUDA through pinned memory and without
    waiting: a plain host -> device copy waits for the device's queue, i.e. for a decode step in flight."""
    t = torch.tensor(ids, dtype=torch.long)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def slot_rows(slots, device: torch.device) -> torch.Tensor:
    """Slots (an int, ints or a tensor) as a (b,) int64 tensor on ``device``, Python ints through ``ids_on_device``
    (no wait on the device's queue)."""
    if isinstance(slots, torch.Tensor):
        return slots.reshape(-1).to(device, torch.int64, non_blocking=True)
    return ids_on_device([slots] if isinstance(slots, int) else list(slots), device)


def fill_rows(t: torch.Tensor, slots, value=0) -> None:
    """t[slots] = value without a host tensor: indexed assignment of a Python number copies it to the device and
    waits for that copy (so for the device's queue: a decode step in flight), which a CUDA-graph capture (prefill
    pieces write their final state through here) refuses; index_fill_ takes it as a kernel argument."""
    if slots is None:
        t.fill_(value)
    else:
        t.index_fill_(0, torch.as_tensor(slots, device=t.device), value)


class MambaState:
    """Conv and SSM state of one Mamba layer.

    conv: (s, c, w-1) in the activation dtype; ssm: (s, d, n) Mamba-1 | (s, h, p, n) Mamba-2, float or int8
    codes (with ``scales``); ring: None, or the ``StateRing`` of a checkpointed state (then ``ssm`` holds the
    checkpoints).
    """

    def __init__(self, conv: torch.Tensor, ssm: torch.Tensor, scales: Int8StateScales | None = None,
                 ring: StateRing | None = None, row_scale: torch.Tensor | None = None):
        if ssm.dtype == torch.int8 and scales is None:
            raise SSMQError("an int8 SSM state needs calibrated scales: quantize the model with an int8-state "
                            "recipe (state_bits 8), or allocate a float state")
        if scales is not None and scales.rows and (row_scale is None or row_scale.shape != ssm.shape[:-1]):
            raise SSMQError(f"an int8 state with row scales needs a {tuple(ssm.shape[:-1])} scale buffer")
        self.conv, self.ssm, self.scales, self.ring, self.row_scale = conv, ssm, scales, ring, row_scale
        self.plan = None  # the layer's LayerPlan, set by the mixer that allocates the state

    @classmethod
    def allocate(cls, max_batch: int, conv_channels: int, d_conv: int, state_shape: tuple[int, ...], dtype, device,
                 ssm_dtype=None, scales: Int8StateScales | None = None, checkpoint_every: int | None = None,
                 bc_groups: int = 1, ring_dtype=torch.float32) -> MambaState:
        """Zeroed buffers for ``max_batch`` slots; ``ssm_dtype`` defaults to ``dtype`` (as mamba_ssm).

        ``checkpoint_every`` K >= 2 checkpoints the SSM state (ReplaySSM): a ring of K - 1 steps' inputs per slot
        (x, Δ, B of ``bc_groups`` groups, in ``ring_dtype``; float32 replays exactly) beside the state buffer.
        """
        ssm_dtype = ssm_dtype or dtype
        conv = torch.zeros(max_batch, conv_channels, d_conv - 1, dtype=dtype, device=device)
        ssm = torch.zeros(max_batch, *state_shape, dtype=ssm_dtype, device=device)
        ring = None
        if checkpoint_every is not None:
            if int(checkpoint_every) < 2:
                raise SSMQError(f"state checkpoint interval must be >= 2 steps, got {checkpoint_every} "
                                "(1 is plain decode: leave the option off)")
            *lead, n = state_shape
            h, p = (1, lead[0]) if len(lead) == 1 else lead  # Mamba-1 lifted to one head of d channels
            ring = StateRing.allocate(max_batch, int(checkpoint_every), h, p, bc_groups, n, len(lead) == 2, device,
                                      ring_dtype)
        scales = scales if ssm_dtype == torch.int8 else None
        row_scale = None
        if scales is not None and scales.rows:  # (s, d) | (s, h, p): 4 bytes a row of n codes
            row_scale = torch.zeros(max_batch, *state_shape[:-1], dtype=torch.float32, device=device)
        return cls(conv, ssm, scales, ring, row_scale)

    @property
    def format(self) -> StateFormat:
        return StateFormat.INT8 if self.ssm.dtype == torch.int8 else StateFormat.FLOAT

    # ------------------------------------------------------------------ conv
    def read_conv(self, slots) -> torch.Tensor:
        """(b, c, w-1): the last w-1 conv inputs of the rows ``slots``."""
        return self.conv[_rows(slots)]

    def write_conv(self, slots, values: torch.Tensor) -> None:
        self.conv[_rows(slots)] = values.to(self.conv.dtype)

    # ------------------------------------------------------------------ ssm
    @property
    def checkpoint_every(self) -> int | None:
        """K when the state is checkpointed (ReplaySSM), else None."""
        return None if self.ring is None else self.ring.every

    def _table(self):
        """(state_scale, state_index) as the state ops take them: None for a float state, the (G, n) table and its
        index, or ``RowScales`` of this state's row-scale buffer."""
        if self.format is not StateFormat.INT8:
            return None, None
        if self.scales.rows:
            from ssmq.ops.quant_ssm import RowScales

            return RowScales(self.row_scale), None
        return self.scales.scale, self.scales.index

    def read_ssm(self, slots, A: torch.Tensor | None = None) -> torch.Tensor:
        """The rows ``slots`` as a prefill's initial state: (b, d, n) | (b, h, p, n), float (int8 dequantized).

        A checkpointed state replays each row's ring, which needs the layer's A ((d, n) | (h, p, n), as the step's).
        """
        if self.ring is not None:
            if A is None:
                raise SSMQError("a checkpointed SSM state replays its ring when read: pass the layer's A")
            idx = torch.arange(self.ssm.shape[0], device=self.ssm.device) if slots is None else \
                torch.as_tensor(slots, device=self.ssm.device)
            return replay_state_ref(self.ssm, *self._table(), self.ring, A, idx)
        if self.format is StateFormat.INT8:
            return kernels.read_state(self.ssm, *self._table(), _rows(slots))
        return self.ssm[_rows(slots)]

    def rows_in_place(self, slots) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the SSM buffer, the rows ``slots`` as a (b,) int64 tensor on its device) for a prefill scan that reads
        and writes a float state in place (``kernels.ssd_chunk_scan``'s ``state_rows``); None for an int8 or a
        checkpointed state, which go through ``read_ssm`` and ``write_ssm``."""
        if self.format is not StateFormat.FLOAT or self.ring is not None:
            return None
        dev = self.ssm.device
        rows = torch.arange(self.ssm.shape[0], device=dev) if slots is None else slot_rows(slots, dev)
        return self.ssm, rows

    def write_ssm(self, slots, values: torch.Tensor) -> None:
        """Store a prefill's final state (b, …) in the rows ``slots``, in this state's format (checkpointed: as the
        rows' checkpoint, their rings emptied)."""
        if self.ring is not None:
            fill_rows(self.ring.count, slots)
        if self.format is StateFormat.INT8:
            kernels.write_state(self.ssm, *self._table(), _rows(slots), values)
        else:
            self.ssm[_rows(slots)] = values.to(self.ssm.dtype)

    def update_ssm(self, slots: torch.Tensor, step: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor],
                   A: torch.Tensor | None = None):
        """One decode step of the rows ``slots``: ``step(state, indices)`` advances ``state`` in place and returns y.

        Float: ``step(self.ssm, slots)`` (the kernel updates the served rows in place). Int8: the served rows
        are dequantized into a (b, …) work copy, stepped with ``indices=None``, and written back re-quantized
        (exactly ``ssmq.ops.quant_ssm.quant_state_update_ref``). Checkpointed: ``step`` does not give the step's
        inputs to the ring, so the current state is replayed into a work copy and written as the checkpoint (every
        step: correct, but none of the savings of ``step_ssm``); needs A as ``read_ssm``.
        """
        if self.format is StateFormat.FLOAT and self.ring is None:
            return step(self.ssm, slots)
        work = self.read_ssm(slots, A).float()
        y = step(work, None)
        self.write_ssm(slots, work)
        return y

    def step_ssm(self, slots: torch.Tensor, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                 x_scale=None, B_scale=None, C_scale=None, out_dtype=None) -> torch.Tensor:
        """One decode step of the rows ``slots`` in one op, whatever the formats (``kernels.quant_state_update``).

        The state is read and written as stored: float, or int8 codes with this state's scales (no float work
        copy). x, B, C are int8 codes with their scales (quantized taps) or float (scale None). Shapes as
        ``kernels.selective_state_update``: x (b, d) | (b, h, p), B, C (b, n) | (b, g, n). Returns y in
        ``out_dtype`` (default: float32 for int8 x, else x's dtype). Equal to ``update_ssm`` with the float step on
        dequantized inputs. A checkpointed state steps through ``kernels.replay_state_update`` (replays the ring,
        writes the state once every K steps).
        """
        scale, index = self._table()
        if self.ring is not None:
            return kernels.replay_state_update(self.ssm, scale, index, self.ring, x, x_scale, dt, A, B, B_scale, C,
                                               C_scale, D, z, dt_bias, dt_softplus, slots, out_dtype)
        return kernels.quant_state_update(self.ssm, scale, index, x, x_scale, dt, A, B, B_scale, C, C_scale, D, z,
                                          dt_bias, dt_softplus, slots, out_dtype)

    # ------------------------------------------------------------------ bookkeeping
    def reset(self, slots=None) -> None:
        fill_rows(self.conv, slots)
        fill_rows(self.ssm, slots)
        if self.row_scale is not None:
            fill_rows(self.row_scale, slots)
        if self.ring is not None:
            fill_rows(self.ring.count, slots)  # stale entries past the count are never read
            fill_rows(self.ring.done, slots)  # the kernel's tally (a CUDA graph's scratch slot may leave one)

    def nbytes(self) -> int:
        return self.conv_nbytes() + self.ssm_nbytes()

    def conv_nbytes(self) -> int:
        return self.conv.numel() * self.conv.element_size()

    def ssm_nbytes(self) -> int:
        """The SSM state's bytes, its checkpoint ring included."""
        ring = 0 if self.ring is None else self.ring.nbytes()
        rows = 0 if self.row_scale is None else self.row_scale.numel() * self.row_scale.element_size()
        return self.ssm.numel() * self.ssm.element_size() + ring + rows


@dataclass(frozen=True)
class RopeAtRead:
    """Keys are cached before RoPE and rotated when read (NeoX rotation of the first ``rotary_dim`` dims)."""

    rotary_dim: int
    theta: float


def kernel_decodes(k: torch.Tensor, rope, cuda: bool | None = None) -> bool:
    """Whether a float KV cache k (…, hkv, e) decodes through ``kernels.float_kv_decode``: float16 / bfloat16 keys
    stored after RoPE, on CUDA (``cuda``: whether it would, for a cache elsewhere), head dims that are powers of two,
    16 or more (the kernel's tiles); the GPU tests cover these. (float32 caches keep the reference path: float32 end
    to end, as their users ask.)"""
    e = k.shape[-1]
    return (rope is None and k.dtype in (torch.float16, torch.bfloat16) and (k.is_cuda if cuda is None else cuda)
            and e >= 16 and not e & (e - 1))


def float_kv_kernel(k: torch.Tensor, rope, cuda: bool | None = None) -> str:
    """The kernel that decodes a float KV cache k (…, hkv, e) (``cuda`` as ``kernel_decodes``): ``FLOAT_KV_DECODE``'s
    choice for the caches ``kernel_decodes`` takes, else "attention_ref" (the caller reads the rows out)."""
    return select(FLOAT_KV_DECODE, float_kv_launch(k.dtype, k.shape[-1])) if kernel_decodes(k, rope, cuda) \
        else "attention_ref"


class KVState:
    """Keys and values of one attention layer: k, v (s, L, hkv, e) in the activation dtype.

    With ``rope`` set, keys are stored before RoPE and rotated at read for positions 0..len-1
    (equal to the post-RoPE cache in float: the same rotation of the same numbers, done later).
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor, rope: RopeAtRead | None = None):
        self.k, self.v, self.rope = k, v, rope
        self.plan = None  # the layer's LayerPlan, set by the attention layer that allocates the cache

    @classmethod
    def allocate(cls, max_batch: int, max_seqlen: int, kv_heads: int, head_dim: int, dtype, device,
                 rope: RopeAtRead | None = None) -> KVState:
        shape = (max_batch, max_seqlen, kv_heads, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device), rope)

    format = StateFormat.FLOAT

    @property
    def max_seqlen(self) -> int:
        return self.k.shape[1]

    @property
    def keys_before_rope(self) -> bool:
        return self.rope is not None

    def append(self, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v (b, l, hkv, e) at ``positions`` (b, l) of the rows ``slots`` (keys pre-RoPE when
        ``keys_before_rope``). The bound check reads a device value, so it is skipped while a CUDA graph is
        being captured (the graph runner checks lengths on the host instead)."""
        check_fits(positions, self.max_seqlen)
        rows = slots[:, None].expand_as(positions)
        self.k[rows, positions] = k.to(self.k.dtype)
        self.v[rows, positions] = v.to(self.v.dtype)

    def read(self, slots: torch.Tensor, kv_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (post-RoPE) and values of the rows ``slots``: (b, T, hkv, e) each, valid up to ``kv_lens`` (b,).

        T = the longest of ``kv_lens`` (one device-to-host read), so a step copies only the positions its rows
        hold; while a CUDA graph is captured T = L (static shapes, no host read; the mask hides the rest).
        """
        end = read_extent(kv_lens, self.max_seqlen)
        keys, values = self.k[slots, :end], self.v[slots, :end]
        if self.rope is not None:
            keys = kernels.rope(keys, torch.arange(end, device=keys.device).expand(keys.shape[0], end),
                                self.rope.rotary_dim, self.rope.theta)
        return keys, values

    def decode(self, q: torch.Tensor, slots: torch.Tensor, kv_lens: torch.Tensor) -> torch.Tensor | None:
        """Attention of one query per row, q (b, hq, e) post-RoPE, over the rows' cache up to ``kv_lens`` (b,):
        (b, hq, e) float32 from the layer plan's KV executor (``plan.decode``: the flash-decoding kernel chosen when
        the cache was allocated, ``kernels.float_kv_decode``; the lengths read on the device, so a CUDA graph
        captures the step, and each row reads its own length, not the longest); None where the plan has none (the
        caller reads the prefix and runs ``attention_ref``: on CPU, for keys rotated at read, for float32 caches)."""
        run = self.plan.decode
        return None if run is None else run(q, slots, kv_lens, self.k, self.v)

    def prefill(self, q: torch.Tensor, slots: torch.Tensor, kv_lens: torch.Tensor) -> torch.Tensor | None:
        """Attention of a chunk of queries per row, q (b, l, hq, e) post-RoPE, the last l of each row's ``kv_lens``
        (b,) tokens: (b, l, hq, e) from the prefill kernel reading the cache in place up to each row's length
        (``kernels.prefill_attention``; ``read`` copies the rows' prefix, and the whole capacity while a prefill
        graph is captured) for the caches ``kernel_decodes`` takes; None otherwise (the caller reads the prefix)."""
        if not kernel_decodes(self.k, self.rope):
            return None
        return kernels.prefill_attention(q, self.k, self.v, kv_lens, slots=slots)

    def reset(self, slots=None) -> None:
        fill_rows(self.k, slots)
        fill_rows(self.v, slots)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v))
