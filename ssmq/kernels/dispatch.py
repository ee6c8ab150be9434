"""Device dispatch: Triton kernel for CUDA tensors when one exists, the reference otherwise.

Kernel modules are imported on first use, so ``import ssmq`` never needs triton
(CI has none); without triton, CUDA tensors also fall back to the references.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os

import torch
import torch.nn.functional as F

from ssmq import ops
from ssmq.errors import SSMQError

# SSMQ_REF_OPS=1 forces the references everywhere (debugging, accuracy baselines on GPU).
_FORCE_REF = os.environ.get("SSMQ_REF_OPS", "0") == "1"
_HAS_TRITON = importlib.util.find_spec("triton") is not None


def _use_triton(t) -> bool:
    return t.is_cuda and _HAS_TRITON and not _FORCE_REF


def _kernels(module: str):
    return importlib.import_module(f"ssmq.kernels.{module}")


def causal_conv1d(x, weight, bias=None, initial_states=None, return_final_states=False, activation=None):
    impl = _kernels("conv1d").causal_conv1d if _use_triton(x) else ops.causal_conv1d_ref
    return impl(x, weight, bias, initial_states, return_final_states, activation)


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, conv_state_indices=None):
    impl = _kernels("conv1d").causal_conv1d_update if _use_triton(x) else ops.causal_conv1d_update_ref
    return impl(x, conv_state, weight, bias, activation, conv_state_indices)


def conv1d_silu_quant(x, weight, bias, out_scale, initial_states=None, return_final_states=False):
    """``ops.quant_ssm.conv1d_silu_quant_ref``: conv + SiLU with int8 codes out (Quamba's fused conv)."""
    from ssmq.ops.quant_ssm import conv1d_silu_quant_ref

    impl = _kernels("conv1d").conv1d_silu_quant if _use_triton(x) else conv1d_silu_quant_ref
    return impl(x, weight, bias, out_scale, initial_states, return_final_states)


def conv1d_update_silu_quant(x, conv_state, weight, bias, out_scale, conv_state_indices=None, dequantized=False):
    """``ops.quant_ssm.conv1d_update_silu_quant_ref``: the decode step of ``conv1d_silu_quant``."""
    from ssmq.ops.quant_ssm import conv1d_update_silu_quant_ref

    impl = _kernels("conv1d").conv1d_update_silu_quant if _use_triton(x) else conv1d_update_silu_quant_ref
    return impl(x, conv_state, weight, bias, out_scale, conv_state_indices, dequantized)


def selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                   initial_state=None, return_last_state=False):
    impl = _kernels("scan").selective_scan if _use_triton(u) else ops.selective_scan_ref
    return impl(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, return_last_state)


def ssd_chunk_scan(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, dt_softplus=False,
                   dt_limit=(0.0, float("inf")), initial_states=None, return_final_states=False):
    impl = _kernels("ssd").ssd_chunk_scan if _use_triton(x) else ops.ssd_chunk_scan_ref
    return impl(x, dt, A, B, C, chunk_size, D, z, dt_bias, dt_softplus, dt_limit, initial_states,
                return_final_states)


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


# SSMQ_INT8_DECODE=0 runs a quantized model's decode step the earlier way: fake-quantized taps (float values) and,
# for an int8 state, a float step on a dequantized work copy of the served rows. The default feeds the taps' int8
# codes and the stored state to one kernel (``quant_state_update``); on CPU both are the same references, bit for bit.
INT8_DECODE = os.environ.get("SSMQ_INT8_DECODE", "1") == "1"


def int8_decode_enabled() -> bool:
    return INT8_DECODE


# SSMQ_INT8_PREFILL=1: on CUDA a quantized model's conv emits the taps' int8 codes and they go straight into the
# int8-input scan kernels (``quant_ssd`` / ``quant_selective_scan``). Off by default until those kernels have run on
# a GPU (built 2026-11-23, checked in Triton's interpreter and by sm_90 compiles only): the default prefill keeps the
# fake-quantized taps and the float scan kernels whose GPU accuracy is measured. Elsewhere the fake-quant path
# always stays: the int8-input references agree with it to float32 rounding, not bit for bit, and the CPU results
# are the ground truth the tests pin.
INT8_PREFILL = os.environ.get("SSMQ_INT8_PREFILL", "0") == "1"


def int8_prefill(t) -> bool:
    """Whether a quantized mixer's prefill on t's device feeds its taps' codes to the int8-input scan kernels."""
    return INT8_PREFILL and _use_triton(t)


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


