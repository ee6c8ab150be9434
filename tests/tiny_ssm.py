"""Tiny random Mamba models and synthetic calibration windows, for the tests.

Weights are random but shaped like trained ones where it matters for quantization: Δ biases of
softplus⁻¹(U[1e-3, 1e-1]), A = -[1..16], a few SSM channels with 10x larger in_proj rows (the
outlier channels the Quamba papers are about).
"""

from __future__ import annotations

import math

import torch

from ssmq.models.config import ModelConfig
from ssmq.models.lm import SSMLM
from ssmq.quant.calibration import CalibrationData

TINY = {
    "mamba1": dict(arch="mamba1", d_model=128, n_layer=4, vocab_size=64, d_state=8, dt_rank=8),
    "mamba2": dict(arch="mamba2", d_model=128, n_layer=4, vocab_size=64, d_state=16, headdim=32, ngroups=2,
                   chunk_size=8),
    "hybrid": dict(arch="hybrid", d_model=128, n_layer=3, vocab_size=64, d_state=16, headdim=32, ngroups=2,
                   chunk_size=8, attn_layer_idx=(1,), attn_heads=4, attn_kv_heads=2, attn_head_dim=32,
                   rotary_dim=16, mlp_hidden=48),
    "llama": dict(arch="llama", d_model=128, n_layer=3, vocab_size=64, attn_heads=4, attn_kv_heads=2,
                  attn_head_dim=32, rotary_dim=32, mlp_hidden=96, tie_embeddings=False, residual_in_fp32=False),
}


@torch.no_grad()
def tiny_model(arch: str, seed: int = 0, **overrides) -> SSMLM:
    """A float32 SSMLM of the TINY config of ``arch`` with random, trained-looking weights."""
    cfg = ModelConfig(**{**TINY[arch], **overrides})
    g = torch.Generator().manual_seed(seed)
    model = SSMLM(cfg)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.log(torch.rand(p.shape, generator=g) * 15 + 1))
        elif name.endswith("dt_bias"):
            dt = torch.exp(torch.rand(p.shape, generator=g) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
            p.copy_(dt + torch.log(-torch.expm1(-dt)))
        elif name.endswith(".D") or "norm" in name:
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
        else:
            p.copy_(torch.randn(p.shape, generator=g) / max(1, p.shape[-1]) ** 0.5)
    for layer in model.layers:
        if hasattr(layer.mixer, "in_proj"):  # outlier channels of x (and of z)
            w = layer.mixer.in_proj.weight
            w[torch.randint(0, w.shape[0], (3,), generator=g)] *= 10
    return model.eval()


def synthetic_calibration(vocab: int, n: int = 8, seqlen: int = 32, seed: int = 0) -> CalibrationData:
    g = torch.Generator().manual_seed(seed)
    return CalibrationData(torch.randint(0, vocab, (n, seqlen), generator=g), source="synthetic", seed=seed)
