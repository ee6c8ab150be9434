"""Helpers shared by the Triton kernels: numerically careful activations and launch sizing.

Importing this module needs triton; ``ssmq.kernels.dispatch`` imports kernel
modules lazily so that ``import ssmq`` never does.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ssmq.kernels.policy import active
from ssmq.ops.quant_linear import FP8_MAX


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
def rne_int8(v):
    # float32 -> int8 code, round half to even and clamp to [-128, 127] as torch.round(v).clamp(...) (clamping first
    # to integer bounds changes no code). Adding 1.5 * 2^23 leaves the float32 sum rounded to the nearest even
    # integer by the hardware, with that integer k in the low mantissa bits (bits = 0x4B400000 + k for |k| <= 2^22):
    # an integer subtract reads it out, no float -> int conversion (a quarter-rate instruction) and no libdevice rint
    # (which has no interpreter twin).
    t = tl.minimum(tl.maximum(v, -128.0), 127.0) + 12582912.0
    return (t.to(tl.int32, bitcast=True) - 0x4B400000).to(tl.int8)


# int8 codes <-> float32 by bit assembly (PTX, 4 codes a 32-bit register): the conversion instructions (I2F, F2I) issue
# at a quarter of the FP32 rate on sm_90, and a large-batch int8 decode step converts every state value twice.
# 1.5 * 2^23: x + it, for |x| < 2^22, is the float32 of bits 0x4B400000 + round_half_even(x)
_MAGIC_RNE = tl.constexpr(12582912.0)
_UNPACK_PTX = tl.constexpr("""{
.reg .b32 t;
xor.b32 t, $4, 0x80808080;
prmt.b32 $0, t, 0x4B000000, 0x7440;
prmt.b32 $1, t, 0x4B000000, 0x7441;
prmt.b32 $2, t, 0x4B000000, 0x7442;
prmt.b32 $3, t, 0x4B000000, 0x7443;
}""")
_PACK_PTX = tl.constexpr("""{
.reg .b32 lo, hi;
prmt.b32 lo, $1, $2, 0x0040;
prmt.b32 hi, $3, $4, 0x0040;
prmt.b32 $0, lo, hi, 0x5410;
}""")


@triton.jit
def int8_to_float(q, PTX: tl.constexpr):
    """int8 codes -> their float32 values, exactly. PTX: each code c, flipped to c + 128 (xor 0x80), becomes the low
    byte of the float 2^23 + c + 128 (one prmt), whose subtraction of 2^23 + 128 is exact (one FADD): 1.25 full-rate
    instructions a code instead of a byte extraction and a quarter-rate I2F. Else (the interpreter) a conversion."""
    if PTX:
        f = tl.inline_asm_elementwise(_UNPACK_PTX, "=r,=r,=r,=r,r", [q], dtype=tl.float32, is_pure=True, pack=4)
        return f - 8388736.0
    else:
        return q.to(tl.float32)


@triton.jit
def rne_int8_of_product(v, r, PTX: tl.constexpr, CLAMP: tl.constexpr = True):
    """int8 codes of v * r rounded half to even and clamped to [-128, 127] (v, r float32). PTX: one fused
    multiply-add of the magic number (the exact product rounded once, to an integer), two clamps in that integer
    range of floats, and 3 prmt a 4 codes to pack the low bytes (two's complement codes): no integer subtract, no
    conversion. Else rne_int8(v * r). The two differ only where v * r is within an ulp of a half-integer.
    CLAMP False: the caller guarantees |v * r| <= 127 (a row scaled by 127 / its absmax), so the clamps go."""
    if PTX:
        t = tl.fma(v, r, _MAGIC_RNE)
        if CLAMP:
            t = tl.minimum(tl.maximum(t, _MAGIC_RNE - 128.0), _MAGIC_RNE + 127.0)
        return tl.inline_asm_elementwise(_PACK_PTX, "=r,r,r,r,r", [t], dtype=tl.int8, is_pure=True, pack=4)
    else:
        return rne_int8(v * r)


_SAT_PTX = tl.constexpr("""{
.reg .b32 a, b, c, d, lo, hi;
cvt.rni.sat.s8.f32 a, $1;
cvt.rni.sat.s8.f32 b, $2;
cvt.rni.sat.s8.f32 c, $3;
cvt.rni.sat.s8.f32 d, $4;
prmt.b32 lo, a, b, 0x0040;
prmt.b32 hi, c, d, 0x0040;
prmt.b32 $0, lo, hi, 0x5410;
}""")


@triton.jit
def rne_int8_sat(v, PTX: tl.constexpr):
    """rne_int8(v) by one saturating conversion a value (F2I.S8: round half to even, clamp) and 3 prmt a 4 codes:
    2.75 instructions a code against rne_int8_of_product's 3.75 without its multiply, but a quarter-rate one (worth it
    where nothing else occupies that pipe: no rcp.approx beside it). Else (the interpreter) rne_int8."""
    if PTX:
        return tl.inline_asm_elementwise(_SAT_PTX, "=r,r,r,r,r", [v], dtype=tl.int8, is_pure=True, pack=4)
    else:
        return rne_int8(v)


@triton.jit
def quantize_rne(v, scale):
    # int8 codes of v / scale exactly as ssmq.ops.quant_ssm.quantize_ref: IEEE division (div_rn: Triton's '/' on
    # float32 is the approximate div.full), then rne_int8
    return rne_int8(tl.math.div_rn(v, scale))


FP8_QMAX = tl.constexpr(FP8_MAX)  # the largest e4m3 code a quantized activation takes (quantize_act_ref's)


@triton.jit
def quantize_codes(v, scale, FP8: tl.constexpr):
    """Activation codes of v / scale as ``quantize_act_ref`` makes them: int8 (``quantize_rne``), or e4m3 (FP8): the
    IEEE quotient clamped to +-FP8_QMAX and rounded to nearest even by the conversion."""
    if FP8:
        q = tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -FP8_QMAX), FP8_QMAX).to(tl.float8e4nv)
    else:
        q = quantize_rne(v, scale)
    return q


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (132 on an H100 SXM, for interpreter runs on CPU)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 132


def int32_words(index: torch.Tensor | None) -> tuple[torch.Tensor | None, int]:
    """A kernel's (b,) index or length tensor (values in [-2^31, 2^31)) as int32 words and the words from one entry
    to the next: an int64 tensor's own storage read in place (2: the low word of each, little-endian as every CUDA
    GPU), else int32 (1; a strided or other-dtype tensor is copied). None stays None (1). Reading the words in place
    adds no cast launch to a decode step (nor to a graph).

    Why: Triton builds a kernel once for each pointer dtype, and ptxas may schedule the int64 build's code
    differently, with the same instructions. The models pass int64 lengths and slots. The warp KV decode's int64 build
    ran 15% slower (2-bit, 166 rows x 32K tokens, H200), so it reads its lengths through this. Measure before using
    it elsewhere: the int8 state update's int64 build was 7-8% slower in ``bench_int8_ssm.py``'s micro-benchmark, but
    inside Mamba2-2.7B's decode graph it was the faster one (81.8 against 84.1 us a layer with these words at batch
    128, H200), so the state update keeps its int64 slots."""
    if index is None:
        return None, 1
    if index.dtype == torch.int64 and index.dim() == 1 and index.stride(0) == 1:
        return index.view(torch.int32), 2
    return index.to(torch.int32).contiguous(), 1


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) in Python. Host code uses this and ``next_pow2``, never ``triton.cdiv`` / ``triton.next_power_of_2``:
    those are Triton constexpr functions, about 5 us a call from Python (unwrapping their arguments), and launch
    plans run at every call of an eager forward."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (0 for n <= 0), as ``triton.next_power_of_2`` gives it, in plain Python."""
    n = int(n)
    return 1 << (n - 1).bit_length() if n > 0 else 0