# SSMQ_FUSED_DECODE=1 runs the fused Triton decode step (two launches); by default CUDA runs the three single-stage
# kernels through the same op: the fused kernel passes its GPU tests (H100, 2026-11-23) but measured no faster
# end to end (2.83 vs 2.88 ms a token, Mamba2-2.7B batch 1, within the spread; see ssmq/kernels/mamba2_decode.py).
_FUSED_DECODE = os.environ.get("SSMQ_FUSED_DECODE", "0") == "1"


def mamba2_decode_step(xbc, z, dt, conv_state, conv_weight, conv_bias, ssm_state, A, D, dt_bias, norm_weight,
                       ngroups, norm_group_size, eps, dt_limit=(0.0, math.inf), slots=None, quantize=False,
                       out_scale=None):
    args = (xbc, z, dt, conv_state, conv_weight, conv_bias, ssm_state, A, D, dt_bias, norm_weight,
            ngroups, norm_group_size, eps, dt_limit, slots, quantize, out_scale)
    if not _use_triton(xbc):
        return ops.mamba2_decode_step_ref(*args)
    if _FUSED_DECODE:
        return _kernels("mamba2_decode").mamba2_decode_step(*args)
    from ssmq.ops.mamba2_decode import compose

    norm = _kernels("norm")
    return compose(_kernels("conv1d").causal_conv1d_update, _kernels("state_update").selective_state_update,
                   norm.rmsnorm_gated, *args, norm.rmsnorm_gated_quant)


def rms_norm(x, weight, eps=1e-5, residual=None, residual_in_fp32=True):
    impl = _kernels("norm").rms_norm if _use_triton(x) else ops.rms_norm_ref
    return impl(x, weight, eps, residual, residual_in_fp32)


def rmsnorm_gated(x, weight, z=None, eps=1e-6, group_size=None, norm_before_gate=False):
    impl = _kernels("norm").rmsnorm_gated if _use_triton(x) else ops.rmsnorm_gated_ref
    return impl(x, weight, z, eps, group_size, norm_before_gate)


# SSMQ_FUSED_ACT_QUANT=0: an A8 linear quantizes its float input itself (``quant_linear_act``: a quantize kernel,
# then the integer GEMM), as before the fused producers. By default the op that produces the input of an A8 linear
# (block norm, gated norm, online Hadamard) emits its int8 codes and scale (the ``*_quant`` ops below) and the linear
# takes them as they are; on CPU both ways are the same references, bit for bit. Read at call time (benchmarks flip it).
ACT_QUANT_FUSION = os.environ.get("SSMQ_FUSED_ACT_QUANT", "1") == "1"


def act_quant_fusion_enabled() -> bool:
    return ACT_QUANT_FUSION


# The online Hadamard fused with the quantization (``hadamard_quant``, alone or in the gated norm) is opt-in
# (SSMQ_FUSED_HADAMARD_QUANT=1): on the H100 (2026-11-23, Quamba2 W8A8 Mamba2-2.7B batch 1) its kernel took 14.8 and,
# after a rewrite, 20.6 us a layer, against ~9.5 us for the float16 Hadamard GEMM + the quantize it replaces.
HADAMARD_QUANT_FUSION = os.environ.get("SSMQ_FUSED_HADAMARD_QUANT", "0") == "1"


def hadamard_quant_fusion_enabled() -> bool:
    return ACT_QUANT_FUSION and HADAMARD_QUANT_FUSION


def rms_norm_quant(x, weight, eps=1e-5, residual=None, residual_in_fp32=True, x_scale=None, per_token=True,
                   dtype=torch.int8):
    """``ops.norm.rms_norm_quant_ref``: residual add + RMSNorm with int8 / e4m3 codes out -> (codes, scale,
    new_residual)."""
    impl = _kernels("norm").rms_norm_quant if _use_triton(x) else ops.rms_norm_quant_ref
    return impl(x, weight, eps, residual, residual_in_fp32, x_scale, per_token, dtype)


