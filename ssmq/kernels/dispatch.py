"""Device dispatch: Triton kernel for CUDA tensors when one exists, the reference otherwise.

Kernel modules are imported on first use, so ``import ssmq`` never needs triton
(CI has none); without triton, CUDA tensors also fall back to the references.
Where several kernels serve one op, a selection table says which serves what: rows of requirements on the launch
(bits, head dim, rotary dim, dtype, rows, needs Gluon), the first row whose requirements hold and that the active
``KernelPolicy`` allows runs (``select``).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import math
import re
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ssmq import ops
from ssmq.kernels.policy import KernelPolicy, active

_HAS_TRITON = importlib.util.find_spec("triton") is not None


def _use_triton(t) -> bool:
    return t.is_cuda and _HAS_TRITON and not active().reference_ops


@functools.cache
def _kernels(module: str):
    # cached: a prefill forward asks for a module about 12 times a layer, and the import machinery's lookup is
    # several microseconds of host time each
    return importlib.import_module(f"ssmq.kernels.{module}")


def causal_conv1d(x, weight, bias=None, initial_states=None, return_final_states=False, activation=None, int8=None):
    """``ops.causal_conv1d_ref``; ``int8`` (``ops.conv1d.ConvInt8``): weight and bias are int8 codes."""
    impl = _kernels("conv1d").causal_conv1d if _use_triton(x) else ops.causal_conv1d_ref
    return impl(x, weight, bias, initial_states, return_final_states, activation, int8=int8)


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, conv_state_indices=None, int8=None):
    impl = _kernels("conv1d").causal_conv1d_update if _use_triton(x) else ops.causal_conv1d_update_ref
    return impl(x, conv_state, weight, bias, activation, conv_state_indices, int8=int8)


def conv1d_silu_quant(x, weight, bias, out_scale, initial_states=None, return_final_states=False, int8=None,
                      fake_quant=False):
    """``ops.quant_ssm.conv1d_silu_quant_ref``: conv + SiLU with int8 codes out (Quamba's fused conv), or with
    ``fake_quant`` their values (fake-quant taps on the output, in the conv's kernel)."""
    from ssmq.ops.quant_ssm import conv1d_silu_quant_ref

    impl = _kernels("conv1d").conv1d_silu_quant if _use_triton(x) else conv1d_silu_quant_ref
    return impl(x, weight, bias, out_scale, initial_states, return_final_states, int8=int8, fake_quant=fake_quant)


def conv1d_update_silu_quant(x, conv_state, weight, bias, out_scale, conv_state_indices=None, dequantized=False,
                             int8=None):
    """``ops.quant_ssm.conv1d_update_silu_quant_ref``: the decode step of ``conv1d_silu_quant``."""
    from ssmq.ops.quant_ssm import conv1d_update_silu_quant_ref

    impl = _kernels("conv1d").conv1d_update_silu_quant if _use_triton(x) else conv1d_update_silu_quant_ref
    return impl(x, conv_state, weight, bias, out_scale, conv_state_indices, dequantized, int8=int8)


def selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                   initial_state=None, return_last_state=False):
    impl = _kernels("scan").selective_scan if _use_triton(u) else ops.selective_scan_ref
    return impl(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, return_last_state)


def ssd_chunk_scan(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, dt_softplus=False,
                   dt_limit=(0.0, float("inf")), initial_states=None, return_final_states=False, state_rows=None):
    impl = _kernels("ssd").ssd_chunk_scan if _use_triton(x) else ops.ssd_chunk_scan_ref
    return impl(x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_softplus, dt_limit, initial_states,
                return_final_states, state_rows)


def quant_selective_scan(u_q, u_scale, dt_q, dt_scale, A, B_q, B_scale, C_q, C_scale, D=None, z_q=None, z_scale=None,
                         delta_bias=None, delta_softplus=True, initial_state=None, return_last_state=False,
                         out_dtype=None):
    """``ops.quant_ssm.quant_selective_scan_ref``: Mamba-1 prefill on int8 u, B, C (Δ, z codes or float) (Quamba);
    the float selective-scan kernel with the codes dequantized in registers on CUDA."""
    from ssmq.ops.quant_ssm import quant_selective_scan_ref

    impl = _kernels("scan").quant_selective_scan if _use_triton(u_q) else quant_selective_scan_ref
    return impl(u_q, u_scale, dt_q, dt_scale, A, B_q, B_scale, C_q, C_scale, D, z_q, z_scale, delta_bias,
                delta_softplus, initial_state, return_last_state, out_dtype)


def quant_ssd(x_q, x_scale, dt, A, B_q, B_scale, C_q, C_scale, chunk_size, D=None, dt_bias=None, dt_softplus=True,
              dt_limit=(0.0, float("inf")), initial_states=None, return_final_states=False, out_dtype=None):
    """``ops.quant_ssm.quant_ssd_ref``: SSD prefill on int8 x, B, C codes (Quamba2); the float SSD kernels with their
    codes dequantized in registers on CUDA."""
    from ssmq.ops.quant_ssm import quant_ssd_ref

    impl = _kernels("ssd").quant_ssd_chunk_scan if _use_triton(x_q) else quant_ssd_ref
    return impl(x_q, x_scale, dt, A, B_q, B_scale, C_q, C_scale, chunk_size, D, dt_bias, dt_softplus, dt_limit,
                initial_states, return_final_states, out_dtype)


def ssd_int8(x, dt, A, B_q, B_scale, C_q, C_scale, xs_scale, state_scale, chunk_size, D=None, z=None, dt_bias=None,
             dt_softplus=False, dt_limit=(0.0, float("inf")), initial_states=None, return_final_states=False,
             x_scale=None, options=None):
    """SSDi8 prefill (``ssmq.ops.ssd_int8``): Triton integer stages on CUDA, the exact reference elsewhere."""
    from ssmq.ops.ssd_int8 import SSDi8Options, ssd_int8_ref

    impl = _kernels("ssdi8").ssd_int8 if _use_triton(x) else ssd_int8_ref
    return impl(x, dt, A, B_q, B_scale, C_q, C_scale, xs_scale, state_scale, chunk_size, D, z, dt_bias, dt_softplus,
                dt_limit, initial_states, return_final_states, x_scale, options or SSDi8Options())


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                           state_batch_indices=None):
    impl = _kernels("state_update").selective_state_update if _use_triton(state) else ops.selective_state_update_ref
    return impl(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices)


