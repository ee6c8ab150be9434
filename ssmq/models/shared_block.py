"""Zamba2's shared transformer blocks: one block's weights used at several depths, each use with its own adapters.

Glossary: b batch, l length, d d_model, r adapter rank, f MLP hidden size.

A ``SharedBlock`` is RMSNorm(2d) → attention reading 2d → RMSNorm(d) → gated GELU MLP, with no residual inside.
Block j of ``cfg.shared_attn_layer_idx`` holds a ``SharedUse``: the k-th use of shared block b = k mod
``cfg.shared_blocks``, which the block's first use holds (``layers.j.shared.block``: stored, and quantized, once, as
the checkpoints of the family store it) and later uses borrow; each use has its LoRA adapters (on the MLP's [gate | up], and on q, k, v
when ``cfg.shared_attn_adapters``), its own KV cache (the cache's state n_layer + k) and a linear (d, d) after the
block. Its input is the residual stream concatenated with the token embeddings; its output is added to the input
of the block's mixer norm (``Block.forward``).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ssmq.models.config import ModelConfig
from ssmq.models.hybrid import Attention, GatedMLP
from ssmq.models.linear import Linear
from ssmq.models.norm import RMSNorm


class LoRA(nn.Module):
    """up(down(x)): down (r, d_in), up (d_out, r), no biases."""

    def __init__(self, d_in: int, rank: int, d_out: int):
        super().__init__()
        self.down = Linear(d_in, rank, bias=False)
        self.up = Linear(rank, d_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x))


class SharedBlock(nn.Module):
    """The weights one shared transformer block keeps once: norm (2d), attn (2d -> d), mlp_norm (d), mlp."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(2 * cfg.d_model, cfg.norm_eps, residual_in_fp32=False)
        self.attn = Attention(cfg, -1, d_in=2 * cfg.d_model)  # its KV state is each use's (``SharedUse.state_idx``)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, residual_in_fp32=False)
        self.mlp = GatedMLP(cfg)


class SharedUse(nn.Module):
    """Use ``use`` (k) of a shared block: adapters, output linear, KV state n_layer + k. The block's first use holds
    it (``block``, a submodule); a later use borrows it (``borrow``: not a submodule), so its weights are stored
    once."""

    def __init__(self, cfg: ModelConfig, use: int):
        super().__init__()
        self.use, self.state_idx = use, cfg.n_layer + use
        self.block = SharedBlock(cfg) if use < cfg.shared_blocks else None
        d, d2, r = cfg.d_model, 2 * cfg.d_model, cfg.shared_adapter_rank
        adapters = cfg.shared_attn_adapters  # q, k, v all 2d wide: as many KV heads as query heads (the config's check)
        self.q_adapter, self.k_adapter, self.v_adapter = (LoRA(d2, r, d2) if adapters else None for _ in "qkv")
        self.mlp_adapter = LoRA(d, r, 2 * cfg.mlp_hidden) if r else None
        self.linear = Linear(d, d, bias=False)
        self._borrowed: tuple[SharedBlock, ...] = ()

    def borrow(self, owner: SharedUse) -> None:
        self._borrowed = (owner.block,)  # a tuple: not registered as a submodule

    def shared_block(self) -> SharedBlock:
        return self.block if self.block is not None else self._borrowed[0]

    def forward(self, stream: torch.Tensor, embeds: torch.Tensor, cache=None, slots=None,
                decode: bool = False) -> torch.Tensor:
        """stream, embeds: (b, l, d) | (b, d) in decode -> linear(mlp(mlp_norm(attn(norm([stream | embeds])))))."""
        blk = self.shared_block()
        x, _ = blk.norm(torch.cat([stream, embeds.to(stream.dtype)], dim=-1))
        deltas = None if self.q_adapter is None else (self.q_adapter(x), self.k_adapter(x), self.v_adapter(x))
        run = blk.attn.step if decode else blk.attn.forward
        a, _ = blk.mlp_norm(run(x, cache, slots, self.state_idx, deltas))
        return self.linear(blk.mlp(a, None if self.mlp_adapter is None else self.mlp_adapter(a)))

    # the cache's view of this use: the shared attention's state, in its own slot
    def allocate_state(self, *args, **kwargs):
        return self.shared_block().attn.allocate_state(*args, **kwargs)

    def kv_bytes_per_token(self, dtype) -> float:
        return self.shared_block().attn.kv_bytes_per_token(dtype)

    def decode_workspace_bytes_per_token(self) -> int:
        return self.shared_block().attn.decode_workspace_bytes_per_token()
