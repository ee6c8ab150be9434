"""The published architectures benchmarked for speed (random weights: speed does not depend on values)."""

from ssmq.models.config import ModelConfig

VOCAB_NEOX = 50288  # GPT-NeoX vocabulary padded to a multiple of 16, as the state-spaces checkpoints


def mamba2(d_model: int, n_layer: int, **kw) -> ModelConfig:
    return ModelConfig(arch="mamba2", d_model=d_model, n_layer=n_layer, vocab_size=kw.pop("vocab_size", VOCAB_NEOX),
                       d_state=128, headdim=64, chunk_size=256, **kw)


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
}


def mamba_ssm_config_dict(cfg: ModelConfig) -> dict:
    """The same architecture as keyword arguments of mamba_ssm's MambaConfig."""
    ssm_cfg = {"layer": "Mamba1"} if cfg.arch == "mamba1" else {
        "layer": "Mamba2", "headdim": cfg.headdim, "ngroups": cfg.ngroups, "chunk_size": cfg.chunk_size,
        "use_mem_eff_path": False}
    ssm_cfg["d_state"] = cfg.d_state
    return dict(d_model=cfg.d_model, n_layer=cfg.n_layer, vocab_size=cfg.vocab_size, ssm_cfg=ssm_cfg,
                rms_norm=True, residual_in_fp32=True, fused_add_norm=True, pad_vocab_size_multiple=16,
                tie_embeddings=True)


def hf_config(cfg: ModelConfig):
    import transformers as tf

    if cfg.arch == "mamba1":
        return tf.MambaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, state_size=cfg.d_state,
                              num_hidden_layers=cfg.n_layer, expand=cfg.expand, conv_kernel=cfg.d_conv)
    return tf.Mamba2Config(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, state_size=cfg.d_state,
                           num_heads=cfg.nheads, head_dim=cfg.headdim, expand=cfg.expand, n_groups=cfg.ngroups,
                           chunk_size=cfg.chunk_size, num_hidden_layers=cfg.n_layer)