def fake_quantize(x, scale):
    """``ops.quant_ssm.fake_quantize_ref``: an ``ActQuantizer``'s dequantize(quantize(x)), one kernel on CUDA."""
    from ssmq.ops.quant_ssm import fake_quantize_ref

    impl = _kernels("fake_quant").fake_quantize if _use_triton(x) else fake_quantize_ref
    return impl(x, scale)


def quant_state_update(state_q, state_scale, state_index, x_q, x_scale, dt, A, B_q, B_scale, C_q, C_scale, D=None,
                       z=None, dt_bias=None, dt_softplus=True, state_batch_indices=None, out_dtype=None):
    """``ops.quant_ssm.quant_state_update_ref``: int8 or float state, int8 or float x / B / C; one kernel on CUDA."""
    from ssmq.ops.quant_ssm import quant_state_update_ref

    impl = _kernels("state_update").quant_state_update if _use_triton(state_q) else quant_state_update_ref
    return impl(state_q, state_scale, state_index, x_q, x_scale, dt, A, B_q, B_scale, C_q, C_scale, D, z, dt_bias,
                dt_softplus, state_batch_indices, out_dtype)


def read_state(state, state_scale, state_index, idx):
    """``ops.quant_ssm.read_state_ref``: rows of a stored SSM state as float32; one kernel on CUDA for an int8 state."""
    from ssmq.ops.quant_ssm import read_state_ref

    int8 = state.dtype == torch.int8 and state_scale is not None
    impl = _kernels("state_io").read_state if int8 and _use_triton(state) else read_state_ref
    return impl(state, state_scale, state_index, idx)


def write_state(state, state_scale, state_index, idx, values) -> None:
    """``ops.quant_ssm.write_state_ref``: float values into rows of a stored SSM state, in its format; one kernel on
    CUDA for an int8 state (codes, and row scales where it has them)."""
    from ssmq.ops.quant_ssm import write_state_ref

    int8 = state.dtype == torch.int8 and state_scale is not None
    impl = _kernels("state_io").write_state if int8 and _use_triton(state) else write_state_ref
    impl(state, state_scale, state_index, idx, values)


def replay_state_update(ckpt, state_scale, state_index, ring, x_q, x_scale, dt, A, B_q, B_scale, C_q, C_scale, D=None,
                        z=None, dt_bias=None, dt_softplus=True, state_batch_indices=None, out_dtype=None):
    """``ops.replay_ssm.replay_state_update_ref``: a checkpointed (ReplaySSM) decode step; one kernel on CUDA."""
    from ssmq.ops.replay_ssm import replay_state_update_ref

    impl = _kernels("state_update").replay_state_update if _use_triton(ckpt) else replay_state_update_ref
    return impl(ckpt, state_scale, state_index, ring, x_q, x_scale, dt, A, B_q, B_scale, C_q, C_scale, D, z, dt_bias,
                dt_softplus, state_batch_indices, out_dtype)


def mamba2_decode_step(xbc, z, dt, conv_state, conv_weight, conv_bias, ssm_state, A, D, dt_bias, norm_weight,
                       ngroups, norm_group_size, eps, dt_limit=(0.0, math.inf), slots=None, quantize=False,
                       out_scale=None):
    args = (xbc, z, dt, conv_state, conv_weight, conv_bias, ssm_state, A, D, dt_bias, norm_weight,
            ngroups, norm_group_size, eps, dt_limit, slots, quantize, out_scale)
    """``ops.mamba2_decode_step_ref``: conv, state update and gated norm of a decode step; on CUDA the three kernels
    of those stages (a kernel fusing them measured no faster end to end: ``ssmq.prototype.mamba2_decode``)."""
    if not _use_triton(xbc):
        return ops.mamba2_decode_step_ref(*args)
    from ssmq.ops.mamba2_decode import compose

    norm = _kernels("norm")
    return compose(_kernels("conv1d").causal_conv1d_update, _kernels("state_update").selective_state_update,
                   norm.rmsnorm_gated, *args, norm.rmsnorm_gated_quant)


def rms_norm(x, weight, eps=1e-5, residual=None, residual_in_fp32=True):
    impl = _kernels("norm").rms_norm if _use_triton(x) else ops.rms_norm_ref
    return impl(x, weight, eps, residual, residual_in_fp32)


