"""InferenceCache: the slot-indexed cache, one state object per layer (``ssmq.models.state``).

Every state has a leading slot dimension s (max batch), so decode can run on any subset of rows
(continuous batching) and the buffers never move (CUDA graphs).
    states[i]: MambaState (conv (s, c, w-1), ssm (s, d, n) | (s, h, p, n)) or KVState (k, v (s, L, hkv, e))
    seqlens:   (s,) tokens seen per slot
Mixers reach their state as ``cache.states[layer_idx]``. The lists ``conv_states``, ``ssm_states``,
``key_cache``, ``value_cache`` (None for the other kind of layer) are views for older callers.
"""

from __future__ import annotations

import torch

from ssmq.models.state import KVState, MambaState, fill_rows


def int8_state_note(model, state_checkpoint: int | None) -> str | None:
    """A one-line caution for decoding ``model`` on its int8 SSM state written every step, else None: re-quantized at
    every token the state drifts (trained mamba2, CPU reference path, perplexity at 2048 tokens: Quamba2's
    x-group table +2.7%, dynamic row scales +1.5%), where a checkpoint re-quantized once per K steps (+0.08%), or a
    per-channel table (+0.10%), do not."""
    if state_checkpoint is not None or calibrated_ssm_dtype(model) != torch.int8:
        return None
    tables = [m for m in model.modules() if hasattr(m, "state_scale")]
    rows = any(getattr(m, "state_rows", False) for m in model.modules())

    def per_channel(m) -> bool:  # a scale per channel: the table has a row per state_index entry, or is SSDi8's
        if not hasattr(m, "state_index"):  # SSDi8's scan: state_scale (h, p), one scale per channel
            return True
        return m.state_index is not None and m.state_scale.shape[0] == m.state_index.numel()

    # per-channel tables (G = d: cache.state_scales "per_channel", or SSDi8's) keep the drift small
    if not rows and all(per_channel(m) for m in tables):
        return None
    return ("this model decodes on an int8 SSM state written every step, which drifts on long outputs (+1.5-2.7% "
            "perplexity at 2048 tokens on the reference mamba2); --state-checkpoint 16 or a recipe with per-channel "
            "state scales keeps it accurate (README: 8-bit SSM state cache)")


def calibrated_ssm_dtype(model) -> torch.dtype | None:
    """torch.int8 when the model's mixers carry calibrated int8-state scales (an int8-state recipe), else None (the
    activation dtype): the SSM state format a runner allocates for the model unless told otherwise."""
    return torch.int8 if any(hasattr(m, "state_scale") or getattr(m, "state_rows", False)
                             for m in model.modules()) else None


class InferenceCache:
    def __init__(self, states: list, seqlens: torch.Tensor, max_seqlen: int):
        self.states, self.seqlens, self.max_seqlen = list(states), seqlens, max_seqlen

    @property
    def max_batch(self) -> int:
        return self.seqlens.shape[0]

    def reset(self, slots=None) -> None:
        """Forget the sequences in ``slots`` (all when None) so the slots can take new prompts."""
        idx = None if slots is None else torch.as_tensor(slots, device=self.seqlens.device, dtype=torch.long)
        for st in self.states:
            st.reset(idx)
        fill_rows(self.seqlens, idx)

    def append_kv(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Write k, v (b, l, hkv, e) at ``positions`` (b, l) of the rows ``slots`` of attention layer ``layer``."""
        self.states[layer].append(slots, positions, k, v)

    def nbytes(self) -> int:
        return sum(st.nbytes() for st in self.states)

    # views of the buffers, per layer, for callers written before the state objects
    def _buffers(self, kind, attr):
        return [getattr(st, attr) if isinstance(st, kind) else None for st in self.states]

    @property
    def conv_states(self) -> list:
        return self._buffers(MambaState, "conv")

    @property
    def ssm_states(self) -> list:
        return self._buffers(MambaState, "ssm")

    @property
    def key_cache(self) -> list:
        return self._buffers(KVState, "k")

    @property
    def value_cache(self) -> list:
        return self._buffers(KVState, "v")
