"""Memory footprint of a model: weights, per-sequence SSM state, KV cache per token."""

from __future__ import annotations

from ssmq.models.config import ModelConfig


def parameter_count(cfg: ModelConfig) -> dict[str, int]:
    """Parameters by part, computed from the config (no weights needed)."""
    from torch import device

    from ssmq.models.lm import SSMLM

    with device("meta"):
        model = SSMLM(cfg)
    total = sum(p.numel() for p in model.parameters())
    embed = model.embedding.weight.numel()
    return {"total": total, "embedding": embed, "non_embedding": total - embed}


def footprint(cfg: ModelConfig, bytes_per_value: int = 2, format_name: str = "", path: str = "") -> dict[str, str]:
    n_mamba = len(cfg.ssm_layers())
    n_attn = cfg.n_layer - n_mamba
    conv = n_mamba * cfg.conv_dim * (cfg.d_conv - 1)
    ssm = n_mamba * cfg.d_inner * cfg.d_state
    kv = n_attn * 2 * cfg.attn_kv_heads * cfg.attn_head_dim
    params = parameter_count(cfg)
    ssm_part = f"{n_mamba} {'Mamba-1' if cfg.arch == 'mamba1' else 'Mamba-2'}" if n_mamba else ""
    layers = " + ".join(part for part in (ssm_part, f"{n_attn} attention" if n_attn else "") if part)
    out = {
        "path": path,
        "format": format_name,
        "architecture": cfg.arch,
        "layers": f"{cfg.n_layer} ({layers})",
        "d_model / d_inner / d_state": f"{cfg.d_model} / {cfg.d_inner} / {cfg.d_state}",
        "vocab (padded)": str(cfg.vocab_size),
        "parameters": f"{params['total'] / 1e6:.2f} M ({params['non_embedding'] / 1e6:.2f} M non-embedding)",
        f"weights ({bytes_per_value * 8}-bit)": _human(params["total"] * bytes_per_value),
        "state per sequence": f"{_human((conv + ssm) * bytes_per_value)} (conv {_human(conv * bytes_per_value)}, "
                              f"ssm {_human(ssm * bytes_per_value)}; constant in length)",
        "KV cache per token": _human(kv * bytes_per_value) if n_attn else "0 B (no attention layers)",
    }
    return {k: v for k, v in out.items() if v}


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)