def rmsnorm_gated(x, weight, z=None, eps=1e-6, group_size=None, norm_before_gate=False, z_scale=None):
    impl = _kernels("norm").rmsnorm_gated if _use_triton(x) else ops.rmsnorm_gated_ref
    return impl(x, weight, z, eps, group_size, norm_before_gate, z_scale)


def act_quant_fusion_enabled() -> bool:
    """Whether the producer of an A8 linear's input emits its codes (``KernelPolicy.act_quant_fusion``); on CPU both
    ways are the same references, bit for bit."""
    return active().act_quant_fusion


def rms_norm_quant(x, weight, eps=1e-5, residual=None, residual_in_fp32=True, x_scale=None, per_token=True,
                   dtype=torch.int8):
    """``ops.norm.rms_norm_quant_ref``: residual add + RMSNorm with int8 / e4m3 codes out -> (codes, scale,
    new_residual)."""
    impl = _kernels("norm").rms_norm_quant if _use_triton(x) else ops.rms_norm_quant_ref
    return impl(x, weight, eps, residual, residual_in_fp32, x_scale, per_token, dtype)


def rmsnorm_gated_quant(x, weight, z=None, eps=1e-6, group_size=None, norm_before_gate=False, x_scale=None,
                        per_token=True, with_out=False, z_scale=None, dtype=torch.int8, rotate=False):
    """``ops.norm.rmsnorm_gated_quant_ref``: the gated norm (``z_scale``: on z fake-quantized in registers) with int8
    or e4m3 codes out -> (codes, scale, out or None); ``rotate``: int8 codes of the output's online Hadamard (a
    rotated A8 linear's input, ``kernels.hadamard``)."""
    if not _use_triton(x):
        return ops.rmsnorm_gated_quant_ref(x, weight, z, eps, group_size, norm_before_gate, x_scale, per_token,
                                           with_out, rotate, z_scale, dtype)
    if rotate:  # int8 codes only (``QuantLinear.code_input`` offers no rotated e4m3 ones)
        return _kernels("hadamard").rmsnorm_gated_hadamard_quant(x, weight, z, eps, group_size, norm_before_gate,
                                                                 x_scale, per_token, with_out, z_scale)
    return _kernels("norm").rmsnorm_gated_quant(x, weight, z, eps, group_size, norm_before_gate, x_scale, per_token,
                                                with_out, z_scale, dtype)


def moe_experts(x, weights, idx, w_up, w_down, w_gate=None, act="silu", w_scales=None, act_fp8=False):
    """``ops.moe.moe_experts_ref``: the routed experts of a mixture of experts on their stacked weights, float or
    quantized (codes with ``w_scales``; ``act_fp8``: FP8 W8A8); two grouped GEMM launches for all experts on CUDA
    (``kernels.moe``: static shapes, no host sync), the reference elsewhere."""
    from ssmq.ops.moe import moe_experts_ref

    impl = _kernels("moe").moe_experts if _use_triton(x) else moe_experts_ref
    return impl(x, weights, idx, w_up, w_down, w_gate, act, w_scales, act_fp8)


def rmsnorm_gated_partial(x, weight, z, ss_out, col=0, with_out=True, norm_before_gate=False):
    """``ops.norm.rmsnorm_gated_partial_ref``: a tensor-parallel rank's gated norm before the group's all-reduce."""
    from ssmq.ops.norm import rmsnorm_gated_partial_ref

    impl = _kernels("norm_sharded").rmsnorm_gated_partial if _use_triton(x) else rmsnorm_gated_partial_ref
    return impl(x, weight, z, ss_out, col, with_out, norm_before_gate)


def rmsnorm_gated_reduced(x, weight, z, ss, col, group_size, eps, norm_before_gate=False):
    """``ops.norm.rmsnorm_gated_reduced_ref``: the rank's gated norm from its group's all-reduced sum of squares."""
    from ssmq.ops.norm import rmsnorm_gated_reduced_ref

    impl = _kernels("norm_sharded").rmsnorm_gated_reduced if _use_triton(x) else rmsnorm_gated_reduced_ref
    return impl(x, weight, z, ss, col, group_size, eps, norm_before_gate)


def rstd_scale(red, group_size, eps, bias=None, out_dtype=None):
    """``ops.norm.rstd_scale_ref``: the fused norm + out_proj all-reduce's result, normalised per token."""
    from ssmq.ops.norm import rstd_scale_ref

    impl = _kernels("norm_sharded").rstd_scale if _use_triton(red) else rstd_scale_ref
    return impl(red, group_size, eps, bias, out_dtype)


def _gemv(x, weight, bias=None) -> bool:
    launch = dict(dtype=_name(x.dtype), rows=math.prod(x.shape[:-1]),
                  same_dtype=weight.dtype == x.dtype and (bias is None or bias.dtype == x.dtype))
    return _use_triton(x) and select(LINEAR, launch) == "gemv"


def linear(x, weight, bias=None):
    """``F.linear``, through the Triton GEMV for the launches ``LINEAR`` gives it (decode-sized 16-bit inputs)."""
    if _gemv(x, weight, bias):
        return _kernels("gemv").linear_decode(x, weight, bias)
    return F.linear(x, weight, bias)


