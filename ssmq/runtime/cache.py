"""InferenceCache: preallocated per-layer SSM states and KV cache, indexed by batch slot.

Every buffer has a leading slot dimension s (max batch), so decode can run on any
subset of rows (continuous batching) and the buffers never move (CUDA graphs).
    conv_states[i]: (s, conv_dim, w - 1)          Mamba layers
    ssm_states[i]:  (s, d_inner, n) Mamba-1 | (s, h, p, n) Mamba-2
    key_cache[i], value_cache[i]: (s, max_seqlen, hkv, e)   attention layers
    seqlens: (s,) tokens seen per slot
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ssmq.errors import SSMQError
from ssmq.models.config import ModelConfig
from ssmq.ops.layout import LayerKind


@dataclass
class InferenceCache:
    conv_states: list
    ssm_states: list
    key_cache: list
    value_cache: list
    seqlens: torch.Tensor
    max_seqlen: int

    @classmethod
    def allocate(cls, cfg: ModelConfig, max_batch: int, max_seqlen: int, dtype, device, ssm_dtype=None):
        """Zeroed buffers for ``max_batch`` slots; ``ssm_dtype`` defaults to ``dtype`` (as mamba_ssm)."""
        ssm_dtype = ssm_dtype or dtype
        conv, ssm, keys, values = [], [], [], []
        for i in range(cfg.n_layer):
            kind = cfg.layer_kind(i)
            if kind is LayerKind.ATTENTION:
                shape = (max_batch, max_seqlen, cfg.attn_kv_heads, cfg.attn_head_dim)
                conv.append(None), ssm.append(None)
                keys.append(torch.zeros(shape, dtype=dtype, device=device))
                values.append(torch.zeros(shape, dtype=dtype, device=device))
                continue
            conv.append(torch.zeros(max_batch, cfg.conv_dim, cfg.d_conv - 1, dtype=dtype, device=device))
            state = (cfg.d_inner, cfg.d_state) if kind is LayerKind.MAMBA1 else (cfg.nheads, cfg.headdim, cfg.d_state)
            ssm.append(torch.zeros(max_batch, *state, dtype=ssm_dtype, device=device))
            keys.append(None), values.append(None)
        seqlens = torch.zeros(max_batch, dtype=torch.long, device=device)
        return cls(conv, ssm, keys, values, seqlens, max_seqlen)

    @property
    def max_batch(self) -> int:
        return self.seqlens.shape[0]

    def reset(self, slots=None) -> None:
        """Forget the sequences in ``slots`` (all when None) so the slots can take new prompts."""
        idx = slice(None) if slots is None else torch.as_tensor(slots, device=self.seqlens.device, dtype=torch.long)
        for buf in (*self.conv_states, *self.ssm_states, *self.key_cache, *self.value_cache):
            if buf is not None:
                buf[idx] = 0
        self.seqlens[idx] = 0

    def append_kv(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Write k, v (b, l, hkv, e) at ``positions`` (b, l) of the rows ``slots``.

        The bound check reads a device value, so it is skipped while a CUDA graph is being captured
        (the graph runner checks lengths on the host instead).
        """
        capturing = positions.is_cuda and torch.cuda.is_current_stream_capturing()
        if not capturing and int(positions.max()) >= self.max_seqlen:
            raise SSMQError(f"sequence longer than the cache ({self.max_seqlen} tokens); allocate a larger cache")
        kc, vc = self.key_cache[layer], self.value_cache[layer]
        rows = slots[:, None].expand_as(positions)
        kc[rows, positions] = k.to(kc.dtype)
        vc[rows, positions] = v.to(vc.dtype)

    def nbytes(self) -> int:
        bufs = (*self.conv_states, *self.ssm_states, *self.key_cache, *self.value_cache)
        return sum(b.numel() * b.element_size() for b in bufs if b is not None)
