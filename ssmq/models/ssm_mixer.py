"""What the Mamba-1 and Mamba-2 mixers share: their per-layer state, in its storage format, and its spec.

Glossary: s cache slots, d d_inner, n d_state, G scale groups of the int8 state.

A mixer's SSM state is float unless ``enable_int8_state`` gave it an int8 format: calibrated scales (Quamba2's
8-bit cache), buffers ``state_scale`` (G, n) and, for G > 1, ``state_index`` (d,) (channel -> scale group); or
dynamic row scales (``state_rows``: no buffers, each cache slot keeps a scale per channel row).
The class does not change with the state format: one mixer per family, its state spec a parameter.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ssmq.models.layer_plan import LayerPlan
from ssmq.models.quant_taps import is_quantizer
from ssmq.models.state import Int8StateScales, MambaState, StateFormat

SPEC_KIND = "SSMMixer"


class SSMMixer(nn.Module):
    """Base of ``Mamba1Mixer`` and ``Mamba2Mixer``; subclasses set ``cfg``, ``layer_idx`` and ``state_shape``."""

    state_groups = 0  # 0: float state (unless state_rows); G >= 1: int8 state with G static scale groups
    state_rows = False  # int8 state with dynamic row scales (its absmax / 127 over n, at every write)

    def state_shape(self) -> tuple[int, ...]:
        """One slot's SSM state: (d, n) Mamba-1 | (h, p, n) Mamba-2, from this mixer's own (maybe sharded) sizes."""
        raise NotImplementedError

    def enable_int8_state(self, n_groups: int, index: torch.Tensor | None = None, rows: bool = False) -> None:
        """Give the state an int8 format with ``n_groups`` scale groups (scales 1 until calibrated), or with dynamic
        row scales (``rows``: nothing to calibrate, ``n_groups`` ignored)."""
        if rows:
            self.state_groups, self.state_rows = 0, True
            return
        *lead, n = self.state_shape()
        d, device = int(torch.Size(lead).numel()), self.A_log.device
        self.state_groups = n_groups
        self.register_buffer("state_scale", torch.ones(n_groups, n, dtype=torch.float32, device=device))
        if n_groups > 1:
            idx = torch.zeros(d, dtype=torch.long) if index is None else index.long()
            self.register_buffer("state_index", idx.to(device))
        else:
            self.state_index = None

    @property
    def int8_state(self) -> bool:
        """Whether the state is stored int8 (static scale groups or dynamic row scales)."""
        return bool(self.state_groups) or self.state_rows

    def state_scales(self) -> Int8StateScales | None:
        """The int8 state's scales (the buffers themselves: allocate the cache after moving the model)."""
        if self.state_rows:
            return Int8StateScales(None, rows=True)
        return Int8StateScales(self.state_scale, self.state_index) if self.state_groups else None

    def state_format(self, state: MambaState) -> str:
        """The SSM state's format in words (``LayerPlan.formats``)."""
        fmt = str(state.ssm.dtype).removeprefix("torch.")
        if state.format is StateFormat.INT8:
            fmt += " row scales" if self.state_rows else f" {self.state_groups} scale group(s)"
        return fmt + ("" if state.ring is None else f", checkpoint every {state.ring.every} steps")

    def quantizing(self, *taps: str) -> tuple[str, ...]:
        """Those of ``taps`` that quantize."""
        return tuple(t for t in taps if is_quantizer(getattr(self, t)))

    def plan(self, state: MambaState) -> LayerPlan:
        """The decode executor for ``state`` (``ssmq.models.layer_plan``)."""
        raise NotImplementedError

    def bc_groups(self) -> int:
        """B/C groups of this (maybe sharded) mixer: the width of a checkpoint ring's B."""
        return 1

    def allocate_state(self, max_batch: int, max_seqlen: int, dtype, device, ssm_dtype=None,
                       state_checkpoint: int | None = None, **_) -> MambaState:
        """Conv (s, c, w-1) and SSM (s, *state_shape) buffers, with the layer's decode plan (``state.plan``).
        ``ssm_dtype``: None gives the mixer's own format (int8 for an int8-state mixer, else ``dtype``); a float dtype
        asks for a float state explicitly; torch.int8 needs an int8-state mixer. ``state_checkpoint`` K checkpoints
        the SSM state every K steps (ReplaySSM, ``ssmq.models.state``)."""
        if ssm_dtype is None and self.int8_state:
            ssm_dtype = torch.int8
        state = MambaState.allocate(max_batch, self.conv1d.weight.shape[0], self.conv1d.kernel_size[0],
                                    self.state_shape(), dtype, device, ssm_dtype, self.state_scales(),
                                    checkpoint_every=state_checkpoint, bc_groups=self.bc_groups())
        state.plan = self.plan(state)
        return state

    def spec(self) -> dict | None:
        """The checkpoint's record of this mixer (None for a float state: the float skeleton rebuilds it)."""
        if not self.int8_state:
            return None
        state = {"bits": 8, "groups": self.state_groups} | ({"scales": "rows"} if self.state_rows else {})
        return {"kind": SPEC_KIND, "config": self.cfg.to_dict(), "layer_idx": self.layer_idx, "state": state}