def linear_into(x, weight, out):
    """``out[...] = F.linear(x, weight)``, out (..., N) of any float dtype whose rows may be strided (a column slice of
    a wider tensor): on CUDA the decode GEMV writes it directly (no output tensor of its own, no cast or copy after);
    elsewhere, or for more rows, F.linear and one copy. Returns out."""
    if out.stride(-1) == 1 and _gemv(x, weight):
        return _kernels("gemv").linear_decode(x, weight, None, out=out)
    out.copy_(F.linear(x, weight))
    return out


def quant_linear(x, w_q, w_scale, w_zero=None, x_scale=None, bias=None, out_dtype=None, words=None):
    """``ops.quant_linear_ref``: low-bit GEMV / GEMM kernels for CUDA tensors (formats in ssmq.ops.quant_linear):
    ``packed_gemv`` on ``words`` (the codes repacked by ``pack_for_decode``, or None) where ``PACKED_LINEAR``
    selects it, the decode GEMV ``qgemv`` where ``quant_linear_rows`` selects it (``qgemv.serves``), the
    serving-batch GEMM ``qgemm_mid`` where ``quant_linear_mid_rows`` does (``qgemm_mid.serves``), the int8
    tensor-core GEMM ``qgemm_a8`` for int8 x where ``quant_linear_a8_rows`` does (``qgemm_a8.serves``), else
    ``quant_gemm``'s kernels."""
    if not _use_triton(w_q):
        return ops.quant_linear_ref(x, w_q, w_scale, w_zero, x_scale, bias, out_dtype)
    maybe = _candidates(x.dtype, math.prod(x.shape[:-1]))  # empty at prefill rows of 16-bit x
    if words is not None and w_zero is None and x_scale is None and "packed_gemv" in maybe:
        packed = _kernels("packed_gemv")
        bits = 4 if w_q.dtype == torch.uint8 else 8
        if select(packed_linear_rows(packed.CFG), packed.launch(x, words, w_scale, bits)) == "packed_gemv":
            return packed.packed_gemv(x, words, w_scale, bits, bias, out_dtype)
    if "qgemv" in maybe:
        gemv = _kernels("qgemv")
        f = gemv.serves(x, w_q, w_scale, w_zero, x_scale)
        if f is not None:
            return gemv.quant_gemv(x, w_q, w_scale, f, x_scale, bias, out_dtype)
    if "qgemm_mid" in maybe:
        mid = _kernels("qgemm_mid")
        f = mid.serves(x, w_q, w_scale, w_zero, x_scale)
        if f is not None:
            return mid.quant_linear_mid(x, w_q, w_scale, f, bias, out_dtype)
    if "qgemm_a8" in maybe:
        a8 = _kernels("qgemm_a8")
        f = a8.serves(x, w_q, w_scale, w_zero, x_scale)
        if f is not None:
            return a8.quant_linear_a8(x, x_scale, w_q, w_scale, f, bias, out_dtype)
    return _kernels("quant_gemm").quant_linear(x, w_q, w_scale, w_zero, x_scale, bias, out_dtype)


_CANDIDATES: dict = {}  # (route ids, max rows, x dtype, rows) -> (the routes, held so their ids stay theirs; kernels)


def _candidates(x_dtype: torch.dtype, rows: int) -> frozenset[str]:
    """The kernels that a row of one of ``quant_linear``'s selection tables (other than its default) could send a call
    of ``rows`` rows of x of ``x_dtype`` to, from the kernels' launch settings in force (a benchmark or test may
    replace a route; none is edited in place). Only their tables' other checks (the weight's format, the layout) run:
    those cost more host time than a launch, and at prefill (an eager prefill of Mamba2-2.7B makes 128 calls) no
    table is left to ask."""
    cfgs = (_kernels("qgemv").CFG, _kernels("packed_gemv").CFG, _kernels("qgemm_mid").CFG, _kernels("qgemm_a8").CFG)
    routes = tuple(c.get("ROUTE_ROWS", c.get("ROUTE")) for c in cfgs)
    key = (tuple(map(id, routes)), tuple(c.get("MAX_ROWS") for c in cfgs), x_dtype, rows)
    hit = _CANDIDATES.get(key)
    if hit is None:
        if len(_CANDIDATES) >= 4096:  # prompt lengths: bounded, not a leak
            _CANDIDATES.clear()
        x = _name(x_dtype)
        tables = (quant_linear_rows(cfgs[0]), packed_linear_rows(cfgs[1]), quant_linear_mid_rows(cfgs[2]),
                  quant_linear_a8_rows(cfgs[3]))
        hit = _CANDIDATES[key] = (routes, frozenset(
            row.kernel for table in tables for row in table[:-1]
            if all(n not in row.needs or row.needs[n].holds(v) for n, v in (("x", x), ("rows", rows)))))
    return hit[1]


def quant_linear_act(x, w_q, w_scale, x_scale=None, per_token=True, act_dtype=torch.int8, bias=None, out_dtype=None):
    """``ops.quant_linear_act_ref``: on CUDA, codes ``qgemv`` or ``qgemm_a8`` serves are quantized by ``quantize_act``
    and multiplied there (``quant_linear``); else ``quant_gemm.quant_linear_act``."""
    if not _use_triton(w_q):
        return ops.quant_linear_act_ref(x, w_q, w_scale, x_scale, per_token, act_dtype, bias, out_dtype)
    maybe = _candidates(act_dtype, math.prod(x.shape[:-1]))
    if ("qgemv" in maybe and _kernels("qgemv").serves_codes(x, w_q, w_scale, act_dtype)) or (
            "qgemm_a8" in maybe and _kernels("qgemm_a8").serves_codes(x, w_q, w_scale, act_dtype)):
        x_q, xs = _kernels("quant_gemm").quantize_act(x, x_scale, per_token, act_dtype)
        return quant_linear(x_q, w_q, w_scale, None, xs, bias, out_dtype or x.dtype)
    return _kernels("quant_gemm").quant_linear_act(x, w_q, w_scale, x_scale, per_token, act_dtype, bias, out_dtype)


