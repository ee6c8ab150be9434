"""Memory footprint of a model: weights, per-sequence SSM state, KV cache per token.

Element counts, from the config alone, equal to what ``SSMLM.allocate_cache`` allocates per slot
(``MambaState``: conv (c, w-1) + ssm (d, n) | (h, p, n); ``KVState``: k, v (L, hkv, e)); ``ssmq plan``
(``ssmq.runtime.plan``) turns them into bytes per format.
"""

from __future__ import annotations

import functools

from ssmq.models.config import ModelConfig
from ssmq.models.families import describe
from ssmq.paths import human_bytes


def parameter_count(cfg: ModelConfig) -> dict[str, int]:
    """Parameters by part, computed from the config (no weights needed)."""
    from torch import device

    from ssmq.models.lm import SSMLM

    with device("meta"):
        model = SSMLM(cfg)
    total = sum(p.numel() for p in model.parameters())
    embed = model.embedding.weight.numel()
    return {"total": total, "embedding": embed, "non_embedding": total - embed}


def state_elements(cfg: ModelConfig) -> dict[str, int]:
    """Per sequence, all Mamba layers: {"conv": c·(w-1) each, "ssm": d_inner·d_state each} (0 without SSM layers)."""
    n_mamba = len(cfg.ssm_layers())
    if not n_mamba:
        return {"conv": 0, "ssm": 0}
    return {"conv": n_mamba * cfg.conv_dim * (cfg.d_conv - 1), "ssm": n_mamba * cfg.d_inner * cfg.d_state}


def kv_vector_pairs(cfg: ModelConfig) -> int:
    """(key, value) vector pairs of e = attn_head_dim elements cached per token: attention layers × hkv."""
    return len(cfg.attention_layers()) * cfg.attn_kv_heads


def layers_text(cfg: ModelConfig) -> str:
    """'8 (6 Mamba-2 + 2 attention)', '30 (30 attention)', '44 (44 Mamba-2 + 44 attention in parallel)',
    '81 (81 Mamba-2 + 13 uses of 2 shared attention blocks)'."""
    n_mamba, n_attn = len(cfg.ssm_layers()), len(cfg.attention_layers())
    ssm_part = f"{n_mamba} {'Mamba-1' if cfg.ssm_kind == 'mamba1' else 'Mamba-2'}" if n_mamba else ""
    attn_part = f"{n_attn} attention" if n_attn else ""
    if cfg.parallel_attn:
        attn_part += " in parallel"
    elif cfg.shared_attn_layer_idx:
        attn_part = f"{n_attn} uses of {cfg.shared_blocks} shared attention block{'s' * (cfg.shared_blocks > 1)}"
    return f"{cfg.n_layer} ({' + '.join(p for p in (ssm_part, attn_part) if p)})"


def footprint(cfg: ModelConfig, bytes_per_value: int = 2, format_name: str = "", path: str = "") -> dict[str, str]:
    n_mamba = len(cfg.ssm_layers())
    n_attn = len(cfg.attention_layers())
    conv, ssm = state_elements(cfg).values()
    kv = kv_vector_pairs(cfg) * 2 * cfg.attn_head_dim
    params = parameter_count(cfg)
    mem = functools.partial(human_bytes, binary=True)  # memory, in binary units
    out = {
        "path": path,
        "format": format_name,
        "architecture": cfg.arch,
        "layers": layers_text(cfg),
        "family: layer pattern": describe(cfg),  # M Mamba, * attention, - MLP, E mixture of experts
        "d_model / d_inner / d_state": f"{cfg.d_model} / {cfg.d_inner} / {cfg.d_state}" if n_mamba else "",
        "d_model / MLP hidden": f"{cfg.d_model} / {cfg.mlp_hidden}" if not n_mamba else "",
        "attn heads (q / kv) x dim": f"({cfg.attn_heads} / {cfg.attn_kv_heads}) x {cfg.attn_head_dim}"
                                     if n_attn else "",
        "vocab (padded)": str(cfg.vocab_size),
        "parameters": f"{params['total'] / 1e6:.2f} M ({params['non_embedding'] / 1e6:.2f} M non-embedding)",
        f"weights ({bytes_per_value * 8}-bit)": mem(params["total"] * bytes_per_value),
        "state per sequence": f"{mem((conv + ssm) * bytes_per_value)} (conv {mem(conv * bytes_per_value)}, "
                              f"ssm {mem(ssm * bytes_per_value)}; constant in length)" if n_mamba
                              else "0 B (no SSM layers)",
        "KV cache per token": mem(kv * bytes_per_value) if n_attn else "0 B (no attention layers)",
    }
    return {k: v for k, v in out.items() if v}
