"""The published architectures benchmarked for speed (random weights: speed does not depend on values), and their
configs for mamba_ssm and transformers. The table itself is ``ssmq.models.published`` (``ssmq plan`` reads it too)."""

from ssmq.models.config import ModelConfig
from ssmq.models.published import PUBLISHED, VOCAB_NEOX, mamba2  # noqa: F401  (the table lives in the package)


def mamba_ssm_config_dict(cfg: ModelConfig) -> dict:
    """The same architecture as keyword arguments of mamba_ssm's MambaConfig."""
    if cfg.family or cfg.arch not in ("mamba1", "mamba2"):
        raise ValueError(f"mamba_ssm has no model of this {cfg.family or cfg.arch} architecture")
    ssm_cfg = {"layer": "Mamba1"} if cfg.arch == "mamba1" else {
        "layer": "Mamba2", "headdim": cfg.headdim, "ngroups": cfg.ngroups, "chunk_size": cfg.chunk_size,
        "use_mem_eff_path": False}
    ssm_cfg["d_state"] = cfg.d_state
    return dict(d_model=cfg.d_model, n_layer=cfg.n_layer, vocab_size=cfg.vocab_size, ssm_cfg=ssm_cfg,
                rms_norm=True, residual_in_fp32=True, fused_add_norm=True, pad_vocab_size_multiple=16,
                tie_embeddings=True)


def hf_config(cfg: ModelConfig):
    import transformers as tf

    if cfg.family:  # Falcon-Mamba, Nemotron-H, Jamba: their config.json as ssmq writes it (ssmq.models.families)
        from ssmq.models.hf_layout import SSMQ_CONFIG_KEY, config_to_hf

        fields = {k: v for k, v in config_to_hf(cfg).items() if k not in ("architectures", SSMQ_CONFIG_KEY)}
        return tf.AutoConfig.for_model(fields.pop("model_type"), **fields)
    if cfg.arch not in ("mamba1", "mamba2"):
        raise ValueError(f"no transformers config written here for the {cfg.arch} architecture")
    if cfg.arch == "mamba1":
        return tf.MambaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, state_size=cfg.d_state,
                              num_hidden_layers=cfg.n_layer, expand=cfg.expand, conv_kernel=cfg.d_conv)
    return tf.Mamba2Config(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, state_size=cfg.d_state,
                           num_heads=cfg.nheads, head_dim=cfg.headdim, expand=cfg.expand, n_groups=cfg.ngroups,
                           chunk_size=cfg.chunk_size, num_hidden_layers=cfg.n_layer)