def rmsnorm_gated_quant(x, weight, z=None, eps=1e-6, group_size=None, norm_before_gate=False, x_scale=None,
                        per_token=True, with_out=False, rotate=False, z_scale=None, dtype=torch.int8):
    """``ops.norm.rmsnorm_gated_quant_ref``: the gated norm (``rotate``: and its online Hadamard; ``z_scale``: on z
    fake-quantized in registers) with int8 (or, unrotated, e4m3) codes out -> (codes, scale, out or None)."""
    if not _use_triton(x):
        return ops.rmsnorm_gated_quant_ref(x, weight, z, eps, group_size, norm_before_gate, x_scale, per_token,
                                           with_out, rotate, z_scale, dtype)
    if rotate and dtype != torch.int8:
        raise SSMQError("the rotated gated norm emits int8 codes only")
    if rotate:  # norm, Hadamard and codes in one kernel
        return _kernels("hadamard").rmsnorm_gated_hadamard_quant(x, weight, z, eps, group_size, norm_before_gate,
                                                                 x_scale, per_token, with_out, z_scale)
    return _kernels("norm").rmsnorm_gated_quant(x, weight, z, eps, group_size, norm_before_gate, x_scale, per_token,
                                                with_out, z_scale, dtype)


def hadamard_quant(x, x_scale=None, per_token=True, with_y=False):
    """``ops.hadamard.hadamard_quant_ref``: online Hadamard + int8 codes -> (codes, scale[, y]); one kernel on CUDA."""
    from ssmq.ops.hadamard import hadamard_quant_ref

    impl = _kernels("hadamard").hadamard_quant if _use_triton(x) else hadamard_quant_ref
    return impl(x, x_scale, per_token, with_y)


def rmsnorm_gated_partial(x, weight, z, ss_out, col=0, with_out=True):
    """``ops.norm.rmsnorm_gated_partial_ref``: a tensor-parallel rank's gated norm before the group's all-reduce."""
    from ssmq.ops.norm import rmsnorm_gated_partial_ref

    impl = _kernels("norm_sharded").rmsnorm_gated_partial if _use_triton(x) else rmsnorm_gated_partial_ref
    return impl(x, weight, z, ss_out, col, with_out)


def rmsnorm_gated_reduced(x, weight, z, ss, col, group_size, eps):
    """``ops.norm.rmsnorm_gated_reduced_ref``: the rank's gated norm from its group's all-reduced sum of squares."""
    from ssmq.ops.norm import rmsnorm_gated_reduced_ref

    impl = _kernels("norm_sharded").rmsnorm_gated_reduced if _use_triton(x) else rmsnorm_gated_reduced_ref
    return impl(x, weight, z, ss, col, group_size, eps)


def rstd_scale(red, group_size, eps, bias=None, out_dtype=None):
    """``ops.norm.rstd_scale_ref``: the fused norm + out_proj all-reduce's result, normalised per token."""
    from ssmq.ops.norm import rstd_scale_ref

    impl = _kernels("norm_sharded").rstd_scale if _use_triton(red) else rstd_scale_ref
    return impl(red, group_size, eps, bias, out_dtype)


_DECODE_ROWS = 8  # gemv.MAX_ROWS: one weight pass serves this many rows; more rows are GEMMs, cuBLAS's ground


def linear(x, weight, bias=None):
    """``F.linear``, through the Triton GEMV for decode-sized fp16/bf16 inputs (<= 8 rows) on CUDA."""
    if (_use_triton(x) and x.dtype in (torch.float16, torch.bfloat16) and weight.dtype == x.dtype
            and (bias is None or bias.dtype == x.dtype) and 0 < math.prod(x.shape[:-1]) <= _DECODE_ROWS):
        return _kernels("gemv").linear_decode(x, weight, bias)
    return F.linear(x, weight, bias)


def linear_into(x, weight, out):
    """``out[...] = F.linear(x, weight)``, out (..., N) of any float dtype whose rows may be strided (a column slice of
    a wider tensor): on CUDA the decode GEMV writes it directly (no output tensor of its own, no cast or copy after);
    elsewhere, or for more rows, F.linear and one copy. Returns out."""
    if (_use_triton(x) and x.dtype in (torch.float16, torch.bfloat16) and weight.dtype == x.dtype
            and 0 < math.prod(x.shape[:-1]) <= _DECODE_ROWS and out.stride(-1) == 1):
        return _kernels("gemv").linear_decode(x, weight, None, out=out)
    out.copy_(F.linear(x, weight))
    return out


def quant_linear(x, w_q, w_scale, w_zero=None, x_scale=None, bias=None, out_dtype=None):
    """``ops.quant_linear_ref``: low-bit GEMV / GEMM kernels for CUDA tensors (formats in ssmq.ops.quant_linear): the
    decode GEMV ``qgemv`` where it serves the call (``qgemv.CFG["ROUTE_ROWS"]``), else ``quant_gemm``'s kernels."""
    if not _use_triton(w_q):
        return ops.quant_linear_ref(x, w_q, w_scale, w_zero, x_scale, bias, out_dtype)
    gemv = _kernels("qgemv")
    f = gemv.serves(x, w_q, w_scale, w_zero, x_scale)
    if f is not None:
        return gemv.quant_gemv(x, w_q, w_scale, f, x_scale, bias, out_dtype)
    return _kernels("quant_gemm").quant_linear(x, w_q, w_scale, w_zero, x_scale, bias, out_dtype)