def pack_for_decode(w_q, w_scale, w_zero=None):
    """The decode GEMV's copy of a stored weight's codes (``ops.quant_linear.pack_words``' layout, made once when a
    model's decode is set up: ``QuantLinear.bind_decode``), or None where no decode call of its code type would run
    on it (the policy's ``repacked_decode`` off, CPU, no Triton, fp8 codes, zero points, k or group not whole
    blocks, ROUTE_ROWS of configs/packed_gemv.json routing no rows of its code type): the stored layout's kernels
    serve every call then."""
    if not active().repacked_decode or not _use_triton(w_q) or w_q.dtype not in (torch.uint8, torch.int8):
        return None
    packed = _kernels("packed_gemv")
    code = "int4" if w_q.dtype == torch.uint8 else "int8"
    if packed.CFG["ROUTE_ROWS"].get(code, 0) < 1 or not packed.packs(w_q, w_scale, w_zero):
        return None
    return packed.pack(w_q)


def quantize_act(x, x_scale=None, per_token=True, dtype=torch.int8):
    """``ops.quantize_act_ref``: (codes, scale) of a float activation, one Triton program per row on CUDA."""
    impl = _kernels("quant_gemm").quantize_act if _use_triton(x) else ops.quantize_act_ref
    return impl(x, x_scale, per_token, dtype)


@dataclass(frozen=True)
class Need:
    """A requirement on one field of a launch: a value ``among`` these (None: any), a multiple of ``multiple``, in
    [``least``, ``most``], a power of two when ``pow2``."""

    among: tuple | None = None
    multiple: int = 1
    least: float = -math.inf
    most: float = math.inf
    pow2: bool = False

    def holds(self, v) -> bool:
        if self.among is not None:
            return v in self.among
        return v % self.multiple == 0 and self.least <= v <= self.most and (not self.pow2 or v & (v - 1) == 0)


@dataclass(frozen=True)
class Row:
    """One kernel of a selection table: the module in ``ssmq.kernels`` and what a launch must satisfy."""

    kernel: str
    needs: dict = field(default_factory=dict)
    gluon: bool = False  # needs Triton's Gluon (3.5+)

    def serves(self, launch: dict) -> bool:
        return all(need.holds(launch[name]) for name, need in self.needs.items())


_BITS, _HALF = Need((2, 3, 4)), Need(("float16", "bfloat16"))
# Quantized KV decode. kv_decode_warp: codebooks of exactly 2^bits entries (its lookup tables index codes unmasked),
# per-channel keys and per-token values, head dim 64 or 128, at most 8 query-head columns a program (head dim 64
# puts two kv heads' groups in them), at most a 16-token tile of sink, paged blocks whole tiles. kv_decode_fast:
# 2-4 bit codes, head dims that are multiples of 32, rotary dims that are multiples of 16 (its lookups read whole
# bytes of a rotary half). kv_decode: every format (float32-exact products).
QUANT_KV_DECODE = (
    Row("kv_decode_warp", dict(key_bits=_BITS, value_bits=_BITS, full_codebooks=Need((True,)),
                               key_per_token=Need((False,)), value_per_token=Need((True,)), head_dim=Need((64, 128)),
                               rotary_dim=Need((0, 32, 64, 128)), rotary_past_head=Need((False,)),
                               sink=Need(most=16), columns=Need(most=8),
                               paged_block=Need(multiple=16)), gluon=True),
    Row("kv_decode_fast", dict(key_bits=_BITS, value_bits=_BITS, head_dim=Need(multiple=32),
                               rotary_dim=Need(multiple=16))),
    Row("kv_decode"),
)
# Float KV decode: kv_decode_fast's tensor-core products in the cache's 16-bit dtype, head dims powers of two from
# 32; float32 caches keep kv_decode's float32-exact products.
FLOAT_KV_DECODE = (Row("kv_decode_fast", dict(dtype=_HALF, head_dim=Need(least=32, pow2=True))), Row("kv_decode"))
# Float linear: the GEMV serves decode-sized 16-bit inputs (one weight pass serves up to 8 rows); more rows are
# GEMMs, cuBLAS's ground.
LINEAR = (Row("gemv", dict(dtype=_HALF, same_dtype=Need((True,)), rows=Need(least=1, most=8))), Row("torch"))
# Prefill attention: 16-bit q, k, v of one dtype (tensor cores would round float32), channels contiguous, head
# dims up to 256 (the tile's registers). A quantized cache's read: 2-4 bit codes (the tile unpacking), even rotary
# dims. Its fused append: 2-4 bit codes, unrotated, per-token or per-channel scales.
PREFILL_ATTENTION = (Row("attention_prefill", dict(dtype=_HALF, same_dtype=Need((True,)), head_dim=Need(most=256),
                                                   contiguous=Need((True,)))), Row("reference"))
QUANT_KV_READ = (Row("kv_read", dict(bits=_BITS, rotary_dim=Need(multiple=2))), Row("reference"))
QUANT_KV_APPEND = (Row("kv_append", dict(bits=_BITS, rotated=Need((False,)),
                                         granularity=Need(("per_token", "per_channel")))), Row("reference"))

