"""SSMLM: embedding → blocks (norm → mixer [→ norm → MLP]) → final norm → lm_head, for every family.

Each block keeps the residual stream separately (float32 when ``residual_in_fp32``) and
fuses "add residual, then RMSNorm", as mamba_ssm does.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ssmq import kernels
from ssmq.models.act_codes import ActCodes, CodeInput, code_input
from ssmq.models.cache import InferenceCache
from ssmq.models.config import ModelConfig
from ssmq.models.ffn import feed_forward
from ssmq.models.linear import Linear
from ssmq.models.hybrid import Attention
from ssmq.models.mamba1 import Mamba1Mixer
from ssmq.models.mamba2 import Mamba2Mixer
from ssmq.ops.layout import LayerKind

MIXERS = {LayerKind.MAMBA1: Mamba1Mixer, LayerKind.MAMBA2: Mamba2Mixer, LayerKind.ATTENTION: Attention}


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float, residual_in_fp32: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps, self.residual_in_fp32 = eps, residual_in_fp32

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, codes: CodeInput | None = None):
        """Returns (norm(x + residual), x + residual); with ``codes`` (what the A8 linear reading the norm wants),
        the norm's output comes as its int8 ``ActCodes``, quantized in the norm's epilogue."""
        if codes is None:
            return kernels.rms_norm(x, self.weight, self.eps, residual, self.residual_in_fp32)
        q, scale, residual = kernels.rms_norm_quant(x, self.weight, self.eps, residual, self.residual_in_fp32,
                                                    codes.scale, dtype=codes.dtype)
        return ActCodes(q, scale, self.weight.dtype), residual


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.kind = cfg.layer_kind(layer_idx)
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.residual_in_fp32)
        self.mixer = MIXERS[self.kind](cfg, layer_idx)
        self.mlp = feed_forward(cfg, layer_idx)  # GatedMLP, MLP, MoE or None (cfg.ffn_kind)
        self.mlp_norm = None if self.mlp is None else RMSNorm(cfg.d_model, cfg.norm_eps, cfg.residual_in_fp32)
        # Granite scales the mixer's and the feed-forward's outputs before each residual add
        self.out_scale = cfg.residual_multiplier if cfg.residual_multiplier != 1.0 else None

    def forward(self, hidden, residual, cache=None, slots=None, decode: bool = False):
        # an SSM mixer's in_proj is the norm's one reader: when it is an A8 linear, it gets the norm's int8 codes
        normed, residual = self.norm(hidden, residual, code_input(getattr(self.mixer, "in_proj", None)))
        hidden = self.mixer.step(normed, cache, slots) if decode else self.mixer(normed, cache, slots)
        if self.out_scale is not None:
            hidden = hidden * self.out_scale
        if self.mlp is not None:
            normed, residual = self.mlp_norm(hidden, residual)
            hidden = self.mlp(normed)
            if self.out_scale is not None:
                hidden = hidden * self.out_scale
        return hidden, residual


class SSMLM(nn.Module):
    """A Mamba-1, Mamba-2 or hybrid language model with parallel ``forward`` and recurrent ``step``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.norm_f = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.residual_in_fp32)
        self.lm_head = Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embedding.weight

    def _run(self, hidden, cache, slots, decode, num_last_tokens=0):
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, cache, slots, decode)
        if num_last_tokens:
            hidden, residual = hidden[:, -num_last_tokens:], residual[:, -num_last_tokens:]
        hidden, _ = self.norm_f(hidden, residual, code_input(self.lm_head))
        logits = self.lm_head(hidden)
        return logits if self.config.logits_scaling == 1.0 else logits / self.config.logits_scaling

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embedding(input_ids)
        m = self.config.embedding_multiplier
        return hidden if m == 1.0 else hidden * m

    def _slots(self, cache, slots, b, device):
        if cache is None:
            return None
        if slots is None:
            return torch.arange(b, device=device)
        return torch.as_tensor(slots, device=device, dtype=torch.long)

    def forward(self, input_ids: torch.Tensor, cache=None, slots=None, num_last_tokens: int = 0) -> torch.Tensor:
        """input_ids: (b, l) → logits (b, l, vocab), or (b, num_last_tokens, vocab) when that is > 0.

        With a cache, continues the sequences in rows ``slots`` and leaves their states in it.
        """
        slots = self._slots(cache, slots, input_ids.shape[0], input_ids.device)
        logits = self._run(self._embed(input_ids), cache, slots, decode=False, num_last_tokens=num_last_tokens)
        if cache is not None:
            cache.seqlens[slots] += input_ids.shape[1]
        return logits

    def step(self, input_ids: torch.Tensor, cache, slots=None) -> torch.Tensor:
        """input_ids: (b,) one new token per row → logits (b, vocab); advances the rows ``slots`` by one."""
        slots = self._slots(cache, slots, input_ids.shape[0], input_ids.device)
        logits = self._run(self._embed(input_ids), cache, slots, decode=True)
        cache.seqlens[slots] += 1
        return logits

    def allocate_cache(self, max_batch: int, max_seqlen: int, dtype=None, device=None, ssm_dtype=None,
                       kv_keys_before_rope: bool = False, kv_blocks: int | None = None,
                       kv_block_size: int = 16, state_checkpoint: int | None = None) -> InferenceCache:
        """A cache of ``max_batch`` slots; each layer's mixer allocates its own state (its shape, its format).

        The model's own formats by default: an int8-state model gets its int8 SSM state, a KV-quantized one its
        quantized KV cache (its ``KVQuantizer``'s format). dtype: conv/KV buffers (default: the model's); ssm_dtype:
        SSM states (None: the model's own; a float dtype asks for a float state); kv_keys_before_rope: attention caches keys before RoPE and rotates them at read;
        kv_blocks: attention keeps its KV in that many blocks of kv_block_size tokens, handed out through
        ``cache.block_table`` (``ssmq.models.paged_kv``; the serving engine assigns them as sequences grow);
        state_checkpoint: K >= 2 keeps each SSM state at a checkpoint written once every K decode steps plus a ring of
        the steps since (ReplaySSM, ``ssmq.ops.replay_ssm``); None writes the state every step.
        """
        p = self.norm_f.weight  # the embedding may be a quantized module without .weight
        dtype, device = dtype or p.dtype, device or p.device
        table = None
        if kv_blocks is not None:  # attention KV in kv_blocks blocks of kv_block_size tokens (ssmq.models.paged_kv)
            from ssmq.models.paged_kv import BlockTable

            table = BlockTable(max_batch, max_seqlen, kv_block_size, kv_blocks, device)
        states = [layer.mixer.allocate_state(max_batch, max_seqlen, dtype, device, ssm_dtype=ssm_dtype,
                                             kv_keys_before_rope=kv_keys_before_rope, kv_table=table,
                                             state_checkpoint=state_checkpoint)
                  for layer in self.layers]
        cache = InferenceCache(states, torch.zeros(max_batch, dtype=torch.long, device=device), max_seqlen)
        cache.block_table = table
        return cache

    @property
    def device(self) -> torch.device:
        """Where the model runs (read off the final norm: a quantized embedding has no ``.weight``)."""
        return self.norm_f.weight.device

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
