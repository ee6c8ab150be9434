"""SSMLM: embedding → blocks (norm → mixer [→ norm → MLP]) → final norm → lm_head, for every family.

Each block keeps the residual stream separately (float32 when ``residual_in_fp32``) and
fuses "add residual, then RMSNorm", as mamba_ssm does. A block may also run attention beside its mixer
(``ModelConfig.side_attention_layers``), with a KV cache of its own: in parallel, on the mixer's normed input
(Falcon-H1), or one of the model's shared transformer blocks before the mixer (Zamba2, ``ssmq.models.shared_block``).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ssmq.models.act_codes import code_input
from ssmq.models.cache import InferenceCache
from ssmq.models.config import ModelConfig
from ssmq.models.ffn import feed_forward
from ssmq.models.linear import Linear
from ssmq.models.hybrid import Attention
from ssmq.models.mamba1 import Mamba1Mixer
from ssmq.models.mamba2 import Mamba2Mixer
from ssmq.models.norm import RMSNorm
from ssmq.models.shared_block import SharedUse
from ssmq.ops.layout import LayerKind

MIXERS = {LayerKind.MAMBA1: Mamba1Mixer, LayerKind.MAMBA2: Mamba2Mixer, LayerKind.ATTENTION: Attention}


def _scaled(x: torch.Tensor, m: float) -> torch.Tensor:
    return x if m == 1.0 else x * m


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


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
        side = cfg.side_attention_layers()
        k = side.index(layer_idx) if layer_idx in side else None  # its KV is the cache's state n_layer + k
        # Falcon-H1: attention in parallel with the mixer
        self.attn = Attention(cfg, cfg.n_layer + k) if cfg.parallel_attn else None
        # Zamba2: this block's use of a shared transformer block (its adapters and output linear)
        self.shared = SharedUse(cfg, k) if cfg.shared_attn_layer_idx and k is not None else None
        self.mults = (cfg.ssm_out_multiplier, cfg.attn_in_multiplier, cfg.attn_out_multiplier)
        # the sum of the mixer's and the parallel attention's outputs as it leaves the block: itself, or under tensor
        # parallelism the all-reduce of the two row-parallel partial sums (``ssmq.runtime.tp.fuse_parallel_sums_``)
        self.side_sum = _same

    def side(self) -> nn.Module | None:
        """The attention beside the mixer (an ``Attention`` or a ``SharedUse``), which allocates the block's second
        state."""
        return self.attn if self.attn is not None else self.shared

    def forward(self, hidden, residual, cache=None, slots=None, decode: bool = False, embeds=None):
        """hidden, residual: (b, l, d) | (b, d) in decode; ``embeds``: the token embeddings (a shared block reads
        them) -> (hidden, residual)."""
        if self.shared is not None:  # the shared block's output joins the mixer's input, not the residual stream
            stream = hidden if residual is None else residual + hidden.to(residual.dtype)
            normed, _ = self.norm(self.shared(stream, embeds, cache, slots, decode), stream)
            residual = stream
        else:  # an SSM mixer's in_proj, when the norm's one reader and an A8 linear, gets the norm's int8 codes
            reader = getattr(self.mixer, "in_proj", None) if self.attn is None else None
            normed, residual = self.norm(hidden, residual, code_input(reader))
        hidden = self.mixer.step(normed, cache, slots) if decode else self.mixer(normed, cache, slots)
        if self.attn is not None:
            ssm_out, attn_in, attn_out = self.mults
            x = _scaled(normed, attn_in)
            x = self.attn.step(x, cache, slots) if decode else self.attn(x, cache, slots)
            hidden = self.side_sum(_scaled(hidden, ssm_out) + _scaled(x, attn_out))
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
        # Zamba2: a shared transformer block's first use holds it, its later uses borrow it
        uses = [layer.shared for layer in self.layers if layer.shared is not None]
        for use in uses[cfg.shared_blocks:]:
            use.borrow(uses[use.use % cfg.shared_blocks])
        self.norm_f = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.residual_in_fp32)
        self.lm_head = Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embedding.weight

    def _run(self, hidden, cache, slots, decode, num_last_tokens=0):
        residual, embeds = None, hidden
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, cache, slots, decode, embeds)
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
        for m in self.modules():  # decode set-up: quantized linears make their decode GEMV's copy of the codes
            bind = getattr(m, "bind_decode", None)
            if bind is not None:
                bind()
        table = None
        if kv_blocks is not None:  # attention KV in kv_blocks blocks of kv_block_size tokens (ssmq.models.paged_kv)
            from ssmq.models.paged_kv import BlockTable

            table = BlockTable(max_batch, max_seqlen, kv_block_size, kv_blocks, device)
        states = [m.allocate_state(max_batch, max_seqlen, dtype, device, ssm_dtype=ssm_dtype,
                                   kv_keys_before_rope=kv_keys_before_rope, kv_table=table,
                                   state_checkpoint=state_checkpoint)
                  for m in self.state_modules()]
        cache = InferenceCache(states, torch.zeros(max_batch, dtype=torch.long, device=device), max_seqlen)
        cache.block_table = table
        return cache

    def state_modules(self) -> list[nn.Module]:
        """The modules that keep a state in the cache, in the cache's order: each block's mixer, then the attention
        beside a mixer (``Block.side``), block by block."""
        return [layer.mixer for layer in self.layers] + [layer.side() for layer in self.layers if layer.side()]

    @property
    def device(self) -> torch.device:
        """Where the model runs (read off the final norm: a quantized embedding has no ``.weight``)."""
        return self.norm_f.weight.device

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