# Low-bit linear: qgemv for the rows ROUTE_ROWS gives its code type (configs/qgemv.json: where it measured faster than
# quant_gemm's decode kernels, at most MAX_ROWS), 16-bit x on symmetric codes or scaled fp8 x on fp8 codes, per-group
# scales for integer codes only (groups powers of two of at least 4 bytes of codes) and a layout it fits
# (``qgemv.launch``); quant_gemm's kernels every other call.
_GROUPS = (None, *(2 ** i for i in range(3, 17)))


def quant_linear_rows(cfg: dict) -> tuple[Row, ...]:
    """The low-bit linear's selection table for qgemv's launch settings ``cfg`` (its ROUTE_ROWS and MAX_ROWS)."""
    return _quant_linear_rows(tuple(sorted(cfg["ROUTE_ROWS"].items())), cfg["MAX_ROWS"])


@functools.lru_cache(maxsize=None)
def _quant_linear_rows(route: tuple, max_rows: int) -> tuple[Row, ...]:
    rows = {code: Need(least=1, most=min(n, max_rows)) for code, n in route}
    same = dict(zero=Need((False,)), fits=Need((True,)))
    return (Row("qgemv", dict(code=Need(("int4",)), x=_HALF, rows=rows["int4"], group=Need(_GROUPS), **same)),
            Row("qgemv", dict(code=Need(("int8",)), x=_HALF, rows=rows["int8"], group=Need((*_GROUPS, 4)), **same)),
            Row("qgemv", dict(code=Need(("fp8",)), x=_HALF, rows=rows["fp8"], group=Need((None,)), **same)),
            Row("qgemv", dict(code=Need(("fp8",)), x=Need(("float8_e4m3fn",)), x_scaled=Need((True,)),
                              rows=rows["fp8"], group=Need((None,)), **same)),
            Row("quant_gemm"))


def packed_linear_rows(cfg: dict) -> tuple[Row, ...]:
    """The selection table of a low-bit linear whose codes were repacked (``pack_for_decode``), for the launch settings
    ``cfg`` of ``packed_gemv`` (configs/packed_gemv.json): packed_gemv for 16-bit x and the rows its ROUTE_ROWS gives
    the code type (where it measured faster than the stored layout's kernels, at most MAX_ROWS), a call it fits
    (``packed_gemv.launch``); ``stored``: ``quant_linear_rows`` on the stored codes."""
    return _packed_linear_rows(tuple(sorted(cfg["ROUTE_ROWS"].items())), cfg["MAX_ROWS"])


@functools.lru_cache(maxsize=None)
def _packed_linear_rows(route: tuple, max_rows: int) -> tuple[Row, ...]:
    return (*(Row("packed_gemv", dict(code=Need((code,)), x=_HALF, rows=Need(least=1, most=min(n, max_rows)),
                                      fits=Need((True,)))) for code, n in route),
            Row("stored"))


# Weight-only linear at serving batches: qgemm_mid for the rows its ROUTE gives each code type (configs/qgemm_mid.json:
# where it measured faster than quant_gemm's kernels), 16-bit x, symmetric int4 / int8 codes, a layout it fits
# (``qgemm_mid.launch``); quant_gemm's kernels every other call.


def quant_linear_mid_rows(cfg: dict) -> tuple[Row, ...]:
    """The serving-batch weight-only linear's selection table for qgemm_mid's settings ``cfg``: its ROUTE (rows a
    code type runs there), after its EXCEPT entries (a code type, a weight's (n, k) and rows that measured faster on
    quant_gemm's kernels, which keep them)."""
    route = tuple(sorted((code, tuple(r)) for code, r in cfg["ROUTE"].items()))
    return _quant_linear_mid_rows(route, tuple((e["code"], e["n"], e["k"], *e["rows"]) for e in cfg.get("EXCEPT", ())))


@functools.lru_cache(maxsize=None)
def _quant_linear_mid_rows(route: tuple, except_: tuple = ()) -> tuple[Row, ...]:
    same = dict(x=_HALF, zero=Need((False,)), fits=Need((True,)))
    keep = (Row("quant_gemm", dict(code=Need((code,)), n=Need((n,)), k=Need((k,)), rows=Need(least=lo, most=hi)))
            for code, n, k, lo, hi in except_)
    return (*keep, *(Row("qgemm_mid", dict(code=Need((code,)), rows=Need(least=lo, most=hi), **same))
                     for code, (lo, hi) in route), Row("quant_gemm"))


# W4A8 / W8A8 linear at serving batches: qgemm_a8 for the rows its ROUTE gives each code type (configs/qgemm_a8.json:
# where it measured faster than quant_gemm's kernels), int8 x codes, symmetric int4 / int8 weight codes, a layout it
# fits (``qgemm_a8.launch``); quant_gemm's kernels every other call.


def quant_linear_a8_rows(cfg: dict) -> tuple[Row, ...]:
    """The serving-batch int8-activation linear's selection table for qgemm_a8's settings ``cfg`` (its ROUTE)."""
    return _quant_linear_a8_rows(tuple(sorted((code, tuple(r)) for code, r in cfg["ROUTE"].items())))


