"""The attention half of hybrid models: GQA attention with partial NeoX RoPE and a KV cache, and the gated MLP.

Glossary: b batch, l length, hq query heads, hkv key/value heads, e head dim, r rotary dim, s cache slots.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ssmq import ops
from ssmq.models.config import ModelConfig
from ssmq.models.linear import Linear


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.hq, self.hkv, self.e = cfg.attn_heads, cfg.attn_kv_heads, cfg.attn_head_dim
        self.rotary_dim, self.rope_theta = cfg.rotary_dim, cfg.rope_theta
        self.q_proj = Linear(cfg.d_model, self.hq * self.e, bias=cfg.attn_bias)
        self.k_proj = Linear(cfg.d_model, self.hkv * self.e, bias=cfg.attn_bias)
        self.v_proj = Linear(cfg.d_model, self.hkv * self.e, bias=cfg.attn_bias)
        self.o_proj = Linear(self.hq * self.e, cfg.d_model, bias=cfg.attn_bias)

    def _qkv(self, hidden: torch.Tensor, positions: torch.Tensor):
        """hidden: (b, l, d_model); positions: (b, l) → rotated q (b, l, hq, e), k, v (b, l, hkv, e)."""
        b, l, _ = hidden.shape
        q = self.q_proj(hidden).view(b, l, self.hq, self.e)
        k = self.k_proj(hidden).view(b, l, self.hkv, self.e)
        v = self.v_proj(hidden).view(b, l, self.hkv, self.e)
        if self.rotary_dim:
            cos, sin = ops.rotary_cos_sin(positions, self.rotary_dim, self.rope_theta)
            q, k = ops.apply_rotary_ref(q, cos, sin), ops.apply_rotary_ref(k, cos, sin)
        return q, k, v

    def forward(self, hidden: torch.Tensor, cache=None, slots=None) -> torch.Tensor:
        """hidden: (b, l, d_model) → (b, l, d_model). With a cache, appends to the rows ``slots``."""
        b, l, _ = hidden.shape
        start = torch.zeros(b, dtype=torch.long, device=hidden.device) if cache is None else cache.seqlens[slots]
        positions = start[:, None] + torch.arange(l, device=hidden.device)
        q, k, v = self._qkv(hidden, positions)
        if cache is None:
            out = ops.attention_ref(q, k, v)
        else:
            cache.append_kv(self.layer_idx, slots, positions, k, v)
            # eager prefill reads the filled prefix; decode and graph capture read the whole buffer
            # (a static shape, no device-to-host read), masked by kv_lens
            capturing = hidden.is_cuda and torch.cuda.is_current_stream_capturing()
            end = int(positions.max()) + 1 if l > 1 and not capturing else cache.max_seqlen
            keys, values = cache.key_cache[self.layer_idx][slots, :end], cache.value_cache[self.layer_idx][slots, :end]
            out = ops.attention_ref(q, keys, values, kv_lens=start + l)
        return self.o_proj(out.reshape(b, l, self.hq * self.e))

    def step(self, hidden: torch.Tensor, cache, slots: torch.Tensor) -> torch.Tensor:
        """hidden: (b, d_model), one token per row → (b, d_model)."""
        return self.forward(hidden.unsqueeze(1), cache, slots).squeeze(1)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) · up(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.d_model, cfg.mlp_hidden, bias=False)
        self.up_proj = Linear(cfg.d_model, cfg.mlp_hidden, bias=False)
        self.down_proj = Linear(cfg.mlp_hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
