"""The attention half of hybrid models: GQA attention with partial NeoX RoPE and a KV cache, and the gated MLP.

Glossary: b batch, l length, hq query heads, hkv key/value heads, e head dim, r rotary dim, s cache slots.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ssmq import kernels
from ssmq.kernels.dispatch import FLOAT_KV_DECODE, QUANT_KV_DECODE, float_kv_launch, quant_kv_view_launch, select
from ssmq.models.config import ModelConfig
from ssmq.models.layer_plan import LayerPlan
from ssmq.models.linear import Linear
from ssmq.models.state import KVState, RopeAtRead, kernel_decodes


class Attention(nn.Module):
    """``layer_idx``: the index of its KV state in the cache; ``d_in``: the width it reads (default d_model; Zamba2's
    shared blocks read 2·d_model)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, d_in: int | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.hq, self.hkv, self.e = cfg.attn_heads, cfg.attn_kv_heads, cfg.attn_head_dim
        self.rotary_dim, self.rope_theta = cfg.rotary_dim, cfg.rope_theta
        d_in = d_in or cfg.d_model
        self.q_proj = Linear(d_in, self.hq * self.e, bias=cfg.attn_bias)
        self.k_proj = Linear(d_in, self.hkv * self.e, bias=cfg.attn_bias)
        self.v_proj = Linear(d_in, self.hkv * self.e, bias=cfg.attn_bias)
        self.o_proj = Linear(self.hq * self.e, cfg.d_model, bias=cfg.attn_bias)
        # a softmax scale other than 1/sqrt(e) (Granite's attention_multiplier) is applied to the queries, so that every
        # attention kernel keeps its 1/sqrt(e); Falcon-H1's key multiplier scales the keys as they are cached
        self.q_scale = cfg.attn_scale * self.e ** 0.5 if cfg.attn_scale else None
        self.k_scale = cfg.attn_key_multiplier if cfg.attn_key_multiplier != 1.0 else None
        self.kv_quant = None  # a calibrated KVQuantizer (ssmq.models.kv_quantizer) when the KV cache is quantized

    def allocate_state(self, max_batch: int, max_seqlen: int, dtype, device, kv_keys_before_rope: bool = False,
                       kv_table=None, **_):
        """K, V (s, max_seqlen, hkv, e); ``kv_keys_before_rope``: keys cached before RoPE, rotated at read.
        With a KV quantizer the state is quantized (its spec says whether keys are cached before RoPE); with
        ``kv_table`` (a ``BlockTable``) either is paged."""
        if self.kv_quant is not None:
            from ssmq.models.quant_kv import QuantKVState

            pre = self.kv_quant.kv.keys.pre_rope and self.rotary_dim
            state = QuantKVState(self.kv_quant, max_batch, max_seqlen, dtype, device,
                                 RopeAtRead(self.rotary_dim, self.rope_theta) if pre else None, table=kv_table)
        else:
            rope = RopeAtRead(self.rotary_dim, self.rope_theta) if kv_keys_before_rope and self.rotary_dim else None
            if kv_table is not None:  # paged: blocks of a pool shared by the slots, through the model's block table
                from ssmq.models.paged_kv import PagedKVState

                state = PagedKVState.allocate(kv_table, max_seqlen, self.hkv, self.e, dtype, device, rope)
            else:
                state = KVState.allocate(max_batch, max_seqlen, self.hkv, self.e, dtype, device, rope)
        state.plan = self.plan(state)
        return state

    def plan(self, state) -> LayerPlan:
        """The KV decode kernel that ``kernels.dispatch``'s selection tables give this layer's cache on CUDA;
        ``attention_ref`` over the rows read out for caches no decode kernel takes (keys rotated at read, float32)."""
        table = getattr(state, "table", None)
        block, rope = 0 if table is None else table.block_size, state.rope
        formats = {"kv": str(state.k.dtype if self.kv_quant is None else self.kv_quant.extra_repr())
                   .removeprefix("torch.") + (", paged" if block else "") + (", keys before RoPE" if rope else "")}
        if self.kv_quant is None:
            kernel = select(FLOAT_KV_DECODE, float_kv_launch(state.k.dtype, self.e)) \
                if kernel_decodes(state.k, rope, cuda=True) else "attention_ref"
            return LayerPlan("kv-float", None, (kernel,), formats)
        k, v = state.k.view(), state.v.view()
        kernel = "attention_ref" if k is None or v is None else select(
            QUANT_KV_DECODE, quant_kv_view_launch(k, v, rope.rotary_dim if rope else 0, self.hq // self.hkv, block))
        return LayerPlan("kv-quant", None, (kernel,), formats)

    def kv_bytes_per_token(self, dtype) -> float:
        """Bytes one token takes in this layer's cache (``allocate_state``'s, float in ``dtype`` or quantized as
        ``QuantKVState`` stores it; the sink and per-layer constants aside): what a KV block pool is sized by."""
        if self.kv_quant is not None:
            return self.kv_quant.kv.bits_per_token(self.hkv, self.e, as_stored=True) / 8
        return 2 * self.hkv * self.e * torch.empty((), dtype=dtype).element_size()

    def decode_workspace_bytes_per_token(self) -> int:
        """Bytes a token of a paged KV pool adds to this layer's decode workspace: with sparse outliers, the score
        buffer of the outlier passes, hq float32 a token of the pool (``kernels.kv_decode_fast.
        outlier_workspace_shape``); transient, so a model needs its largest layer's, not the sum."""
        kvq = self.kv_quant
        if kvq is None or not (kvq.outlier_slots("keys") or kvq.outlier_slots("values")):
            return 0
        return 4 * self.hq

    def _rotate(self, t: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """t: (b, l, heads, e); positions: (b, l) → RoPE of the first rotary_dim channels of each head."""
        return kernels.rope(t, positions, self.rotary_dim, self.rope_theta)

    def _cached_view(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        """Keys (post-RoPE) and values as a cache would hand them back: k, v (b, l, hkv, e) through the KV
        quantizer's quantize-dequantize (keys before or after RoPE, as its spec says) when there is one."""
        kvq = self.kv_quant
        pre = kvq is not None and kvq.kv.keys.pre_rope
        k = self._rotate(kvq.fake_quant(k, positions, "keys") if pre else k, positions)
        if kvq is not None:
            k = k if pre else kvq.fake_quant(k, positions, "keys")
            v = kvq.fake_quant(v, positions, "values")
        return k, v

    def forward(self, hidden: torch.Tensor, cache=None, slots=None, state_idx: int | None = None,
                deltas: tuple | None = None) -> torch.Tensor:
        """hidden: (b, l, d_in) → (b, l, d_model). With a cache, appends to the rows ``slots`` of its state
        ``cache.states[state_idx]`` (default ``layer_idx``). ``deltas``: (q, k, v) (b, l, ·) added to the projections
        (a shared block's per-use adapters)."""
        b, l, _ = hidden.shape
        start = torch.zeros(b, dtype=torch.long, device=hidden.device) if cache is None else cache.seqlens[slots]
        positions = start[:, None] + torch.arange(l, device=hidden.device)
        q, k, v = self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)
        if deltas is not None:
            q, k, v = q + deltas[0], k + deltas[1], v + deltas[2]
        q = q if self.q_scale is None else q * self.q_scale
        k = k if self.k_scale is None else k * self.k_scale
        q = self._rotate(q.view(b, l, self.hq, self.e), positions)
        k = k.view(b, l, self.hkv, self.e)
        v = v.view(b, l, self.hkv, self.e)
        if cache is None:
            out = kernels.prefill_attention(q, *self._cached_view(k, v, positions))
        else:
            state = cache.states[self.layer_idx if state_idx is None else state_idx]
            state.append(slots, positions, k if state.keys_before_rope else self._rotate(k, positions), v)
            if l == 1:  # the caches' decode kernels
                out = state.decode(q[:, 0], slots, start + 1)
                out = None if out is None else out[:, None].to(q.dtype)
            else:  # their prefill kernels: the cache read in place, up to each row's length
                out = state.prefill(q, slots, start + l)
            if out is None:
                keys, values = state.read(slots, start + l)  # the served rows, up to their longest length
                out = kernels.prefill_attention(q, keys, values, kv_lens=start + l)
        return self.o_proj(out.reshape(b, l, self.hq * self.e))

    def step(self, hidden: torch.Tensor, cache, slots: torch.Tensor, state_idx: int | None = None,
             deltas: tuple | None = None) -> torch.Tensor:
        """hidden: (b, d_in), one token per row → (b, d_model)."""
        deltas = None if deltas is None else tuple(t.unsqueeze(1) for t in deltas)
        return self.forward(hidden.unsqueeze(1), cache, slots, state_idx, deltas).squeeze(1)


ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu}


class GatedMLP(nn.Module):
    """down(act(gate(x)) · up(x)), act SiLU or GELU (``cfg.mlp_act``); with ``cfg.mlp_multipliers`` (g, m):
    m · down(act(g · gate(x)) · up(x)) (Falcon-H1)."""

    def __init__(self, cfg: ModelConfig, hidden: int | None = None):
        super().__init__()
        hidden = hidden or cfg.mlp_hidden
        self.gate_proj = Linear(cfg.d_model, hidden, bias=False)
        self.up_proj = Linear(cfg.d_model, hidden, bias=False)
        self.down_proj = Linear(hidden, cfg.d_model, bias=False)
        self.act = ACTIVATIONS[cfg.mlp_act if cfg.mlp_act in ACTIVATIONS else "silu"]
        self.gate_scale, self.down_scale = cfg.mlp_multipliers or (None, None)

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        """x: (..., d_model) -> (..., d_model); ``delta`` (..., 2·hidden): added to [gate | up] (a shared block's
        per-use adapter)."""
        gate, up = self.gate_proj(x), self.up_proj(x)
        if delta is not None:
            dg, du = delta.chunk(2, dim=-1)
            gate, up = gate + dg, up + du
        if self.gate_scale is not None:
            gate = gate * self.gate_scale
        out = self.down_proj(self.act(gate) * up)
        return out if self.down_scale is None else out * self.down_scale
