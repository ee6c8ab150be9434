"""The Hugging Face layout of an SSMLM, written out: config.json fields and tensor names.

The inverse of ``loading.config_from_hf`` / ``loading.rename_to_ssmq`` (what reads HF folders), for
writers of HF folders (``ssmq export``):

    arch     architectures         tensor prefix of block i     mixer        MLP
    mamba1   MambaForCausalLM      backbone.layers.i.           .mixer.      -
    mamba2   Mamba2ForCausalLM     backbone.layers.i.           .mixer.      -
    hybrid   BambaForCausalLM      model.layers.i.              .mamba. / .self_attn.   .feed_forward.
    llama    LlamaForCausalLM      model.layers.i.              .self_attn.  .mlp.

Norms: hybrid ``input_layernorm`` / ``pre_ff_layernorm`` / ``model.final_layernorm``; llama ``input_layernorm`` /
``post_attention_layernorm`` / ``model.norm``.

Mamba-1's ``dt_bias`` is HF's ``dt_proj.bias``. HF configs cannot say everything an ssmq
ModelConfig can (Bamba has no residual_in_fp32; HF Mamba-2 normalises the gate over all of d_inner),
so the writer also stores the ssmq config under ``SSMQ_CONFIG_KEY``; ssmq reads that one back.
"""

from __future__ import annotations

import re

from ssmq.models.config import ModelConfig

SSMQ_CONFIG_KEY = "ssmq_config"
HF_ARCHITECTURES = {"mamba1": ("mamba", "MambaForCausalLM"), "mamba2": ("mamba2", "Mamba2ForCausalLM"),
                    "hybrid": ("bamba", "BambaForCausalLM"), "llama": ("llama", "LlamaForCausalLM")}


def _limit(cfg: ModelConfig) -> list[float]:
    return [cfg.dt_limit[0], cfg.dt_limit[1]]  # json writes inf as Infinity, as transformers does


def config_to_hf(cfg: ModelConfig) -> dict:
    """config.json contents of the HF model class of ``cfg.arch`` or ``cfg.family`` (plus the ssmq config itself)."""
    if cfg.family:
        from ssmq.models.families import FAMILIES, name_to_hf

        name_to_hf("lm_head", cfg)  # refuses a family whose tensors do not map name for name
        return {**FAMILIES[cfg.family].config_to_hf(cfg), SSMQ_CONFIG_KEY: cfg.to_dict()}
    model_type, cls = HF_ARCHITECTURES[cfg.arch]
    common = {"model_type": model_type, "architectures": [cls], "vocab_size": cfg.vocab_size,
              "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layer, "tie_word_embeddings": cfg.tie_embeddings}
    if cfg.arch == "mamba1":
        out = {**common, "state_size": cfg.d_state, "conv_kernel": cfg.d_conv, "expand": cfg.expand,
               "intermediate_size": cfg.d_inner, "time_step_rank": cfg.dt_rank_, "use_conv_bias": cfg.conv_bias,
               "use_bias": cfg.proj_bias, "layer_norm_epsilon": cfg.norm_eps,
               "residual_in_fp32": cfg.residual_in_fp32}
    elif cfg.arch == "mamba2":
        out = {**common, "state_size": cfg.d_state, "conv_kernel": cfg.d_conv, "expand": cfg.expand,
               "head_dim": cfg.headdim, "num_heads": cfg.nheads, "n_groups": cfg.ngroups,
               "chunk_size": cfg.chunk_size, "time_step_limit": _limit(cfg), "use_conv_bias": cfg.conv_bias,
               "use_bias": cfg.proj_bias, "layer_norm_epsilon": cfg.norm_eps,
               "residual_in_fp32": cfg.residual_in_fp32}
    elif cfg.arch == "hybrid":
        out = {**common, "mamba_d_state": cfg.d_state, "mamba_d_conv": cfg.d_conv, "mamba_expand": cfg.expand,
               "mamba_d_head": cfg.headdim, "mamba_n_heads": cfg.nheads, "mamba_n_groups": cfg.ngroups,
               "mamba_chunk_size": cfg.chunk_size, "time_step_limit": _limit(cfg), "mamba_conv_bias": cfg.conv_bias,
               "mamba_proj_bias": cfg.proj_bias, "attn_layer_indices": list(cfg.attn_layer_idx),
               **_attention_to_hf(cfg)}
    else:
        out = {**common, "hidden_act": "silu", "mlp_bias": False, **_attention_to_hf(cfg)}
    out[SSMQ_CONFIG_KEY] = cfg.to_dict()
    return out


def _attention_to_hf(cfg: ModelConfig) -> dict:
    """The attention / MLP fields, named alike in Bamba and Llama configs."""
    return {"rms_norm_eps": cfg.norm_eps, "num_attention_heads": cfg.attn_heads,
            "num_key_value_heads": cfg.attn_kv_heads, "head_dim": cfg.attn_head_dim,
            "attention_bias": cfg.attn_bias, "intermediate_size": cfg.mlp_hidden,
            "max_position_embeddings": cfg.max_position_embeddings,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                                "partial_rotary_factor": cfg.rotary_dim / cfg.attn_head_dim
                                if cfg.attn_head_dim else 1.0}}


_TO_HF = {  # ssmq prefix pattern -> HF, per naming family (inverse of loading._HF_RENAMES)
    "backbone": [(r"^embedding\.", "backbone.embeddings."), (r"^norm_f\.", "backbone.norm_f."),
                 (r"^layers\.(\d+)\.mixer\.dt_bias$", r"backbone.layers.\1.mixer.dt_proj.bias"),
                 (r"^layers\.", "backbone.layers.")],
    "model": [(r"^embedding\.", "model.embed_tokens."), (r"^norm_f\.", "model.final_layernorm."),
              (r"^layers\.(\d+)\.norm\.", r"model.layers.\1.input_layernorm."),
              (r"^layers\.(\d+)\.mlp_norm\.", r"model.layers.\1.pre_ff_layernorm."),
              (r"^layers\.(\d+)\.mlp\.", r"model.layers.\1.feed_forward.")],
    "llama": [(r"^embedding\.", "model.embed_tokens."), (r"^norm_f\.", "model.norm."),
              (r"^layers\.(\d+)\.norm\.", r"model.layers.\1.input_layernorm."),
              (r"^layers\.(\d+)\.mlp_norm\.", r"model.layers.\1.post_attention_layernorm."),
              (r"^layers\.(\d+)\.mixer\.", r"model.layers.\1.self_attn."),
              (r"^layers\.(\d+)\.mlp\.", r"model.layers.\1.mlp.")],
}


def rename_to_hf(name: str, cfg: ModelConfig) -> str:
    """ssmq parameter / module name -> the HF name of ``cfg.arch`` or ``cfg.family`` (``lm_head`` is the same)."""
    if cfg.family:
        from ssmq.models.families import name_to_hf

        return name_to_hf(name, cfg)
    if cfg.arch == "hybrid":
        m = re.match(r"^layers\.(\d+)\.mixer\.", name)
        if m:
            kind = "self_attn" if cfg.layer_kind(int(m.group(1))) == "attention" else "mamba"
            return f"model.layers.{m.group(1)}.{kind}.{name[m.end():]}"
    rules = _TO_HF[{"hybrid": "model", "llama": "llama"}.get(cfg.arch, "backbone")]
    for pattern, repl in rules:
        if cfg.arch == "mamba2" and "dt_bias" in pattern:  # Mamba-2 keeps dt_bias under its own name
            continue
        name, n = re.subn(pattern, repl, name)
        if n:
            return name
    return name