def quant_linear_act(x, w_q, w_scale, x_scale=None, per_token=True, act_dtype=torch.int8, bias=None, out_dtype=None):
    """``ops.quant_linear_act_ref``: on CUDA, codes ``qgemv`` serves are quantized by ``quantize_act`` and multiplied
    there; else ``quant_gemm.quant_linear_act``."""
    if not _use_triton(w_q):
        return ops.quant_linear_act_ref(x, w_q, w_scale, x_scale, per_token, act_dtype, bias, out_dtype)
    if _kernels("qgemv").serves_codes(x, w_q, w_scale, act_dtype):
        x_q, xs = _kernels("quant_gemm").quantize_act(x, x_scale, per_token, act_dtype)
        return quant_linear(x_q, w_q, w_scale, None, xs, bias, out_dtype or x.dtype)
    return _kernels("quant_gemm").quant_linear_act(x, w_q, w_scale, x_scale, per_token, act_dtype, bias, out_dtype)


def quantize_act(x, x_scale=None, per_token=True, dtype=torch.int8):
    """``ops.quantize_act_ref``: (codes, scale) of a float activation, one Triton program per row on CUDA."""
    impl = _kernels("quant_gemm").quantize_act if _use_triton(x) else ops.quantize_act_ref
    return impl(x, x_scale, per_token, dtype)


# SSMQ_KV_FAST=0 keeps every KV cache on the first-generation decode kernel (A/B timing); by default the quantized
# formats the fast kernel serves exactly (2-4 bit codes, head dims % 32, rotary dims % 16) and float16 / bfloat16
# caches take it on CUDA.
_KV_FAST = os.environ.get("SSMQ_KV_FAST", "1") == "1"
# SSMQ_KV_WARP=0 keeps the formats the warp kernel serves (kv_decode_warp: 2-4 bit per-channel keys, per-token
# values, head dim 128 or 64, RoPE on 0, 32, 64 or 128 channels, with or without outliers) on kv_decode_fast (A/B
# timing); it needs Triton's Gluon (3.5+).
_KV_WARP = os.environ.get("SSMQ_KV_WARP", "1") == "1"


