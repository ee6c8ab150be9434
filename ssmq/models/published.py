"""Architectures of published models, as data (no weights): for speed benchmarks on random weights and for
memory plans (``ssmq plan --model mamba2-2.7b``). Sizes are the public config.json values of each model.
"""

from __future__ import annotations

from ssmq.models.config import ModelConfig

VOCAB_NEOX = 50288  # GPT-NeoX vocabulary padded to a multiple of 16, as the state-spaces checkpoints


def mamba2(d_model: int, n_layer: int, **kw) -> ModelConfig:
    return ModelConfig(arch="mamba2", d_model=d_model, n_layer=n_layer, vocab_size=kw.pop("vocab_size", VOCAB_NEOX),
                       d_state=128, headdim=64, chunk_size=256, **kw)


def llama(d_model: int, n_layer: int, heads: int, kv_heads: int, mlp_hidden: int, vocab_size: int,
          tie: bool = False, rope_theta: float = 10000.0, max_positions: int = 4096) -> ModelConfig:
    head_dim = d_model // heads
    return ModelConfig(arch="llama", d_model=d_model, n_layer=n_layer, vocab_size=vocab_size, attn_heads=heads,
                       attn_kv_heads=kv_heads, attn_head_dim=head_dim, rotary_dim=head_dim, rope_theta=rope_theta,
                       mlp_hidden=mlp_hidden, tie_embeddings=tie, residual_in_fp32=False,
                       max_position_embeddings=max_positions)


PUBLISHED = {
    "mamba2-130m": mamba2(768, 24),
    "mamba2-370m": mamba2(1024, 48),
    "mamba2-780m": mamba2(1536, 48),
    "mamba2-1.3b": mamba2(2048, 48),
    "mamba2-2.7b": mamba2(2560, 64),
    # NVIDIA's pure Mamba-2 8B (mamba2-8b-3t-4k): 56 layers, 8 groups, 256k vocabulary
    "mamba2-8b": mamba2(4096, 56, ngroups=8, vocab_size=256000),
    "mamba-130m": ModelConfig(arch="mamba1", d_model=768, n_layer=24, vocab_size=50280, d_state=16),
    "mamba-2.8b": ModelConfig(arch="mamba1", d_model=2560, n_layer=64, vocab_size=50280, d_state=16),
    # IBM Bamba-9B (v1): Mamba-2 with attention at layers 9, 18, 27 (32 query / 8 KV heads of 128, RoPE on the first
    # 64 channels of a head: its config's attn_rotary_emb, partial_rotary_factor 0.5)
    "bamba-9b": ModelConfig(arch="hybrid", d_model=4096, n_layer=32, vocab_size=128256, d_state=128, headdim=64,
                            chunk_size=256, attn_layer_idx=(9, 18, 27), attn_heads=32, attn_kv_heads=8,
                            attn_head_dim=128, rotary_dim=64, mlp_hidden=14336, tie_embeddings=False,
                            residual_in_fp32=False),
    # Llama-architecture models: SmolLM2-135M (the GGUF of `--model smollm2-135m`), Llama-2-7B, Llama-3.1-8B
    # (whose llama3 RoPE scaling the loader refuses; the memory plan does not depend on it)
    "smollm2-135m": llama(576, 30, 9, 3, 1536, 49152, tie=True, rope_theta=100000.0, max_positions=8192),
    "llama-2-7b": llama(4096, 32, 32, 32, 11008, 32000),
    "llama-3.1-8b": llama(4096, 32, 32, 8, 14336, 128256, rope_theta=500000.0, max_positions=131072),
}
