"""SmoothQuant: migrate activation outliers into the weights, x W.T = (x / s) (W diag(s)).T.

    s_j = max|x_j|^alpha / max_i |W_ij|^(1 - alpha)       (k,), alpha in [0, 1] (default 0.5)

The division x / s is folded offline into whatever produces x: the weight of a norm (RMSNorm,
Mamba-2's gated RMSNorm: y * w -> y * w / s) or the output rows of a linear (up_proj before
down_proj). Linears that read the same x (q, k, v; gate, up) share one s, from the max over all
their weights. Mamba-1's out_proj and x_proj have no foldable producer (a product with silu(z),
a SiLU) and are not smoothed.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ssmq.models.ffn import ffn_linears
from ssmq.ops.layout import LayerKind


def smoothing_scales(act_absmax: torch.Tensor, weights: list[torch.Tensor], alpha: float = 0.5) -> torch.Tensor:
    """act_absmax (k,), weights [(n_i, k)] -> s (k,) float32; channels never active keep s = 1."""
    w_max = torch.stack([w.detach().abs().amax(0).float() for w in weights]).amax(0).clamp(min=1e-5)
    a = act_absmax.float().clamp(min=0)
    s = (a.clamp(min=1e-5) ** alpha) / (w_max ** (1.0 - alpha))
    return torch.where(a > 0, s.clamp(min=1e-5), torch.ones_like(s))


@torch.no_grad()
def apply_smoothing_(s: torch.Tensor, producer: nn.Module, readers: list[nn.Linear]) -> None:
    """Divide the producer's output channels by s and multiply the readers' input columns by s.

    producer: a module with a (k,) ``weight`` that scales its output (a norm), or an nn.Linear
    whose k output rows (and bias) are scaled.
    """
    if isinstance(producer, nn.Linear):
        producer.weight.div_(s.to(producer.weight.dtype).unsqueeze(1))
        if producer.bias is not None:
            producer.bias.div_(s.to(producer.bias.dtype))
    else:
        producer.weight.div_(s.to(producer.weight.dtype))
    for lin in readers:
        lin.weight.mul_(s.to(lin.weight.dtype).unsqueeze(0))


def smoothquant_groups(model: nn.Module) -> list[tuple[str, list[str]]]:
    """(producer path, [reader linear paths]) of every foldable site, by the ssmq module tree."""
    groups = []
    for i, layer in enumerate(model.layers):
        p = f"layers.{i}"
        kind = model.config.layer_kind(i)
        if kind is LayerKind.ATTENTION:
            groups.append((f"{p}.norm", [f"{p}.mixer.q_proj", f"{p}.mixer.k_proj", f"{p}.mixer.v_proj"]))
        else:
            groups.append((f"{p}.norm", [f"{p}.mixer.in_proj"]))
        if kind is LayerKind.MAMBA2:
            groups.append((f"{p}.mixer.norm", [f"{p}.mixer.out_proj"]))
        if getattr(layer, "mlp", None) is not None:  # (a MoE's norm group holds its router: smoothed only with it)
            readers, _, gated = ffn_linears(layer.mlp)
            groups.append((f"{p}.mlp_norm", [f"{p}.mlp.{n}" for n in readers]))
            groups += [(f"{p}.mlp.{up}", [f"{p}.mlp.{down}"]) for up, down in gated]
    return groups