def whole_loop_steps(steps: int, gps: int, split: int) -> tuple[int, int, int]:
    """A K loop of ``steps`` tiles taken ``gps`` at a time (halved until it divides ``steps``), split in at most
    ``split`` parts of whole loop steps: (gps, tiles a part, parts). The GEMM kernels that take GPS tiles a step
    (qgemm_mid, qgemm_a8) need every part's k range a multiple of GPS tiles."""
    while steps % gps:
        gps //= 2
    per = cdiv(cdiv(steps, split), gps) * gps
    return gps, per, cdiv(steps, per)


def rows_entry(M: int, bits: int, cfg: dict) -> dict:
    """The launch settings of a config's ROWS_W4 / ROWS_W8 table (by code width) for M rows: the first entry whose
    max_rows holds, else the last."""
    table = cfg["ROWS_W4" if bits == 4 else "ROWS_W8"]
    return next((e for e in table if M <= e["max_rows"]), table[-1])


def pow2(x: int, lo: int = 1) -> int:
    """Smallest power of two >= max(x, lo): Triton block shapes must be powers of two."""
    return max(lo, next_pow2(x))


def dot_precision(dtype: torch.dtype) -> str:
    """Float32 inputs get exact float32 products (tf32 would cost ~3e-4 of accuracy); fp16/bf16 ignore it."""
    return "ieee" if dtype == torch.float32 else "tf32"


