"""Tiny random transformers checkpoints of each family, saved to a folder (the independent implementation)."""

from __future__ import annotations

import contextlib

import torch


def _perturb(model, seed: int) -> None:
    """HF's init leaves many weights at 0/1 (norms, D, biases); randomise everything so a wrong mapping shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=g) * 2 - 1)
            elif "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=g) / max(1, p.shape[-1]) ** 0.5 * 3)


def tiny_hf_model(arch: str, seed: int = 0, ngroups: int = 2, tie: bool = True):
    """A transformers model of ``arch`` (mamba1 | mamba2 | hybrid | llama) with random float32 weights.

    ``tie``: Llama only (the SSM families are always tied here): the lm_head shares the embedding."""
    import transformers as tf

    torch.manual_seed(seed)
    if arch == "mamba1":
        cfg = tf.MambaConfig(vocab_size=96, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2,
                             conv_kernel=4, time_step_rank=4, tie_word_embeddings=True)
        model = tf.MambaForCausalLM(cfg)
    elif arch == "mamba2":
        cfg = tf.Mamba2Config(vocab_size=96, hidden_size=32, state_size=16, num_heads=8, head_dim=8, expand=2,
                              n_groups=ngroups, chunk_size=8, num_hidden_layers=2, tie_word_embeddings=True)
        model = tf.Mamba2ForCausalLM(cfg)
    elif arch == "hybrid":
        cfg = tf.BambaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                             attn_layer_indices=[1], num_attention_heads=4, num_key_value_heads=2,
                             mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=ngroups, mamba_d_state=16,
                             mamba_chunk_size=8, tie_word_embeddings=True,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                              "partial_rotary_factor": 0.5})
        model = tf.BambaForCausalLM(cfg)
    elif arch == "llama":  # GQA 4 query / 2 KV heads, full RoPE with a non-default theta, SwiGLU MLP
        cfg = tf.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5,
                             max_position_embeddings=64, tie_word_embeddings=tie,
                             rope_parameters={"rope_type": "default", "rope_theta": 500.0})
        model = tf.LlamaForCausalLM(cfg)
    else:
        raise ValueError(arch)
    _perturb(model, seed)
    return model.eval()


def save_tiny(arch: str, folder, seed: int = 0, ngroups: int = 2, tie: bool = True):
    model = tiny_hf_model(arch, seed, ngroups, tie)
    model.save_pretrained(folder)
    return model


FAMILIES = ["falcon_mamba", "nemotron_h", "nemotron_moe", "granite_dense", "granite_moe", "jamba", "zamba2",
            "falcon_h1"]


def tiny_family_model(family: str, seed: int = 0, **changes):
    """A transformers model of one of ``FAMILIES`` (ssmq.models.families) with random float32 weights: every layer
    kind of the family, B/C groups, GQA, non-trivial multipliers; ``changes``: config fields set otherwise (Zamba2,
    Falcon-H1)."""
    import transformers as tf

    torch.manual_seed(seed)
    if family == "falcon_mamba":
        cfg = tf.FalconMambaConfig(vocab_size=96, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2,
                                   conv_kernel=4, time_step_rank=4, mixer_rms_eps=1e-6, tie_word_embeddings=False)
        model = tf.FalconMambaForCausalLM(cfg)
    elif family == "nemotron_h":  # pattern M-*-MM- : Mamba-2 with MLP, attention with MLP, bare Mamba-2
        cfg = tf.NemotronHConfig(vocab_size=96, hidden_size=32, hybrid_override_pattern="M-*-MM-",
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
                                 ssm_state_size=16, mamba_num_heads=8, mamba_head_dim=8, n_groups=2, chunk_size=8,
                                 expand=2, tie_word_embeddings=False)
        model = tf.NemotronHForCausalLM(cfg)
    elif family == "nemotron_moe":  # pattern ME*-ME: MoE blocks (sigmoid routing in 2 groups, 1 kept), an MLP block
        cfg = tf.NemotronHConfig(vocab_size=96, hidden_size=32, hybrid_override_pattern="ME*-ME",
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
                                 ssm_state_size=16, mamba_num_heads=8, mamba_head_dim=8, n_groups=2, chunk_size=8,
                                 n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                                 moe_shared_expert_intermediate_size=40, n_group=2, topk_group=1,
                                 routed_scaling_factor=2.5, norm_topk_prob=True, tie_word_embeddings=False)
        model = tf.NemotronHForCausalLM(cfg)
    elif family in ("granite_dense", "granite_moe"):
        cfg = tf.GraniteMoeHybridConfig(
            vocab_size=96, hidden_size=32, intermediate_size=24, shared_intermediate_size=40, num_hidden_layers=3,
            layer_types=["mamba", "attention", "mamba"], num_attention_heads=4, num_key_value_heads=2,
            num_local_experts=4 if family == "granite_moe" else 0, num_experts_per_tok=2, mamba_n_heads=8,
            mamba_d_head=8, mamba_n_groups=2, mamba_d_state=16, mamba_chunk_size=8, embedding_multiplier=3.0,
            logits_scaling=2.0, residual_multiplier=0.5, attention_multiplier=0.2, position_embedding_type="nope",
            tie_word_embeddings=False)
        model = tf.GraniteMoeHybridForCausalLM(cfg)
    elif family == "jamba":  # attention at layers 1, 3; MoE at 1, 3 (top-2 of 4 experts), gated MLP at 0, 2
        cfg = tf.JambaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                             expert_layer_period=2, expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=1,
                             mamba_d_state=8, mamba_dt_rank=4, mamba_expand=2, tie_word_embeddings=False,
                             use_mamba_kernels=False)
        model = tf.JambaForCausalLM(cfg)
    elif family == "zamba2":  # 2 shared blocks used 3 times (the third use: block 0 again), adapters on q, k, v, RoPE
        cfg = tf.Zamba2Config(**{**dict(
            vocab_size=96, hidden_size=32, num_hidden_layers=5, mamba_d_state=16, mamba_ngroups=2,
            layers_block_type=["mamba", "hybrid", "mamba", "hybrid", "hybrid"], n_mamba_heads=8, chunk_size=8,
            num_attention_heads=4, num_key_value_heads=4, intermediate_size=48, num_mem_blocks=2,
            use_shared_attention_adapter=True, adapter_rank=8, use_mem_rope=True,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0}, tie_word_embeddings=True,
            use_mamba_kernels=False), **changes})
        model = tf.Zamba2ForCausalLM(cfg)
    elif family == "falcon_h1":  # every µP multiplier other than 1, the gated norm before its gate, d_ssm != 2·d
        cfg = tf.FalconH1Config(**{**dict(
            vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, mamba_d_ssm=48, mamba_n_heads=6, mamba_n_groups=2, mamba_d_state=16,
            mamba_chunk_size=8, mamba_rms_norm=True, mamba_norm_before_gate=True, embedding_multiplier=3.0,
            lm_head_multiplier=0.5, attention_in_multiplier=0.7, attention_out_multiplier=1.3, key_multiplier=0.6,
            ssm_in_multiplier=1.2, ssm_out_multiplier=0.8, ssm_multipliers=[0.5, 1.5, 0.8, 1.25, 0.9],
            mlp_multipliers=[0.75, 1.4], rope_parameters={"rope_type": "default", "rope_theta": 500.0},
            tie_word_embeddings=False), **changes})
        model = tf.FalconH1ForCausalLM(cfg)
    else:
        raise ValueError(family)
    _perturb(model, seed)
    return model.eval()


def save_tiny_family(family: str, folder, seed: int = 0, **changes):
    model = tiny_family_model(family, seed, **changes)
    model.save_pretrained(folder)
    return model


@contextlib.contextmanager
def float64_throughout():
    """Lift the float32 upcasts of both implementations (``t.float()``, ``t.to(torch.float32)``: norms, scans, RoPE
    tables, attention) to float64 while it lasts: a float64 model then runs in float64 end to end, the reference that
    tells two float32 implementations' rounding from a difference in their maths."""
    to, as_float = torch.Tensor.to, torch.Tensor.float

    def to64(self, *args, **kwargs):
        if self.dtype == torch.float64:
            args = tuple(torch.float64 if a is torch.float32 else a for a in args)
            if kwargs.get("dtype") is torch.float32:
                kwargs["dtype"] = torch.float64
        return to(self, *args, **kwargs)

    torch.Tensor.to, torch.Tensor.float = to64, lambda self, *a, **k: to(self, torch.float64)
    try:
        yield
    finally:
        torch.Tensor.to, torch.Tensor.float = to, as_float