@functools.lru_cache(maxsize=None)
def _quant_linear_a8_rows(route: tuple) -> tuple[Row, ...]:
    same = dict(x=Need(("int8",)), zero=Need((False,)), fits=Need((True,)))
    return (*(Row("qgemm_a8", dict(code=Need((code,)), rows=Need(least=lo, most=hi), **same)) for code, (lo, hi) in
              route), Row("quant_gemm"))


@functools.lru_cache(maxsize=None)
def has_gluon() -> bool:
    """Whether the installed Triton has Gluon (3.5+), read from its metadata (no import of triton)."""
    if not _HAS_TRITON:
        return False
    major, minor = (int(x) for x in re.match(r"(\d+)\.(\d+)", importlib.metadata.version("triton")).groups())
    return (major, minor) >= (3, 5)


def select(table: tuple[Row, ...], launch: dict, policy: KernelPolicy | None = None, gluon: bool | None = None) -> str:
    """The kernel of the first row of ``table`` that serves ``launch`` and that ``policy`` (default: the active one)
    allows; ``gluon``: whether Triton's Gluon is there (default: looked up). The last row serves every launch."""
    policy = policy or active()
    allowed = set(policy.kv_decode) | {"kv_decode"} if table is QUANT_KV_DECODE or table is FLOAT_KV_DECODE else None
    for row in table:
        if (allowed is None or row.kernel in allowed) and row.serves(launch) and \
                (not row.gluon or (has_gluon() if gluon is None else gluon)):
            return row.kernel
    return table[-1].kernel