# Programmatic Dependent Launch (Hopper+): a kernel launched with it may be scheduled while the kernel before it in
# the stream is still running; it must then wait (griddepcontrol.wait) before touching memory that kernel writes.
# A decode step is a chain of ~6 small dependent kernels a layer, each paying a launch gap that PDL hides: Mamba2-2.7B
# FP16 decode 2.85 -> 2.62 ms a token at batch 1, 5.32 -> 5.17 at 32 (H100, CUDA graphs). On unless the active
# ``KernelPolicy`` says ``pdl=False``.


@functools.lru_cache(maxsize=None)
def _major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def pdl_args(t: torch.Tensor) -> dict:
    """Launch keywords for a kernel that calls ``gdc_enter(USE_GDC)`` first: PDL on sm_90+ CUDA tensors when
    enabled, nothing otherwise (the interpreter and older GPUs run the kernel as before)."""
    if not (active().pdl and t.is_cuda and _major(t.device.index if t.device.index is not None
                                                  else torch.cuda.current_device()) >= 9):
        return {}
    return {"USE_GDC": True, "launch_pdl": True}


@triton.jit
def along_n(v, SWAP: tl.constexpr):
    """A (BLOCK_N,) vector broadcast along a tile's columns: (BLOCK_N, 1) in a swapped (BLOCK_N, BLOCK_M) tile (weights
    on the tensor core's wide side), else (1, BLOCK_N)."""
    if SWAP:
        return v[:, None]
    else:
        return v[None, :]


@triton.jit
def tile_zeros(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DTYPE: tl.constexpr, SWAP: tl.constexpr):
    """A zeroed accumulator for a (BLOCK_M, BLOCK_N) output tile, (BLOCK_N, BLOCK_M) in a swapped product."""
    if SWAP:
        return tl.zeros((BLOCK_N, BLOCK_M), dtype=DTYPE)
    else:
        return tl.zeros((BLOCK_M, BLOCK_N), dtype=DTYPE)


@triton.jit
def along_m(v, SWAP: tl.constexpr):
    """A (BLOCK_M,) vector broadcast along a tile's rows: (1, BLOCK_M) in a swapped tile, else (BLOCK_M, 1)."""
    if SWAP:
        return v[None, :]
    else:
        return v[:, None]


@triton.jit
def gdc_enter(USE_GDC: tl.constexpr):
    # before the kernel's first load: wait until the previous kernel's writes are visible (transitively, those of
    # every earlier one), then let the next kernel launch while this one runs
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
