"""Architectures of published models, as data (no weights): for speed benchmarks on random weights and for
memory plans (``ssmq plan --model mamba2-2.7b``). Sizes are the public config.json values of each model.
"""

from __future__ import annotations

from ssmq.models.config import ModelConfig
from ssmq.models.families import FAMILIES

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

# The families of ssmq.models.families: (model_type, the architecture fields of the published config.json). The same
# fields build the family's transformers model for the peer benchmark (``ssmq.bench.models.transformers_model``).
PUBLISHED_HF: dict[str, tuple[str, dict]] = {
    "falcon-mamba-7b": ("falcon_mamba",
        {"hidden_size": 4096, "num_hidden_layers": 64, "intermediate_size": 8192, "vocab_size": 65024,
         "tie_word_embeddings": False, "state_size": 16, "conv_kernel": 4, "time_step_rank": 256, "expand": 16}),
    "nemotron-h-8b": ("nemotron_h",
        {"hidden_size": 4096, "vocab_size": 131072, "tie_word_embeddings": False, "num_attention_heads": 32,
         "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 21504, "ssm_state_size": 128,
         "mamba_num_heads": 128, "mamba_head_dim": 64, "n_groups": 8, "conv_kernel": 4, "chunk_size": 128,
         "max_position_embeddings": 8192,
         "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"}),
    # Nemotron 3 Nano 30B-A3B: MoE blocks of 128 squared-ReLU experts (6 active) and a shared expert
    "nemotron-3-nano-30b-a3b": ("nemotron_h",
        {"hidden_size": 2688, "vocab_size": 131072, "tie_word_embeddings": False, "num_attention_heads": 32,
         "num_key_value_heads": 2, "head_dim": 128, "intermediate_size": 1856, "ssm_state_size": 128,
         "mamba_num_heads": 64, "mamba_head_dim": 64, "n_groups": 8, "conv_kernel": 4, "chunk_size": 128,
         "max_position_embeddings": 262144, "n_routed_experts": 128, "num_experts_per_tok": 6,
         "moe_intermediate_size": 1856, "moe_shared_expert_intermediate_size": 3712, "n_shared_experts": 1,
         "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
         "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"}),
    # Granite-4.0-H-Tiny (7B, 64 experts, 6 active) and its dense twin Granite-4.0-H-1B: attention at layers 5, 15,
    # 25, 35, no RoPE; the µP multipliers change no size and are left at 1 here
    **{name: ("granitemoehybrid",
        {"hidden_size": 1536, "num_hidden_layers": 40, "num_attention_heads": 12, "num_key_value_heads": 4,
         "intermediate_size": ffn, "shared_intermediate_size": shared, "num_local_experts": experts,
         "num_experts_per_tok": 6 if experts else 0, "vocab_size": 100352, "tie_word_embeddings": True,
         "mamba_d_state": 128, "mamba_n_groups": 1, "mamba_n_heads": 48, "mamba_d_head": 64, "mamba_expand": 2,
         "mamba_chunk_size": 256, "max_position_embeddings": 131072, "position_embedding_type": "nope",
         "layer_types": ["attention" if i % 10 == 5 else "mamba" for i in range(40)]})
       for name, ffn, shared, experts in [("granite-4.0-h-tiny", 512, 1024, 64), ("granite-4.0-h-1b", 4096, 4096, 0)]},
    # Granite-4.0-H-Small (32B, 72 experts, 10 active; 9B active): widths, experts, Mamba-2 heads and state as its GGUF
    # metadata states them. Not read off its config.json: its 8 KV heads, attention at layers 5, 15, 25, 35 (the 9:1
    # Mamba-2 / attention ratio of the family's documentation, Tiny's positions) and tied embeddings; they move the
    # total by < 0.5B (32.21B here, 8.8B active)
    "granite-4.0-h-small": ("granitemoehybrid",
        {"hidden_size": 4096, "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 8,
         "intermediate_size": 768, "shared_intermediate_size": 1536, "num_local_experts": 72, "num_experts_per_tok": 10,
         "vocab_size": 100352, "tie_word_embeddings": True, "mamba_d_state": 128, "mamba_n_groups": 1,
         "mamba_n_heads": 128, "mamba_d_head": 64, "mamba_expand": 2, "mamba_chunk_size": 256,
         "max_position_embeddings": 131072, "position_embedding_type": "nope",
         "layer_types": ["attention" if i % 10 == 5 else "mamba" for i in range(40)]}),
    # Jamba (v0.1 and 1.5 Mini: 52B, 16 experts, 2 active): attention every 8th layer from 4, MoE every 2nd from 1
    "jamba-mini": ("jamba",
        {"hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 14336, "num_attention_heads": 32,
         "num_key_value_heads": 8, "num_experts": 16, "num_experts_per_tok": 2, "expert_layer_period": 2,
         "expert_layer_offset": 1, "attn_layer_period": 8, "attn_layer_offset": 4, "mamba_d_state": 16,
         "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": 256, "vocab_size": 65536,
         "tie_word_embeddings": False, "max_position_embeddings": 262144}),
    # Zamba2-7B: 81 Mamba-2 layers, 13 of them (6, 11, then every 6th to 77) after one of 2 shared transformer
    # blocks used in turn (32 heads of 224 over [stream | embeddings], RoPE), LoRA rank 128 on the shared MLPs only
    "zamba2-7b": ("zamba2",
        {"hidden_size": 3584, "num_hidden_layers": 81, "vocab_size": 32000, "tie_word_embeddings": True,
         "mamba_d_state": 64, "mamba_ngroups": 2, "n_mamba_heads": 112, "mamba_expand": 2, "num_attention_heads": 32,
         "num_key_value_heads": 32, "intermediate_size": 14336, "num_mem_blocks": 2, "adapter_rank": 128,
         "use_shared_attention_adapter": False, "use_mem_rope": True, "max_position_embeddings": 4096,
         "layers_block_type": ["hybrid" if i in (6, 11) or i > 11 and (i - 11) % 6 == 0 else "mamba"
                               for i in range(81)]}),
    # Falcon-H1-7B: attention (12 query / 2 KV heads of 128) in parallel with Mamba-2 (24 heads of 128, d_ssm 3072)
    # in each of 44 layers; the µP multipliers change no size and are left at 1 here
    "falcon-h1-7b": ("falcon_h1",
        {"hidden_size": 3072, "num_hidden_layers": 44, "num_attention_heads": 12, "num_key_value_heads": 2,
         "head_dim": 128, "intermediate_size": 12288, "vocab_size": 130048, "tie_word_embeddings": False,
         "mamba_d_state": 256, "mamba_n_groups": 1, "mamba_n_heads": 24, "mamba_d_head": 128, "mamba_d_ssm": 3072,
         "mamba_expand": 2, "mamba_d_conv": 4, "mamba_chunk_size": 128, "max_position_embeddings": 262144}),
}

PUBLISHED.update({name: FAMILIES[model_type].config(fields) for name, (model_type, fields) in PUBLISHED_HF.items()})
