"""Mamba-2 mixer: in_proj → [z | x B C | Δ] → causal conv on xBC → SSD → gated RMSNorm → out_proj.

Glossary: b batch, l length, d d_inner, h heads, p headdim, g ngroups, n d_state, w d_conv, s cache slots.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ssmq import kernels
from ssmq.errors import SSMQError
from ssmq.ops.layout import discretize_dt, has_dt_limit
from ssmq.models._float_params import FloatParamCache
from ssmq.models.act_codes import ActCodes, CodeInput, code_input
from ssmq.models.config import ModelConfig
from ssmq.models.linear import Linear
from ssmq.models.conv import CausalConv1d, conv_prefill
from ssmq.models.layer_plan import LayerPlan
from ssmq.models.quant_taps import TapScaleCache, is_quantizer, shaped, unobserved_quantizers
from ssmq.models.ssm_mixer import SSMMixer
from ssmq.models.state import StateFormat


class GatedRMSNorm(nn.Module):
    """norm(y · silu(z)) · weight, per group of ``group_size`` channels; ``norm_before_gate``: norm(y) · weight ·
    silu(z) (Falcon-H1's option)."""

    def __init__(self, d: int, eps: float, group_size: int, norm_before_gate: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps, self.group_size, self.norm_before_gate = eps, group_size, norm_before_gate

    def forward(self, y: torch.Tensor, z: torch.Tensor, codes: CodeInput | None = None,
                z_scale: torch.Tensor | None = None):
        """y, z: (..., d) -> (..., d) in y's dtype, or its int8 ``ActCodes`` (quantized in the norm's epilogue);
        ``z_scale`` () / (d,) fake-quantizes z in registers first, the ``act_z`` quantizer's job."""
        if codes is None:
            return kernels.rmsnorm_gated(y, self.weight, z, self.eps, self.group_size, self.norm_before_gate, z_scale)
        q, scale, _ = kernels.rmsnorm_gated_quant(y, self.weight, z, self.eps, self.group_size, False, codes.scale,
                                                  z_scale=z_scale, dtype=codes.dtype, rotate=codes.rotate)
        return ActCodes(q, scale, y.dtype)


class SiluGate(nn.Module):
    """y · silu(z), no norm and no weight (a Mamba-2 mixer without its output norm: Falcon-H1's option)."""

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return (y.float() * F.silu(z.float())).to(y.dtype)


def output_norm(cfg: ModelConfig) -> nn.Module:
    """The mixer's norm of y by ``cfg.ssm_norm``: gated RMSNorm (gate first or norm first), or the gate alone."""
    if cfg.ssm_norm == "none":
        return SiluGate()
    return GatedRMSNorm(cfg.d_inner, cfg.norm_eps, cfg.norm_group, norm_before_gate=cfg.ssm_norm == "gated_before")


def proj_scale(cfg: ModelConfig) -> list[float] | None:
    """in_proj's output scale per channel (2d + 2gn + h values): Falcon-H1's multipliers of z, x, B, C, Δ times its
    SSM input multiplier (in_proj has no bias then, so the input's scalar moves past it); None when all are 1. A
    list, not a tensor: mixers are built on the meta device too."""
    mults = cfg.ssm_proj_multipliers or (1.0,) * 5
    if cfg.ssm_in_multiplier == 1.0 and all(m == 1.0 for m in mults):
        return None
    seg = cfg.in_proj_segments()
    sizes = [seg.size(name) for name in ("z", "x", "B", "C", "dt")]
    return [m * cfg.ssm_in_multiplier for n, m in zip(sizes, mults) for _ in range(n)]


class ChunkScan(nn.Module):
    """The SSD chunked scan of a mixer: ``kernels.ssd_chunk_scan`` (signature and shapes as there). A module, so
    that a quantized scan with its own scales (SSDi8) can take its place and be saved with the model."""

    # continues a float state in its cache rows (``state_rows``); a scan without it gets initial states and returns
    # final ones
    takes_state_rows = True

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
        self.conv1d = CausalConv1d(cfg.conv_dim, cfg.conv_dim, cfg.d_conv, groups=cfg.conv_dim, bias=cfg.conv_bias)
        self.dt_bias = nn.Parameter(torch.zeros(h))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, h + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(h))
        self.norm = output_norm(cfg)
        self._proj_scale = proj_scale(cfg)
        self._proj_scales: dict = {}
        self.out_proj = Linear(d, cfg.d_model, bias=cfg.proj_bias)
        for tap in ("act_x", "act_dt", "act_B", "act_C", "act_z", "act_y"):
            setattr(self, tap, nn.Identity())
        self.ssd = ChunkScan()
        self._f32 = FloatParamCache()
        self._tap_scales = TapScaleCache()

    def state_shape(self) -> tuple[int, int, int]:
        return (self.A_log.shape[0], self.cfg.headdim, self.cfg.d_state)  # (h, p, n); h of this (maybe sharded) mixer

    def bc_groups(self) -> int:
        return self.cfg.ngroups

    def conv_input(self, in_proj_out: torch.Tensor) -> torch.Tensor:
        """in_proj's output -> the conv's input xBC (…, d + 2gn)."""
        return self._split_proj(in_proj_out)[1]

    def _split_proj(self, zxbcdt: torch.Tensor):
        """in_proj's output (…, 2d + 2gn + h) -> z (…, d), xBC (…, d + 2gn), dt (…, h), scaled per segment when
        the model has in_proj multipliers."""
        if self._proj_scale is not None:
            key = (zxbcdt.device, zxbcdt.dtype)
            if key not in self._proj_scales:
                self._proj_scales[key] = torch.tensor(self._proj_scale, device=zxbcdt.device, dtype=zxbcdt.dtype)
            zxbcdt = zxbcdt * self._proj_scales[key]
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
        x, B, C = self._prefill_xbc(xbc, state, slots)
        dt = self.act_dt(dt)
        A = self._f32.get(self, "A_log")
        args = (x.reshape(b, l, c.nheads, c.headdim), dt, A, B.reshape(b, l, c.ngroups, c.d_state),
                C.reshape(b, l, c.ngroups, c.d_state), c.chunk_size)
        kw = dict(D=self._f32.get(self, "D"), dt_bias=self._f32.get(self, "dt_bias"), dt_softplus=True,
                  dt_limit=c.dt_limit)
        # the float scan continues a float state in its cache rows (no gather, float32 copy or scatter a layer)
        rows = state.rows_in_place(slots) if state is not None and self.ssd.takes_state_rows else None
        if rows is not None:
            y = self.ssd(*args, **kw, state_rows=rows)
        elif state is not None:
            # a checkpointed state replays its ring with A as the decode step takes it, (h, p, n)
            initial = state.read_ssm(slots, A[:, None, None].expand(*self.state_shape()))
            y, final = self.ssd(*args, **kw, initial_states=initial, return_final_states=True)
            state.write_ssm(slots, final)
        else:
            y = self.ssd(*args, **kw)
        return self.out_proj(self._normed(y.reshape(b, l, c.d_inner), z))

    def _prefill_xbc(self, xbc: torch.Tensor, state, slots):
        """The conv's output through the x, B, C taps: x (b, l, d), B, C (b, l, g·n). When all three fake-quantize,
        the conv kernel applies their scales (one pass instead of four over the (b, l, conv_dim) output)."""
        taps = (self.act_x, self.act_B, self.act_C)
        if unobserved_quantizers(taps):
            scale = self._tap_scales.get("xbc", taps, self._xbc_scales)[0]
            return self.conv_segments.split(conv_prefill(self.conv1d, xbc, state, slots, fake_quant=scale))
        return self._split_xbc(conv_prefill(self.conv1d, xbc, state, slots))

    def _out_codes(self) -> CodeInput | None:
        """out_proj's ``CodeInput`` when it reads the plain gated norm's output directly (no quantizer on act_y); the
        norm also rotates (codes of its output's online Hadamard, for a rotated out_proj with a static scale)."""
        if type(self.act_y) is not nn.Identity or type(self.norm) is not GatedRMSNorm or self.norm.norm_before_gate:
            return None
        return code_input(self.out_proj, rotated=True)

    def _normed(self, y: torch.Tensor, z: torch.Tensor):
        """act_z, the gated norm and act_y: out_proj's input, as int8 codes when out_proj takes them (z from in_proj,
        fake-quantized inside the plain gated norm's kernel when act_z quantizes: no kernel of its own)."""
        codes = self._out_codes()
        if is_quantizer(self.act_z) and type(self.norm) is GatedRMSNorm:
            out = self.norm(y, z, codes, self._tap_scales.get("z", (self.act_z,), lambda s: s))
        elif codes is not None:
            out = self.norm(y, self.act_z(z), codes)
        else:
            out = self.norm(y, self.act_z(z))  # the norm may be SiluGate, which takes (y, z) only
        return out if codes is not None else self.act_y(out)

    def plan(self, state, executor: str | None = None) -> LayerPlan:
        """fused when no module sits on a tap before the norm, the norm is the plain gated one, out_proj takes its input float or as int8
        codes and the state is float, written every step; int8 when x, B or C quantize or the state is int8 or
        checkpointed; float otherwise (``ssmq.models.layer_plan``). ``executor``: that one instead (int8 and float
        serve every state; fused only the states it would be chosen for)."""
        codes = self._out_codes()
        norm = type(self.norm).__name__ if type(self.norm) is not GatedRMSNorm else "rmsnorm_gated" if codes is None \
            else "rmsnorm_gated_hadamard_quant" if codes.rotate else "rmsnorm_gated_quant"
        code_taps = self.quantizing("act_x", "act_B", "act_C")
        formats = {"state": self.state_format(state), "out_proj input": "float" if codes is None else
                   "rotated int8 codes" if codes.rotate else "int8 codes" if codes.dtype == torch.int8 else "e4m3 codes"}
        if quantizing := self.quantizing("act_x", "act_B", "act_C", "act_dt", "act_z"):
            formats["quantized taps"] = " ".join(t.removeprefix("act_") for t in quantizing)
        if self.conv1d.conv_format:
            formats["conv"] = self.conv1d.conv_format
        plain_state = state.format is StateFormat.FLOAT and state.ring is None
        plain_taps = all(type(getattr(self, t)) is nn.Identity
                         for t in ("act_x", "act_B", "act_C", "act_dt", "act_z"))
        fusable = plain_state and plain_taps and type(self.norm) is GatedRMSNorm and \
            not self.norm.norm_before_gate and (codes is None or codes.dtype == torch.int8 and not codes.rotate) and \
            not self.conv1d.conv_format  # the fused step's conv is the float one
        name = executor or ("fused" if fusable else "int8" if code_taps or not plain_state else "float")
        if name == "fused" and not fusable:
            raise SSMQError(f"layer {self.layer_idx}: the fused decode serves a float state, no quantizing tap, "
                            "float conv weights and the plain gated norm")
        conv = "conv1d_update_silu_quant" if name == "int8" and len(code_taps) == 3 else "causal_conv1d_update"
        conv += "[int8]" if self.conv1d.conv_format else ""  # the same kernels, for int8 weight and input codes
        update = {"int8": "replay_state_update" if state.ring is not None else "quant_state_update"}.get(
            name, "selective_state_update")
        prefill = "ssd_chunk_scan" if type(self.ssd) is ChunkScan else type(self.ssd).__name__
        return LayerPlan(name, self.EXECUTORS[name], (conv, update, norm), formats, prefill)

    def step(self, hidden: torch.Tensor, cache, slots: torch.Tensor) -> torch.Tensor:
        """hidden: (b, d_model), one token per row → (b, d_model); updates the cache rows ``slots`` by the state's
        plan."""
        state = cache.states[self.layer_idx]
        z, xbc, dt = self._split_proj(self.in_proj(hidden))
        return self.out_proj(state.plan.decode(self, z, xbc, dt, state, slots))

    def _decode_fused(self, z, xbc, dt, state, slots):
        """Conv, Δ, state update, gate and norm as one op (``kernels.mamba2_decode_step``), with out_proj's int8
        codes from the norm's epilogue. z (b, d), xbc (b, conv_dim), dt (b, h) -> out_proj's input (b, d)."""
        c, codes = self.cfg, self._out_codes()
        y = kernels.mamba2_decode_step(
            xbc, z, dt, state.conv, self.conv1d.weight.squeeze(1), self.conv1d.bias,
            state.ssm, self._f32.get(self, "A_log"), self._f32.get(self, "D"),
            self._f32.get(self, "dt_bias"), self.norm.weight, c.ngroups, self.norm.group_size, self.norm.eps,
            c.dt_limit, slots, quantize=codes is not None, out_scale=None if codes is None else codes.scale,
        )
        return self.act_y(y) if codes is None else ActCodes(y[1], y[2], y[0].dtype)

    def _decode_float(self, z, xbc, dt, state, slots):
        """Float conv, the taps as they are, the float state update (``MambaState.update_ssm``), then the norm."""
        weight, bias, int8 = self.conv1d.kernel_weights()
        xbc = kernels.causal_conv1d_update(xbc, state.conv, weight, bias, activation="silu", conv_state_indices=slots,
                                           int8=int8)
        x, B, C = self._split_xbc(xbc)
        y = state.update_ssm(slots, lambda ssm, idx: self._state_step(
            lambda *a, **kw: kernels.selective_state_update(ssm, *a, state_batch_indices=idx, **kw), x, dt, B, C))
        return self._normed(y.reshape(z.shape), z)

    def _decode_int8(self, z, xbc, dt, state, slots):
        """Conv + SiLU emitting the int8 codes of x, B, C (when their three taps quantize), then one state-update
        kernel on the codes and the state as stored (``MambaState.step_ssm``), then the norm."""
        weight, bias, int8 = self.conv1d.kernel_weights()
        taps = (self.act_x, self.act_B, self.act_C)
        if all(is_quantizer(t) for t in taps):
            xbc_scale, *scales = self._tap_scales.get("xbc", taps, self._xbc_scales)
            x, B, C = self.conv_segments.split(kernels.conv1d_update_silu_quant(xbc, state.conv, weight, bias,
                                                                                xbc_scale, slots, int8=int8))
        else:  # some of x, B, C stay 16-bit: the float conv, the taps as they are, float inputs
            x, B, C = self._split_xbc(kernels.causal_conv1d_update(xbc, state.conv, weight, bias, "silu", slots,
                                                                   int8))
            scales = (None, None, None)
        y = self._state_step(lambda *a, **kw: state.step_ssm(slots, *a, out_dtype=xbc.dtype, **kw), x, dt, B, C,
                             *scales)
        return self._normed(y.reshape(z.shape), z)

    EXECUTORS = {"fused": _decode_fused, "int8": _decode_int8, "float": _decode_float}

    def _xbc_scales(self, sx: torch.Tensor, sB: torch.Tensor, sC: torch.Tensor):
        """Channel scales of the x, B, C taps -> per conv channel (conv_dim,), and x (h, p), B (g, n), C (g, n) | ()."""
        c = self.cfg
        h, p, g, n = self.A_log.shape[0], c.headdim, c.ngroups, c.d_state
        widths = (self.conv_segments.size("x"), self.conv_segments.size("B"), self.conv_segments.size("C"))
        per_channel = torch.cat([s.reshape(-1).expand(w) for s, w in zip((sx, sB, sC), widths)])
        return per_channel, shaped(sx, (h, p)), shaped(sB, (g, n)), shaped(sC, (g, n))

    def _state_step(self, update, x, dt, B, C, x_scale=None, B_scale=None, C_scale=None):
        """Call a state update (``kernels.selective_state_update`` or ``MambaState.step_ssm``, bound to the state)
        with Mamba-2's multi-head layout: x (b, d) -> (b, h, p), B, C (b, g·n) -> (b, g, n), per-head Δ, A, D
        expanded over p and n (stride 0)."""
        c = self.cfg
        b = x.shape[0]
        h, p, g, n = self.A_log.shape[0], c.headdim, c.ngroups, c.d_state
        dt, dt_bias, softplus = self._clamped_dt(self.act_dt(dt))
        A = self._f32.get(self, "A_log")
        extra = {} if x_scale is None and B_scale is None and C_scale is None else \
            {"x_scale": x_scale, "B_scale": B_scale, "C_scale": C_scale}
        return update(
            x.reshape(b, h, p), dt[:, :, None].expand(b, h, p), A[:, None, None].expand(h, p, n),
            B.reshape(b, g, n), C.reshape(b, g, n), D=self._f32.get(self, "D")[:, None].expand(h, p),
            dt_bias=None if dt_bias is None else dt_bias[:, None].expand(h, p), dt_softplus=softplus, **extra,
        )
