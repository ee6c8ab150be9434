"""Calibrate the mixer taps named by a recipe's tap rules and swap them for ``ActQuantizer``s.

Glossary: d channels of a tap, G its scale groups.
One calibration pass feeds, per tap, one observer per scale group (the core's observers: exact
absmax, or the streaming percentile of |x| inside the group); scale = clip / 127.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ssmq.ops.layout import LayerKind
from ssmq.quant.calibration import CalibrationData, attach_observers, run_calibration
from ssmq.quant.observers import make_observer
from ssmq.quant.primitives import PerTensor
from ssmq.quant.ssm.quantizer import ActQuantizer, group_index
from ssmq.quant.ssm.transforms import ssm_layers


class GroupObserver:
    """Observers of the channel groups of a tensor (..., d); ``clip()`` -> (G,) clipping values."""

    def __init__(self, index: torch.Tensor | None, kind: str, percentile: float):
        self.index = index
        self.n_groups = 1 if index is None else int(index.max()) + 1
        self.obs = [make_observer(kind, PerTensor(), "int8", True, percentile) for _ in range(self.n_groups)]

    def update(self, x: torch.Tensor) -> None:
        if self.index is None:
            self.obs[0].update(x)
            return
        idx = self.index.to(x.device)
        for g, ob in enumerate(self.obs):
            ob.update(x[..., idx == g])

    def clip(self) -> torch.Tensor:
        return torch.stack([torch.maximum(-lo, hi) for lo, hi in (ob.range() for ob in self.obs)])


def tap_plan(model: nn.Module, rules, clusters: dict[int, torch.Tensor]) -> dict[str, tuple]:
    """{tap path: (rule, index or None)} for the Mamba layers, the first rule naming a tap wins."""
    cfg = model.config
    plan = {}
    for i in ssm_layers(model):
        kind = cfg.layer_kind(i)
        mixer = model.layers[i].mixer
        for rule in rules:
            if kind not in rule.archs:
                continue
            for tap in rule.taps:
                path = f"layers.{i}.mixer.{tap}"
                if path in plan:
                    continue
                d = _tap_width(mixer, cfg, tap)
                plan[path] = (rule, group_index(rule.layout, d, d_state=cfg.d_state, state_groups=rule.state_groups,
                                                cluster=clusters.get(i) if tap == "act_x" else None))
    return plan


def _tap_width(mixer: nn.Module, cfg, tap: str) -> int:
    """Channels of a tap: B, C, dt as the layout splits them (Mamba-1's dt is after dt_proj: d_inner)."""
    if tap in ("act_B", "act_C"):
        return cfg.conv_segments().size(tap[-1]) if cfg.ssm_kind is LayerKind.MAMBA2 else cfg.d_state
    if tap == "act_dt" and cfg.ssm_kind is LayerKind.MAMBA2:
        return cfg.in_proj_segments().size("dt")
    return cfg.d_inner


@torch.no_grad()
def install_tap_quantizers(model: nn.Module, rules, clusters: dict[int, torch.Tensor], calib: CalibrationData,
                           **kw) -> dict[str, ActQuantizer]:
    """Calibrate and install; returns {tap path: quantizer}."""
    plan = tap_plan(model, rules, clusters)
    if not plan:
        return {}
    make = lambda path, m: GroupObserver(plan[path][1], plan[path][0].observer, plan[path][0].percentile)  # noqa: E731
    hooks, obs = attach_observers(model, list(plan), make)
    try:
        run_calibration(model, calib, desc="SSM activation scales", **kw)
    finally:
        hooks.remove()
    out = {}
    for path, (rule, index) in plan.items():
        parent, _, name = path.rpartition(".")
        mixer = model.get_submodule(parent)
        q = ActQuantizer(_tap_width(mixer, model.config, name), obs[path].n_groups, rule.bits, index)
        q.set_range(obs[path].clip())
        setattr(mixer, name, q.to(next(mixer.parameters()).device))
        out[path] = q
    return out
