"""8-bit SSM state cache (Quamba2): states are quantized before they are written to the cache and
dequantized when read, with static scales that reuse x's groups (d_state × G scales, G = m·n).

Glossary: s cache slots, d d_inner, h heads, p headdim, n d_state, G scale groups of x.

The mixers keep their float maths; a mixer with an int8 state (``SSMMixer.enable_int8_state``: buffers
``state_scale`` (G, n), ``state_index`` (d,)) only hands its scales to the state it allocates
(``ssmq.models.state.MambaState`` in the int8 format), which dequantizes the served rows before a
prefill and re-quantizes the final state after (``ssmq.ops.quant_ssm.quantize_state_ref``); a decode step
reads and writes the int8 rows in place in one kernel (``MambaState.step_ssm``: ``quant_state_update``). Allocate the cache with
``model.allocate_cache(..., ssm_dtype=torch.int8)``; a float cache keeps working unchanged. Scales are calibrated on the states reached at chunk boundaries of the windows.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ssmq.errors import SSMQError
from ssmq.models.config import ModelConfig


def empty_int8_state_mixer(cfg: ModelConfig, layer_idx: int, n_groups: int, rows: bool = False) -> nn.Module:
    """The family's mixer for layer ``layer_idx`` with an int8 state of ``n_groups`` scale groups (scales 1), or
    with dynamic row scales (``rows``)."""
    from ssmq.models.lm import MIXERS

    m = MIXERS[cfg.layer_kind(layer_idx)](cfg, layer_idx)
    m.enable_int8_state(n_groups, rows=rows)
    return m


def from_spec(spec: dict, dtype=None, device=None) -> nn.Module:
    """Checkpoint loader entry for the kinds ``SSMMixer`` and, from checkpoints written before it,
    ``SSMInt8StateMixer`` (``{"config", "layer_idx", "state_groups"}``): the same mixer, the same tensors."""
    cfg = ModelConfig.from_dict(spec["config"])
    groups = spec["state_groups"] if spec["kind"] == "SSMInt8StateMixer" else spec["state"]["groups"]
    state = spec.get("state", {})
    if spec["kind"] == "SSMMixer" and state.get("bits", 8) != 8:
        raise SSMQError(f"SSM state of {state['bits']} bits: this ssmq has int8 states only")
    if state.get("scales", "table") not in ("table", "rows"):
        raise SSMQError(f"SSM state scales {state['scales']!r}: this ssmq knows static tables and dynamic rows")
    return empty_int8_state_mixer(cfg, spec["layer_idx"], groups, rows=state.get("scales") == "rows")


def to_int8_state(mixer: nn.Module, cfg: ModelConfig, index: torch.Tensor | None, n_groups: int) -> nn.Module:
    """Give ``mixer`` an int8 state of ``n_groups`` scale groups (channel map ``index`` (d,)); returns it (the same
    module: the class does not change with the state format)."""
    mixer.enable_int8_state(n_groups, index)
    return mixer


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
                      batch_size: int = 8, progress: bool = False, layout: str = "x_groups") -> None:
    """Give every Mamba layer's mixer the int8 state format with the scales of ``layout`` (recipe
    ``cache.state_scales``): "x_groups", (G, n) calibrated per x scale group (``clusters``, Quamba2); "per_channel",
    every channel its own group (G = d); "dynamic", a scale per row computed when the state is written (nothing to
    calibrate)."""
    if layout == "dynamic":
        for layer in model.layers:
            if hasattr(layer.mixer, "enable_int8_state"):
                layer.mixer.enable_int8_state(0, rows=True)
        return
    per_channel = layout == "per_channel"
    amax = calibrate_state_scales(model, windows, chunk, batch_size, progress)
    cfg = model.config
    for i, a in amax.items():
        index = torch.arange(a.shape[0], device=a.device) if per_channel else clusters.get(i)
        groups = 1 if index is None else int(index.max()) + 1
        mixer = to_int8_state(model.layers[i].mixer, cfg, index, groups)
        mixer.state_scale.copy_((group_state_absmax(a, index, groups) / 127.0).clamp(min=1e-8))


def state_bytes(cache) -> int:
    """Bytes of the SSM states of a cache, their row scales included (conv states and KV excluded)."""
    return sum(st.ssm_nbytes() for st in cache.states if hasattr(st, "ssm_nbytes"))
