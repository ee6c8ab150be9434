"""Mamba-1 mixer: in_proj → causal conv → selective scan (Δ, B, C from x_proj) → out_proj.

Glossary: b batch, l length, d d_inner, n d_state, r dt_rank, w d_conv, s cache slots.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ssmq import kernels
from ssmq.models._float_params import FloatParamCache
from ssmq.models.config import ModelConfig
from ssmq.models.linear import Linear
from ssmq.models.conv import CausalConv1d, conv_prefill
from ssmq.models.layer_plan import LayerPlan
from ssmq.models.quant_taps import TapScaleCache, is_quantizer, unobserved_quantizers
from ssmq.models.ssm_mixer import SSMMixer
from ssmq.models.state import StateFormat
from ssmq.ops.quant_ssm import quantize_ref


class ChannelRMSNorm(nn.Module):
    """RMSNorm over the last dim, computed in float32, with a weight or without (``d`` 0): Falcon-Mamba's and Jamba's
    norms on Δ (before dt_proj), B and C."""

    def __init__(self, d: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d)) if d else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return y if self.weight is None else self.weight * y


class Mamba1Mixer(SSMMixer):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.cfg = cfg
        d, n, r = cfg.d_inner, cfg.d_state, cfg.dt_rank_
        self.d_inner, self.d_state, self.dt_rank = d, n, r
        self.proj_segments, self.x_proj_segments = cfg.in_proj_segments(), cfg.x_proj_segments()  # [x|z], [dt|B|C]
        self.in_proj = Linear(cfg.d_model, self.proj_segments.total, bias=cfg.proj_bias)
        self.conv1d = CausalConv1d(d, d, cfg.d_conv, groups=d, bias=cfg.conv_bias)
        self.x_proj = Linear(d, self.x_proj_segments.total, bias=False)
        # dt_proj's bias lives apart (as Mamba-2's dt_bias) so dt_proj is a plain, swappable Linear
        # and the bias is added in float32 inside the scan, before the softplus
        self.dt_proj = Linear(r, d, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(d))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, n + 1, dtype=torch.float32)).repeat(d, 1))
        self.D = nn.Parameter(torch.ones(d))
        self.out_proj = Linear(d, cfg.d_model, bias=cfg.proj_bias)
        if cfg.bcdt_norm:  # RMSNorms on x_proj's Δ, B, C (Falcon-Mamba without weights, Jamba with)
            weighted = cfg.bcdt_norm == "weighted"
            self.dt_layernorm, self.b_layernorm, self.c_layernorm = (
                ChannelRMSNorm(k if weighted else 0, cfg.bcdt_norm_eps) for k in (r, n, n))
        else:
            self.dt_layernorm = self.b_layernorm = self.c_layernorm = None
        for tap in ("act_x", "act_dt", "act_B", "act_C", "act_z", "act_y"):
            setattr(self, tap, nn.Identity())
        self._f32 = FloatParamCache()
        self._tap_scales = TapScaleCache()

    def state_shape(self) -> tuple[int, int]:
        return tuple(self.A_log.shape)  # (d, n) of this (maybe sharded) mixer

    def conv_input(self, in_proj_out: torch.Tensor) -> torch.Tensor:
        """in_proj's output (..., 2d) -> the conv's input x (..., d)."""
        return self.proj_segments.split(in_proj_out)[0]

    def _split_x_proj(self, x: torch.Tensor):
        """x: (..., d) conv output → x_proj's Δ (..., r), B, C (..., n), through the Δ/B/C norms when the family has
        them."""
        dt, B, C = self.x_proj_segments.split(self.x_proj(x))
        if self.dt_layernorm is None:
            return dt, B, C
        return self.dt_layernorm(dt), self.b_layernorm(B), self.c_layernorm(C)

    def _ssm_inputs(self, x: torch.Tensor):
        """x: (..., d) conv output → Δ (..., d) before bias/softplus, B, C (..., n), through the taps."""
        dt, B, C = self._split_x_proj(x)
        dt = self.act_dt(self.dt_proj(dt))
        return dt, self.act_B(B), self.act_C(C)

    def forward(self, hidden: torch.Tensor, cache=None, slots=None) -> torch.Tensor:
        """hidden: (b, l, d_model) → (b, l, d_model). With a cache, continues and updates the rows ``slots``."""
        x, z = self.proj_segments.split(self.in_proj(hidden))
        state = None if cache is None else cache.states[self.layer_idx]
        if unobserved_quantizers((self.act_x,)):  # the tap's fake-quant in the conv's kernel
            u = conv_prefill(self.conv1d, x, state, slots, fake_quant=self._tap_scales.get("x", (self.act_x,),
                                                                                          lambda s: s))
        else:
            u = self.act_x(conv_prefill(self.conv1d, x, state, slots))  # (b, l, d)
        dt, B, C = self._ssm_inputs(u)
        z = self.act_z(z)
        A = self._f32.get(self, "A_log")
        out = kernels.selective_scan(
            u.transpose(1, 2), dt.transpose(1, 2), A, B.transpose(1, 2), C.transpose(1, 2),
            D=self._f32.get(self, "D"), z=z.transpose(1, 2), delta_bias=self._f32.get(self, "dt_bias"),
            delta_softplus=True,
            initial_state=None if state is None else state.read_ssm(slots, A),
            return_last_state=state is not None,
        )
        if state is not None:
            out, last = out
            state.write_ssm(slots, last)
        return self.out_proj(self.act_y(out.transpose(1, 2)))

    def plan(self, state, executor: str | None = None) -> LayerPlan:
        """int8 when x, B or C quantize or the state is int8 or checkpointed, else float
        (``ssmq.models.layer_plan``); ``executor``: that one instead (either serves every state)."""
        formats = {"state": self.state_format(state)}
        if quantizing := self.quantizing("act_x", "act_B", "act_C", "act_dt", "act_z", "act_y"):
            formats["quantized taps"] = " ".join(t.removeprefix("act_") for t in quantizing)
        if self.conv1d.conv_format:
            formats["conv"] = self.conv1d.conv_format
        plain_state = state.format is StateFormat.FLOAT and state.ring is None
        name = executor or ("int8" if self.quantizing("act_x", "act_B", "act_C") or not plain_state else "float")
        if name == "float":
            kernels = ("causal_conv1d_update", "selective_state_update")
        else:
            update = "replay_state_update" if state.ring is not None else "quant_state_update"
            kernels = ("conv1d_update_silu_quant" if is_quantizer(self.act_x) else "causal_conv1d_update", update)
        if self.conv1d.conv_format:  # the same conv kernels, specialised for int8 weight and input codes
            kernels = (kernels[0] + "[int8]", *kernels[1:])
        return LayerPlan(name, self.EXECUTORS[name], kernels, formats, "selective_scan")

    def step(self, hidden: torch.Tensor, cache, slots: torch.Tensor) -> torch.Tensor:
        """hidden: (b, d_model), one token per row → (b, d_model); updates the cache rows ``slots`` by the state's
        plan."""
        state = cache.states[self.layer_idx]
        x, z = self.proj_segments.split(self.in_proj(hidden))
        return self.out_proj(self.act_y(state.plan.decode(self, x, z, state, slots)))

    def _decode_float(self, x: torch.Tensor, z: torch.Tensor, state, slots: torch.Tensor) -> torch.Tensor:
        """Float conv, the taps as they are, the float state update (``MambaState.update_ssm``).
        x, z: (b, d) in_proj outputs -> y (b, d)."""
        weight, bias, int8 = self.conv1d.kernel_weights()
        x = kernels.causal_conv1d_update(x, state.conv, weight, bias, activation="silu", conv_state_indices=slots,
                                         int8=int8)
        x = self.act_x(x)
        dt, B, C = self._ssm_inputs(x)
        A = self._f32.get(self, "A_log")
        z = self.act_z(z)
        return state.update_ssm(slots, lambda ssm, idx: kernels.selective_state_update(
            ssm, x, dt, A, B, C, D=self._f32.get(self, "D"), z=z,
            dt_bias=self._f32.get(self, "dt_bias"), dt_softplus=True, state_batch_indices=idx,
        ))

    def _decode_int8(self, x: torch.Tensor, z: torch.Tensor, state, slots: torch.Tensor) -> torch.Tensor:
        """Conv + SiLU emitting x's int8 codes (x_proj reads their dequantized values, the tap's output), B and C as
        codes, and one state-update kernel on the codes and the state as stored (``MambaState.step_ssm``).
        x, z: (b, d) in_proj outputs -> y (b, d) in their dtype."""
        (weight, bias, int8), dtype = self.conv1d.kernel_weights(), x.dtype
        if is_quantizer(self.act_x):
            x_scale = self._tap_scales.get("x", (self.act_x,), lambda s: s)
            x_q, x = kernels.conv1d_update_silu_quant(x, state.conv, weight, bias, x_scale, slots, dequantized=True,
                                                      int8=int8)
        else:
            x = x_q = self.act_x(kernels.causal_conv1d_update(x, state.conv, weight, bias, "silu", slots, int8))
            x_scale = None
        dt, B, C = self._split_x_proj(x)
        dt = self.act_dt(self.dt_proj(dt))
        (B, B_scale), (C, C_scale) = self._codes("act_B", B), self._codes("act_C", C)
        return state.step_ssm(slots, x_q, dt, self._f32.get(self, "A_log"), B, C, D=self._f32.get(self, "D"),
                              z=self.act_z(z), dt_bias=self._f32.get(self, "dt_bias"), dt_softplus=True,
                              x_scale=x_scale, B_scale=B_scale, C_scale=C_scale, out_dtype=dtype)

    EXECUTORS = {"int8": _decode_int8, "float": _decode_float}

    def _codes(self, tap: str, t: torch.Tensor):
        """(codes, channel scale) of a quantizing tap's input, or (the tap's float output, None)."""
        q = getattr(self, tap)
        if not is_quantizer(q):
            return q(t), None
        scale = self._tap_scales.get(tap, (q,), lambda s: s)
        if scale.dim() == 0:  # per tensor (Quamba's B, C): one Triton launch on CUDA, the same codes
            return kernels.quantize_act(t, scale, per_token=False)[0], scale
        return quantize_ref(t.float(), scale), scale
