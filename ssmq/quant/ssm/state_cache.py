"""8-bit SSM state cache (Quamba2): states are quantized before they are written to the cache and
dequantized when read, with static scales that reuse x's groups (d_state × G scales, G = m·n).

Glossary: s cache slots, d d_inner, h heads, p headdim, n d_state, G scale groups of x.

The mixers keep their float maths; ``Int8StateMixin`` only hands its scales to the state it allocates
(``ssmq.models.state.MambaState`` in the int8 format), which dequantizes the served rows before a
prefill or decode step and re-quantizes them after (``ssmq.ops.quant_ssm.quantize_state_ref``),
exactly ``quant_state_update_ref`` for decode. Allocate the cache with
``model.allocate_cache(..., ssm_dtype=torch.int8)``; a float cache keeps working unchanged. Scales are calibrated on the states reached at chunk boundaries of the windows.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ssmq.models.config import ModelConfig
from ssmq.models.mamba1 import Mamba1Mixer
from ssmq.models.mamba2 import Mamba2Mixer
from ssmq.models.state import Int8StateScales


class Int8StateMixin:
    """Mixed into a mixer class; buffers state_scale (G, n) and, for G > 1, state_index (d,)."""

    def init_state_quant(self, n_groups: int, d: int, n: int, index: torch.Tensor | None = None) -> None:
        self.state_groups = n_groups
        self.register_buffer("state_scale", torch.ones(n_groups, n, dtype=torch.float32))
        if n_groups > 1:
            self.register_buffer("state_index", torch.zeros(d, dtype=torch.long) if index is None else index.long())
        else:
            self.state_index = None

    def state_scales(self) -> Int8StateScales:
        # the buffers themselves, not copies: allocate the cache after moving the model
        return Int8StateScales(self.state_scale, self.state_index)

    def spec(self) -> dict:
        return {"kind": "SSMInt8StateMixer", "config": self.config_dict, "layer_idx": self.layer_idx,
                "state_groups": self.state_groups}


class Int8StateMamba1Mixer(Int8StateMixin, Mamba1Mixer):
    pass


class Int8StateMamba2Mixer(Int8StateMixin, Mamba2Mixer):
    pass


_CLASSES = {"mamba1": Int8StateMamba1Mixer, "mamba2": Int8StateMamba2Mixer}


def empty_int8_state_mixer(cfg: ModelConfig, layer_idx: int, n_groups: int) -> nn.Module:
    kind = cfg.layer_kind(layer_idx)
    m = _CLASSES[kind](cfg, layer_idx)
    m.config_dict = cfg.to_dict()
    m.init_state_quant(n_groups, cfg.d_inner, cfg.d_state)
    return m


def from_spec(spec: dict, dtype=None, device=None) -> nn.Module:
    """Checkpoint loader entry (``register_module_kind("SSMInt8StateMixer", from_spec)``)."""
    cfg = ModelConfig.from_dict(spec["config"])
    return empty_int8_state_mixer(cfg, spec["layer_idx"], spec["state_groups"])


def to_int8_state(mixer: nn.Module, cfg: ModelConfig, index: torch.Tensor | None, n_groups: int) -> nn.Module:
    """A mixer of the Int8State class holding ``mixer``'s submodules and parameters (no copy)."""
    new = empty_int8_state_mixer(cfg, mixer.layer_idx, n_groups)
    for name, child in mixer.named_children():
        setattr(new, name, child)
    for name, prm in mixer.named_parameters(recurse=False):
        setattr(new, name, prm)
    if index is not None:
        new.state_index.copy_(index)
    return new.to(next(mixer.parameters()).device)


@torch.no_grad()
def calibrate_state_scales(model: nn.Module, windows: torch.Tensor, chunk: int = 128, batch_size: int = 8,
                           progress: bool = False) -> dict[int, torch.Tensor]:
    """{layer: absmax (d, n)} of the float states at every chunk boundary of the windows (b, l)."""
    from tqdm.auto import tqdm

    dev = next(model.parameters()).device
    amax: dict[int, torch.Tensor] = {}
    for i in tqdm(range(0, windows.shape[0], batch_size), desc="state scales", disable=not progress):
        ids = windows[i:i + batch_size].to(dev)
        cache = allocate_cache(model, ids.shape[0], ids.shape[1], ssm_dtype=torch.float32)
        for t in range(0, ids.shape[1], chunk):
            model(ids[:, t:t + chunk], cache=cache)
            for layer, st in enumerate(cache.ssm_states):
                if st is None:
                    continue
                a = st.abs().reshape(st.shape[0], -1, st.shape[-1]).amax(0)  # (d, n)
                amax[layer] = a if layer not in amax else torch.maximum(amax[layer], a)
    return amax


def group_state_absmax(amax: torch.Tensor, index: torch.Tensor | None, n_groups: int) -> torch.Tensor:
    """(d, n) per-channel absmax -> (G, n) per x group."""
    if index is None:
        return amax.amax(0, keepdim=True)
    out = torch.zeros(n_groups, amax.shape[1], device=amax.device)
    return out.scatter_reduce(0, index.to(amax.device)[:, None].expand_as(amax), amax, reduce="amax")


def allocate_cache(model: nn.Module, max_batch: int, max_seqlen: int, ssm_dtype=None):
    """``model.allocate_cache`` without reading ``embedding.weight`` (a QuantEmbedding has none).

    Float buffers in float32 unless the model's float parameters are 16-bit; ``ssm_dtype=torch.int8``
    gives the int8 state cache.
    """
    p = next(p for p in model.parameters() if p.is_floating_point())
    return model.allocate_cache(max_batch, max_seqlen, p.dtype, p.device, ssm_dtype=ssm_dtype)


@torch.no_grad()
def enable_int8_state(model: nn.Module, clusters: dict[int, torch.Tensor], windows: torch.Tensor, chunk: int = 128,
                      batch_size: int = 8, progress: bool = False) -> None:
    """Calibrate (G, n) state scales per Mamba layer and swap its mixer for the Int8State class."""
    amax = calibrate_state_scales(model, windows, chunk, batch_size, progress)
    cfg = model.config
    for i, a in amax.items():
        index = clusters.get(i)
        groups = 1 if index is None else int(index.max()) + 1
        mixer = to_int8_state(model.layers[i].mixer, cfg, index, groups)
        mixer.state_scale.copy_((group_state_absmax(a, index, groups) / 127.0).clamp(min=1e-8))
        model.layers[i].mixer = mixer


def state_bytes(cache) -> int:
    """Bytes of the SSM states of a cache (conv states and KV excluded)."""
    return sum(s.numel() * s.element_size() for s in cache.ssm_states if s is not None)
