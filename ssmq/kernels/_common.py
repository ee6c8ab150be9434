"""Helpers shared by the Triton kernels: numerically careful activations and launch sizing.

Importing this module needs triton; ``ssmq.kernels.dispatch`` imports kernel
modules lazily so that ``import ssmq`` never does.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def log1p(x):
    # Goldberg's trick: log(u) * x / (u - 1) cancels the rounding of u = 1 + x,
    # so softplus keeps its relative accuracy for the very negative inputs that
    # small Δ values come from (plain log(1 + exp(x)) loses ~1e-4 there).
    u = 1.0 + x
    return tl.where(u == 1.0, x, tl.log(u) * (x / (u - 1.0)))


@triton.jit
def softplus(x):
    # same threshold as torch.nn.functional.softplus (beta 1, threshold 20)
    return tl.where(x > 20.0, x, log1p(tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def silu(x):
    return x / (1.0 + tl.exp(-x))


@triton.jit
def quantize_rne(v, scale):
    # symmetric int8 codes (as float32) of v / scale, as ssmq.ops.quant_ssm.quantize_ref: IEEE division (div_rn,
    # not the approximate '/'), round half to even by adding and subtracting 1.5 * 2^23 (the hardware rounds the
    # float32 sum to nearest even; exact for |v| < 2^22, so clamp first, which changes no code; rint has no
    # interpreter twin), clamp to [-128, 127]
    q = tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -129.0), 128.0)
    q = (q + 12582912.0) - 12582912.0
    return tl.minimum(tl.maximum(q, -128.0), 127.0)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (132 on an H100 SXM, for interpreter runs on CPU)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 132


def pow2(x: int, lo: int = 1) -> int:
    """Smallest power of two >= max(x, lo): Triton block shapes must be powers of two."""
    return max(lo, triton.next_power_of_2(int(x)))


def dot_precision(dtype: torch.dtype) -> str:
    """Float32 inputs get exact float32 products (tf32 would cost ~3e-4 of accuracy); fp16/bf16 ignore it."""
    return "ieee" if dtype == torch.float32 else "tf32"