def _warp_decode(q, k, v, rotary_dim, block_table):
    """``kv_decode_warp`` when it serves this launch, else None (also without Gluon)."""
    if not _KV_WARP:
        return None
    try:
        warp = _kernels("kv_decode_warp")
    except ImportError:
        return None
    block = k.codes.shape[1] if block_table is not None else 0
    return warp if warp.eligible(k, v, rotary_dim, q.shape[1] // k.codes.shape[2], block) else None


def rope(x, positions, rotary_dim, base=10000.0):
    """``ops.rope_ref``: x (b, l, heads, e) rotated at ``positions`` (b, l) on its first ``rotary_dim`` channels of
    each head; one launch on CUDA (``kernels.rotary``), where the reference's dozen elementwise launches weighed on
    a decode step."""
    impl = _kernels("rotary").rope if _use_triton(x) else ops.rope_ref
    return impl(x, positions, rotary_dim, base)


def float_kv_decode(q, slots, kv_lens, k_cache, v_cache, softmax_scale=None, block_table=None):
    """Decode attention of one query per row, q (b, hq, e), over a float KV cache k_cache, v_cache (s, L, hkv, e)
    (keys post-RoPE), rows ``slots`` valid up to ``kv_lens`` (b,): (b, hq, e) float32; or over block pools
    (N, B, hkv, e) with ``block_table`` (s, M) (``kv_decode.float_kv_decode``). On CUDA a flash-decoding kernel
    that reads the lengths on the device (no host sync): ``kv_decode_fast``'s for float16 / bfloat16 caches of head
    dims 32, 64, 128, ... (tensor-core products in the cache's dtype; ``SSMQ_KV_FAST=0`` keeps the other), else
    ``kv_decode``'s (float32-exact products); ``attention_ref`` elsewhere."""
    if not _use_triton(q):
        k, v = (_cache_rows(c, slots, block_table).float() for c in (k_cache, v_cache))
        return ops.attention_ref(q[:, None].float(), k, v, kv_lens, softmax_scale)[:, 0]
    fast = _kernels("kv_decode_fast")
    impl = fast if _KV_FAST and fast.float_eligible(k_cache) else _kernels("kv_decode")
    return impl.float_kv_decode(q, slots, kv_lens, k_cache, v_cache, softmax_scale, block_table=block_table)


def prefill_attention(q, k, v, kv_lens=None, softmax_scale=None, slots=None, block_table=None):
    """``ops.attention_ref``: causal GQA attention of q (b, lq, hq, e) over k, v (b, lk, hkv, e) valid up to
    ``kv_lens`` (b,); ``slots``: k, v are a cache (s, L, hkv, e) holding the rows in those slots, or with
    ``block_table`` (s, M) block pools (N, B, hkv, e). The flash-attention kernel of ``attention_prefill`` on CUDA
    for float16 / bfloat16 inputs (it reads a cache in place, up to each row's length); elsewhere the reference over
    the rows copied out."""
    if _use_triton(q) and _kernels("attention_prefill").eligible(q, k, v):
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
    if _use_triton(side.codes) and _kernels("kv_read").eligible(side, rotary_dim):
        return _kernels("kv_read").quant_kv_read(side, slots, end, rotary_dim, theta, dtype, block_table, kv_lens)
    from ssmq.ops.kv_quant import quant_kv_read_ref

    if block_table is not None:
        side, slots = side.gathered(block_table, slots), torch.arange(len(slots), device=slots.device)
    return quant_kv_read_ref(side, slots, end, rotary_dim, theta, dtype)


# A quantized KV cache's new tokens are written by the fused quantize-and-append kernel (``kv_append``, the reference
# write's bytes, tested on the H100) on CUDA; SSMQ_KV_FUSED_APPEND=0 writes with the reference ops instead.
_KV_FUSED_APPEND = os.environ.get("SSMQ_KV_FUSED_APPEND", "1") != "0"


def quant_kv_append(x, slots, positions, p, bits, codes, mid, half, out_idx, out_val, sink, block_table=None) -> bool:
    """Quantize x (b, l, hkv, e) into a quantized KV side's buffers at ``positions`` of the rows ``slots`` with the
    fused kernel (``kv_append.quant_kv_append``; ``block_table``: the buffers are block pools) on CUDA when it serves
    the format (and is not turned off); False when the caller should write with the reference ops instead."""
    if not (_KV_FUSED_APPEND and _use_triton(x)):
        return False
    fused = _kernels("kv_append")
    if not fused.eligible(p, bits):
        return False
    fused.quant_kv_append(x, slots, positions, p, bits, codes, mid, half, out_idx, out_val, sink,
                          block_table=block_table)
    return True


def quant_kv_decode(q, slots, kv_lens, k, v, rotary_dim=0, theta=10000.0, softmax_scale=None, block_table=None):
    """``ops.kv_quant.quant_kv_decode_ref``: decode attention over a quantized KV cache (LUT K / V kernels on CUDA:
    ``kv_decode_warp`` for the formats it serves, ``kv_decode_fast`` for the others it is ``eligible`` for, else the
    first-generation ``kv_decode``).
    ``block_table`` (s, M): the sides' per-token buffers are block pools (``ssmq.models.quant_kv``), which the fast
    kernel reads in place; the first-generation one reads a copy of the rows' blocks (``KVSideView.gathered``)."""
    from ssmq.ops.kv_quant import quant_kv_decode_ref

    if _use_triton(q) and _KV_FAST and (warp := _warp_decode(q, k, v, rotary_dim, block_table)) is not None:
        return warp.quant_kv_decode(q, slots, kv_lens, k, v, rotary_dim, theta, softmax_scale, block_table=block_table)
    if _use_triton(q) and _KV_FAST and _kernels("kv_decode_fast").eligible(k, v, rotary_dim):
        return _kernels("kv_decode_fast").quant_kv_decode(q, slots, kv_lens, k, v, rotary_dim, theta, softmax_scale,
                                                          block_table=block_table)
    if block_table is not None:  # the reference and the first-generation kernel read the rows' blocks copied out
        k, v = k.gathered(block_table, slots), v.gathered(block_table, slots)
        slots = torch.arange(len(slots), device=q.device)
    if not _use_triton(q):
        return quant_kv_decode_ref(q, slots, kv_lens, k, v, rotary_dim, theta, softmax_scale)
    return _kernels("kv_decode").quant_kv_decode(q, slots, kv_lens, k, v, rotary_dim, theta, softmax_scale)
