"""The offline SSM transforms of the Quamba recipes; each leaves the float function unchanged.

    sort_and_cluster_   per-channel max |x| on calibration -> clusters -> channels reordered (Quamba2)
    hadamard_y_         out_proj -> RotatedLinear: y is rotated online, out_proj's weight holds W Hᵀ (Quamba)
(Quamba2's both-sides Hadamard is the core's QuaRot rotation, ``ssmq.quant.rotation.rotate_model_``.)
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ssmq.quant.calibration import CalibrationData, attach_observers, run_calibration
from ssmq.quant.hadamard import RotatedLinear
from ssmq.ops.layout import LayerKind
from ssmq.quant.observers import MinMaxObserver
from ssmq.quant.primitives import PerChannel
from ssmq.quant.ssm.cluster import cluster_channels, cluster_heads
from ssmq.quant.ssm.permute import permutable_block, permute_mamba1_, permute_mamba2_


def ssm_layers(model: nn.Module) -> list[int]:
    """Indices of the Mamba layers (the ones the SSM recipes touch)."""
    return model.config.ssm_layers()


def channel_absmax(model: nn.Module, calib: CalibrationData, tap: str = "act_x", **kw) -> dict[int, torch.Tensor]:
    """{layer: (d,) max |x| per channel} of a mixer tap over the calibration windows."""
    layers = ssm_layers(model)
    paths = [f"layers.{i}.mixer.{tap}" for i in layers]
    hooks, obs = attach_observers(model, paths, lambda p, m: MinMaxObserver(PerChannel(-1)))
    try:
        run_calibration(model, calib, desc=f"{tap} ranges", **kw)
    finally:
        hooks.remove()
    out = {}
    for i, p in zip(layers, paths):
        lo, hi = obs[p].range()
        out[i] = torch.maximum(-lo, hi)
    return out


@torch.no_grad()
def sort_and_cluster_(model: nn.Module, calib: CalibrationData, m: int = 4, n: int = 4, **kw) -> dict[int, torch.Tensor]:
    """Reorder the SSM channels of every Mamba layer; returns {layer: (d,) x group of each (new) channel}."""
    cfg = model.config
    stats = channel_absmax(model, calib, **kw)
    clusters = {}
    for i, cmax in stats.items():
        mixer = model.layers[i].mixer
        cmax = cmax.cpu()
        if cfg.layer_kind(i) is LayerKind.MAMBA1:
            perm, index = cluster_channels(cmax, m, n)
            permute_mamba1_(mixer, perm.to(mixer.A_log.device))
        else:
            perm, index, head_perm = cluster_heads(cmax, cfg.nheads, cfg.headdim, m, n, permutable_block(cfg))
            permute_mamba2_(mixer, perm.to(mixer.A_log.device), head_perm.to(mixer.A_log.device))
        clusters[i] = index
    return clusters


def hadamard_y_(model: nn.Module) -> None:
    for i in ssm_layers(model):
        mixer = model.layers[i].mixer
        mixer.out_proj = RotatedLinear.from_linear(mixer.out_proj)
