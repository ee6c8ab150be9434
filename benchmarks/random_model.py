"""An SSMLM of a given config with random weights, built directly on the target device.

With ``comm`` (tensor parallelism) the model is sharded while still on the meta device, so each
rank only ever allocates and initialises its own shard.
"""

from __future__ import annotations

import math

import torch

from ssmq.models.lm import SSMLM


@torch.no_grad()
def init_random_(model) -> None:
    """Trained-looking random values: A = -[1..16], softplus⁻¹ Δ biases in [1e-3, 1e-1], unit norms and D."""
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.log(torch.empty_like(p).uniform_(1, 16)))
        elif name.endswith("dt_bias") or name.endswith("dt_proj.bias"):
            dt = torch.exp(torch.empty_like(p).uniform_(math.log(1e-3), math.log(1e-1)))
            p.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        elif name.endswith(".D") or "norm" in name:
            p.fill_(1.0)
        else:
            p.normal_(0, 0.02)


@torch.no_grad()
def random_model(cfg, device="cuda", dtype=torch.float16, seed: int = 0, comm=None, fuse_norm: bool = True) -> SSMLM:
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = SSMLM(cfg)
    if comm is not None:
        from ssmq.runtime.tp import apply_tp

        apply_tp(model, comm, fuse_norm=fuse_norm)
    model = model.to_empty(device=device).to(dtype)
    init_random_(model)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embedding.weight
    return model.eval()
