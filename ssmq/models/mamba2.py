"""Mamba-2 mixer: in_proj → [z | x B C | Δ] → causal conv on xBC → SSD → gated RMSNorm → out_proj.

Glossary: b batch, l length, d d_inner, h heads, p headdim, g ngroups, n d_state, w d_conv, s cache slots.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ssmq import kernels
from ssmq.ops.layout import discretize_dt, has_dt_limit
from ssmq.models._float_params import FloatParamCache
from ssmq.models.config import ModelConfig
from ssmq.models.linear import Linear
from ssmq.models.conv import conv_prefill
from ssmq.models.ssm_mixer import SSMMixer


class GatedRMSNorm(nn.Module):
    """norm(y · silu(z)) · weight, per group of ``group_size`` channels."""

    def __init__(self, d: int, eps: float, group_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps, self.group_size = eps, group_size

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return kernels.rmsnorm_gated(y, self.weight, z, self.eps, self.group_size, norm_before_gate=False)


class ChunkScan(nn.Module):
    """The SSD chunked scan of a mixer: ``kernels.ssd_chunk_scan`` (signature and shapes as there). A module, so
    that a quantized scan with its own scales (SSDi8) can take its place and be saved with the model."""

    def forward(self, *args, **kwargs):
        return kernels.ssd_chunk_scan(*args, **kwargs)


class Mamba2Mixer(SSMMixer):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.cfg = cfg
        d, h = cfg.d_inner, cfg.nheads
        self.proj_segments = cfg.in_proj_segments().fuse(("x", "B", "C"), "xBC")  # [z | xBC | dt]
        self.conv_segments = cfg.conv_segments()  # [x | B | C]
        self.in_proj = Linear(cfg.d_model, self.proj_segments.total, bias=cfg.proj_bias)
        self.conv1d = nn.Conv1d(cfg.conv_dim, cfg.conv_dim, cfg.d_conv, groups=cfg.conv_dim, bias=cfg.conv_bias)
        self.dt_bias = nn.Parameter(torch.zeros(h))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, h + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(h))
        self.norm = GatedRMSNorm(d, cfg.norm_eps, cfg.norm_group)
        self.out_proj = Linear(d, cfg.d_model, bias=cfg.proj_bias)
        for tap in ("act_x", "act_dt", "act_B", "act_C", "act_z", "act_y"):
            setattr(self, tap, nn.Identity())
        self.ssd = ChunkScan()
        self._f32 = FloatParamCache()

    def state_shape(self) -> tuple[int, int, int]:
        return (self.A_log.shape[0], self.cfg.headdim, self.cfg.d_state)  # (h, p, n); h of this (maybe sharded) mixer

    def _split_proj(self, zxbcdt: torch.Tensor):
        """(…, 2d + 2gn + h) -> z (…, d), xBC (…, d + 2gn), dt (…, h)."""
        return self.proj_segments.split(zxbcdt)

    def _split_xbc(self, xbc: torch.Tensor):
        x, B, C = self.conv_segments.split(xbc)
        return self.act_x(x), self.act_B(B), self.act_C(C)

    def _clamped_dt(self, dt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
        """Decode's state update knows no dt_limit: apply bias, softplus and the clamp here when one is set."""
        if not has_dt_limit(self.cfg.dt_limit):
            return dt, self._f32.get(self, "dt_bias"), True
        return discretize_dt(dt, self._f32.get(self, "dt_bias"), True, self.cfg.dt_limit), None, False

    def forward(self, hidden: torch.Tensor, cache=None, slots=None) -> torch.Tensor:
        """hidden: (b, l, d_model) → (b, l, d_model). With a cache, continues and updates the rows ``slots``."""
        c = self.cfg
        b, l, _ = hidden.shape
        z, xbc, dt = self._split_proj(self.in_proj(hidden))
        state = None if cache is None else cache.states[self.layer_idx]
        x, B, C = self._split_xbc(conv_prefill(self.conv1d, xbc, state, slots))
        dt = self.act_dt(dt)
        A = self._f32.get(self, "A_log")
        y = self.ssd(
            x.reshape(b, l, c.nheads, c.headdim), dt, A,
            B.reshape(b, l, c.ngroups, c.d_state), C.reshape(b, l, c.ngroups, c.d_state), c.chunk_size,
            D=self._f32.get(self, "D"), dt_bias=self._f32.get(self, "dt_bias"), dt_softplus=True, dt_limit=c.dt_limit,
            initial_states=None if state is None else state.read_ssm(slots),
            return_final_states=state is not None,
        )
        if state is not None:
            y, final = y
            state.write_ssm(slots, final)
        y = self.norm(y.reshape(b, l, c.d_inner), self.act_z(z))
        return self.out_proj(self.act_y(y))

    def _fusable(self, state) -> bool:
        """No quantizer on a tap between in_proj and the norm, the plain gated norm and a float SSM state (an int8
        state steps through ``state.update_ssm``): one fused op can run it."""
        taps = (self.act_x, self.act_B, self.act_C, self.act_dt, self.act_z)
        return (all(type(t) is nn.Identity for t in taps) and type(self.norm) is GatedRMSNorm
                and state.ssm.dtype != torch.int8)

    def step(self, hidden: torch.Tensor, cache, slots: torch.Tensor) -> torch.Tensor:
        """hidden: (b, d_model), one token per row → (b, d_model); updates the cache rows ``slots``."""
        c = self.cfg
        b = hidden.shape[0]
        h, p = c.nheads, c.headdim
        state = cache.states[self.layer_idx]
        z, xbc, dt = self._split_proj(self.in_proj(hidden))
        if self._fusable(state):  # conv, Δ, state update, gate and norm as one op (kernels.mamba2_decode_step)
            y = kernels.mamba2_decode_step(
                xbc, z, dt, state.conv, self.conv1d.weight.squeeze(1), self.conv1d.bias,
                state.ssm, self._f32.get(self, "A_log"), self._f32.get(self, "D"),
                self._f32.get(self, "dt_bias"), self.norm.weight, c.ngroups, self.norm.group_size, self.norm.eps,
                c.dt_limit, slots,
            )
            return self.out_proj(self.act_y(y))
        xbc = kernels.causal_conv1d_update(
            xbc, state.conv, self.conv1d.weight.squeeze(1), self.conv1d.bias,
            activation="silu", conv_state_indices=slots,
        )
        x, B, C = self._split_xbc(xbc)
        dt, dt_bias, softplus = self._clamped_dt(self.act_dt(dt))
        A = self._f32.get(self, "A_log")
        y = state.update_ssm(slots, lambda ssm, idx: kernels.selective_state_update(
            ssm, x.reshape(b, h, p), dt[:, :, None].expand(b, h, p),
            A[:, None, None].expand(h, p, c.d_state),
            B.reshape(b, c.ngroups, c.d_state), C.reshape(b, c.ngroups, c.d_state),
            D=self._f32.get(self, "D")[:, None].expand(h, p),
            dt_bias=None if dt_bias is None else dt_bias[:, None].expand(h, p),
            dt_softplus=softplus, state_batch_indices=idx,
        ))
        y = self.norm(y.reshape(b, c.d_inner), self.act_z(z))
        return self.out_proj(self.act_y(y))