def quant_kv_launch(key_bits: int, value_bits: int, full_codebooks: bool, key_per_token: bool,
                    value_per_token: bool, head_dim: int, rotary_dim: int, sink: int, group: int,
                    paged_block: int = 0) -> dict:
    """The fields ``QUANT_KV_DECODE`` selects on, from a quantized KV format and its layer's shape (``group``: query
    heads a kv head; ``paged_block``: tokens a block of a paged cache, 0 unpaged)."""
    return dict(key_bits=key_bits, value_bits=value_bits, full_codebooks=full_codebooks, key_per_token=key_per_token,
                value_per_token=value_per_token, head_dim=head_dim, rotary_dim=rotary_dim,
                rotary_past_head=rotary_dim > head_dim, sink=sink, columns=group * max(1, 128 // head_dim),
                paged_block=paged_block)


def quant_kv_view_launch(k, v, rotary_dim: int, group: int, paged_block: int = 0) -> dict:
    """``quant_kv_launch`` of the two sides of a quantized cache as the kernels read them (``KVSideView``)."""
    full = k.codebook.numel() == 2 ** k.bits and v.codebook.numel() == 2 ** v.bits
    return quant_kv_launch(k.bits, v.bits, full, k.per_token, v.per_token, k.sink.shape[-1], rotary_dim,
                           k.sink.shape[1], group, paged_block)


def serves(table: tuple[Row, ...], kernel: str, launch: dict) -> bool:
    """Whether ``kernel``'s row of ``table`` serves ``launch`` (the kernels' own guards)."""
    return next(row for row in table if row.kernel == kernel).serves(launch)


def _quant_kv_kernel(q, k, v, rotary_dim, block_table) -> str:
    block = k.codes.shape[1] if block_table is not None else 0
    return select(QUANT_KV_DECODE, quant_kv_view_launch(k, v, rotary_dim, q.shape[1] // k.codes.shape[2], block))


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def float_kv_launch(dtype: torch.dtype, head_dim: int) -> dict:
    return dict(dtype=_name(dtype), head_dim=head_dim)


def prefill_launch(q, k, v) -> dict:
    return dict(dtype=_name(q.dtype), same_dtype=k.dtype == q.dtype and v.dtype == q.dtype, head_dim=q.shape[-1],
                contiguous=all(t.stride(-1) == 1 for t in (q, k, v)))


def read_launch(side, rotary_dim: int) -> dict:
    return dict(bits=side.bits, rotary_dim=rotary_dim)


def append_launch(p, bits: int) -> dict:
    return dict(bits=bits, rotated=p.signs is not None, granularity=p.granularity)


def rope(x, positions, rotary_dim, base=10000.0):
    """``ops.rope_ref``: x (b, l, heads, e) rotated at ``positions`` (b, l) on its first ``rotary_dim`` channels of
    each head; one launch on CUDA (``kernels.rotary``), where the reference's dozen elementwise launches weighed on
    a decode step."""
    impl = _kernels("rotary").rope if _use_triton(x) else ops.rope_ref
    return impl(x, positions, rotary_dim, base)


def float_kv_decode(q, slots, kv_lens, k_cache, v_cache, softmax_scale=None, block_table=None, kernel=None):
    """Decode attention of one query per row, q (b, hq, e), over a float KV cache k_cache, v_cache (s, L, hkv, e)
    (keys post-RoPE), rows ``slots`` valid up to ``kv_lens`` (b,): (b, hq, e) float32; or over block pools
    (N, B, hkv, e) with ``block_table`` (s, M) (``kv_decode.float_kv_decode``). On CUDA a flash-decoding kernel
    that reads the lengths on the device (no host sync): ``kv_decode_fast``'s for float16 / bfloat16 caches of head
    dims 32, 64, 128, ... (tensor-core products in the cache's dtype; ``FLOAT_KV_DECODE``), else
    ``kv_decode``'s (float32-exact products); ``attention_ref`` elsewhere. ``kernel``: the one a layer plan chose."""
    if not _use_triton(q):
        k, v = (_cache_rows(c, slots, block_table).float() for c in (k_cache, v_cache))
        return ops.attention_ref(q[:, None].float(), k, v, kv_lens, softmax_scale)[:, 0]
    impl = _kernels(kernel or select(FLOAT_KV_DECODE, float_kv_launch(k_cache.dtype, k_cache.shape[-1])))
    return impl.float_kv_decode(q, slots, kv_lens, k_cache, v_cache, softmax_scale, block_table=block_table)


def prefill_attention(q, k, v, kv_lens=None, softmax_scale=None, slots=None, block_table=None):
    """``ops.attention_ref``: causal GQA attention of q (b, lq, hq, e) over k, v (b, lk, hkv, e) valid up to
    ``kv_lens`` (b,); ``slots``: k, v are a cache (s, L, hkv, e) holding the rows in those slots, or with
    ``block_table`` (s, M) block pools (N, B, hkv, e). The flash-attention kernel of ``attention_prefill`` on CUDA
    for float16 / bfloat16 inputs (it reads a cache in place, up to each row's length); elsewhere the reference over
    the rows copied out."""
    if _use_triton(q) and select(PREFILL_ATTENTION, prefill_launch(q, k, v)) == "attention_prefill":
        return _kernels("attention_prefill").prefill_attention(q, k, v, kv_lens, softmax_scale, slots, block_table)
    if slots is not None:
        k, v = _cache_rows(k, slots, block_table), _cache_rows(v, slots, block_table)
    return ops.attention_ref(q, k, v, kv_lens, softmax_scale)


def _cache_rows(cache, slots, block_table=None):
    """The rows ``slots`` (b,) of a float cache (s, L, hkv, e), or of block pools (N, B, hkv, e) through
    ``block_table`` (s, M), their blocks in order: (b, L or M·B, hkv, e), copied out for the references."""
    return cache[slots] if block_table is None else cache[block_table[slots]].flatten(1, 2)


def quant_kv_read(side, slots, end, rotary_dim=0, theta=10000.0, dtype=torch.float32, block_table=None,
                  kv_lens=None):
    """``ops.kv_quant.quant_kv_read_ref``: one side of a quantized cache (a ``KVSideView``), the rows ``slots`` up to
    ``end``, as (b, end, hkv, e) float keys (rotated) or values in ``dtype``; ``block_table``: the side's per-token
    buffers are block pools (the kernel reads them in place, the reference a copy of the rows' blocks); ``kv_lens``:
    the kernel may leave a row's tokens from its length on unwritten (the reference writes them all)."""
    if _use_triton(side.codes) and select(QUANT_KV_READ, read_launch(side, rotary_dim)) == "kv_read":
        return _kernels("kv_read").quant_kv_read(side, slots, end, rotary_dim, theta, dtype, block_table, kv_lens)
    from ssmq.ops.kv_quant import quant_kv_read_ref

    if block_table is not None:
        side, slots = side.gathered(block_table, slots), torch.arange(len(slots), device=slots.device)
    return quant_kv_read_ref(side, slots, end, rotary_dim, theta, dtype)


def quant_kv_append(x, slots, positions, p, bits, codes, mid, half, out_idx, out_val, sink, block_table=None) -> bool:
    """Quantize x (b, l, hkv, e) into a quantized KV side's buffers at ``positions`` of the rows ``slots`` with the
    fused kernel (``kv_append.quant_kv_append``; ``block_table``: the buffers are block pools) on CUDA when it serves
    the format (and ``KernelPolicy.kv_fused_append`` allows it); False when the caller should write with the
    reference ops instead."""
    if not (active().kv_fused_append and _use_triton(x)) or \
            select(QUANT_KV_APPEND, append_launch(p, bits)) != "kv_append":
        return False
    _kernels("kv_append").quant_kv_append(x, slots, positions, p, bits, codes, mid, half, out_idx, out_val, sink,
                          block_table=block_table)
    return True


def quant_kv_decode(q, slots, kv_lens, k, v, rotary_dim=0, theta=10000.0, softmax_scale=None, block_table=None):
    """``ops.kv_quant.quant_kv_decode_ref``: decode attention over a quantized KV cache; on CUDA the LUT kernel
    ``QUANT_KV_DECODE`` selects for the format. ``block_table`` (s, M): the sides' per-token buffers are block pools
    (``ssmq.models.quant_kv``), which the warp and fast kernels read in place; ``kv_decode`` and the reference read a
    copy of the rows' blocks (``KVSideView.gathered``)."""
    from ssmq.ops.kv_quant import quant_kv_decode_ref

    kernel = _quant_kv_kernel(q, k, v, rotary_dim, block_table) if _use_triton(q) else "reference"
    if kernel in ("kv_decode_warp", "kv_decode_fast"):
        return _kernels(kernel).quant_kv_decode(q, slots, kv_lens, k, v, rotary_dim, theta, softmax_scale,
                                                block_table=block_table)
    if block_table is not None:
        k, v = k.gathered(block_table, slots), v.gathered(block_table, slots)
        slots = torch.arange(len(slots), device=q.device)
    if kernel == "reference":
        return quant_kv_decode_ref(q, slots, kv_lens, k, v, rotary_dim, theta, softmax_scale)
    return _kernels("kv_decode").quant_kv_decode(q, slots, kv_lens, k, v, rotary_dim, theta, softmax_scale)
