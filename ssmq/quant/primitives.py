"""Quantization primitives: the one definition of every scheme ssmq uses.

Everything else in ``ssmq.quant`` (observers, QuantLinear, GPTQ, recipes) and every
GPU kernel calls or reproduces these functions.

Glossary:
    x      any float tensor; the quantized axis of a granularity is named below
    q      integer codes: int8 tensor (int8 and int4 values), or float8_e4m3fn for fp8
    scale  float32; zero_point: int32 (asymmetric only, else None)
    m, k, n   GEMM sizes: activations (m, k), weights (n, k), output (m, n); g group size

Quantized types (``qtype``):
    "int8"  codes in [-128, 127]
    "int4"  codes in [-8, 7], kept one per int8 element; ``pack_int4`` stores two per byte
    "fp8"   float8 e4m3 (torch.float8_e4m3fn), finite range [-448, 448], no zero point

Symmetric:  scale = absmax / qmax,                     q = clamp(round(x / scale), qmin, qmax)
Asymmetric: scale = (max - min) / (qmax - qmin),
            zero_point = clamp(qmin - round(min / scale), qmin, qmax),
            q = clamp(round(x / scale) + zero_point, qmin, qmax)
dequantize: (q - zero_point) * scale in float32.
``round`` is round-half-to-even (torch.round) and ``x / scale`` is an IEEE float32
division: GPU kernels must use the same (``__fdiv_rn`` + ``rint``) to be bit-exact.
The range is widened to include 0 (min <= 0 <= max) so that 0 is exact, and a zero
range gives scale = ``EPS`` rather than a division by zero.

Scale shapes (the compact "canonical" form every function takes and returns):
    PerTensor()          ()                       one scale
    PerChannel(axis)     (x.shape[axis],)         e.g. weight (n, k), axis 0 -> (n,)
    PerToken()           x.shape[:-1]             one scale per row of the last dim
    PerGroup(g)          x.shape[:-1] + (k // g,) contiguous groups of g along the last dim
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ssmq.errors import SSMQError

EPS = 1e-8  # smallest scale: an all-zero tensor quantizes to zeros instead of dividing by 0


# ---------------------------------------------------------------------------------------------
# granularity: a value, not a class per combination
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PerTensor:
    """One scale for the whole tensor."""


@dataclass(frozen=True)
class PerChannel:
    """One scale per index of ``axis`` (weights: axis 0 = output channel; activations: -1)."""

    axis: int = 0


@dataclass(frozen=True)
class PerToken:
    """One scale per row of the last dim (activations (..., k) -> scales (...))."""


@dataclass(frozen=True)
class PerGroup:
    """One scale per contiguous group of ``group_size`` elements along the last dim."""

    group_size: int = 128


Granularity = PerTensor | PerChannel | PerToken | PerGroup


def granularity_to_str(g: Granularity) -> str:
    """JSON spelling: "per_tensor", "per_channel" (axis 0) / "per_channel:-1", "per_token", "per_group:128"."""
    if isinstance(g, PerTensor):
        return "per_tensor"
    if isinstance(g, PerToken):
        return "per_token"
    if isinstance(g, PerChannel):
        return "per_channel" if g.axis == 0 else f"per_channel:{g.axis}"
    if isinstance(g, PerGroup):
        return f"per_group:{g.group_size}"
    raise SSMQError(f"unknown granularity {g!r}")


def granularity_from_str(s: str) -> Granularity:
    """Inverse of ``granularity_to_str``."""
    kind, _, arg = s.partition(":")
    try:
        if kind == "per_tensor" and not arg:
            return PerTensor()
        if kind == "per_token" and not arg:
            return PerToken()
        if kind == "per_channel":
            return PerChannel(int(arg) if arg else 0)
        if kind == "per_group" and int(arg) > 0:
            return PerGroup(int(arg))
    except ValueError:
        pass
    raise SSMQError(f"unknown granularity {s!r} (expected per_tensor, per_channel[:axis], per_token, per_group:G)")


# ---------------------------------------------------------------------------------------------
# quantized types
# ---------------------------------------------------------------------------------------------
QTYPES = ("int8", "int4", "fp8")
_INT_RANGE = {"int8": (-128, 127), "int4": (-8, 7)}
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def check_qtype(qtype: str) -> str:
    if qtype not in QTYPES:
        raise SSMQError(f"unsupported quantized type {qtype!r}; supported: {', '.join(QTYPES)}")
    return qtype


def qrange(qtype: str) -> tuple[float, float]:
    """(qmin, qmax) of a quantized type."""
    check_qtype(qtype)
    return (-FP8_MAX, FP8_MAX) if qtype == "fp8" else _INT_RANGE[qtype]


# ---------------------------------------------------------------------------------------------
# statistics along a granularity
# ---------------------------------------------------------------------------------------------
def _check_groups(x: torch.Tensor, gran: PerGroup) -> None:
    if x.shape[-1] % gran.group_size:
        raise SSMQError(f"group size {gran.group_size} does not divide the last dim {x.shape[-1]}")


def _reduce(x: torch.Tensor, gran: Granularity, fn) -> torch.Tensor:
    """Reduce x with ``fn(t, dim)`` to the canonical scale shape of ``gran``."""
    if isinstance(gran, PerTensor):
        return fn(x.reshape(-1), 0)
    if isinstance(gran, PerChannel):
        return fn(x.movedim(gran.axis, 0).reshape(x.shape[gran.axis], -1), 1)
    if isinstance(gran, PerToken):
        return fn(x, -1)
    if isinstance(gran, PerGroup):
        _check_groups(x, gran)
        return fn(x.unflatten(-1, (-1, gran.group_size)), -1)
    raise SSMQError(f"unknown granularity {gran!r}")


def minmax(x: torch.Tensor, gran: Granularity) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block (min, max) of x in float32, canonical scale shape of ``gran``."""
    xf = x.float()
    return _reduce(xf, gran, lambda t, d: t.amin(d)), _reduce(xf, gran, lambda t, d: t.amax(d))


def broadcast_to(p: torch.Tensor, x: torch.Tensor, gran: Granularity) -> torch.Tensor:
    """Canonical-shaped parameter p -> a tensor broadcastable against x (groups expanded)."""
    if isinstance(gran, PerTensor):
        return p.reshape(())
    if isinstance(gran, PerChannel):
        shape = [1] * x.dim()
        shape[gran.axis] = x.shape[gran.axis]
        return p.reshape(shape)
    if isinstance(gran, PerToken):
        return p.unsqueeze(-1)
    if isinstance(gran, PerGroup):
        _check_groups(x, gran)
        return p.repeat_interleave(gran.group_size, dim=-1)
    raise SSMQError(f"unknown granularity {gran!r}")


# ---------------------------------------------------------------------------------------------
# choose_qparams / quantize / dequantize
# ---------------------------------------------------------------------------------------------
def qparams_from_range(
    lo: torch.Tensor, hi: torch.Tensor, qtype: str, symmetric: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(scale float32, zero_point int32 or None) from an observed range [lo, hi] (any same shape).

    Used by ``choose_qparams`` and by every observer, so clipping (a narrower range) and
    quantization share one formula.
    """
    qmin, qmax = qrange(qtype)
    lo = lo.float().clamp(max=0.0)
    hi = hi.float().clamp(min=0.0)
    if symmetric or qtype == "fp8":
        if not symmetric:
            raise SSMQError("fp8 is symmetric only")
        scale = (torch.maximum(-lo, hi) / qmax).clamp(min=EPS)
        return scale, None
    scale = ((hi - lo) / (qmax - qmin)).clamp(min=EPS)
    zero_point = (qmin - torch.round(lo / scale)).clamp(qmin, qmax).to(torch.int32)
    return scale, zero_point


def choose_qparams(
    x: torch.Tensor, gran: Granularity, qtype: str, symmetric: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Round-to-nearest parameters from x's own range: (scale, zero_point) in canonical shape."""
    lo, hi = minmax(x, gran)
    return qparams_from_range(lo, hi, qtype, symmetric)


def quantize(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    gran: Granularity,
    qtype: str,
) -> torch.Tensor:
    """x (any shape) -> codes of x's shape: int8 tensor (int8/int4) or float8_e4m3fn (fp8)."""
    qmin, qmax = qrange(qtype)
    y = x.float() / broadcast_to(scale.float(), x, gran)
    if qtype == "fp8":
        # clamp first: the cast saturates on some builds and gives NaN on others
        return y.clamp(qmin, qmax).to(torch.float8_e4m3fn)
    y = torch.round(y)
    if zero_point is not None:
        y = y + broadcast_to(zero_point, x, gran).float()
    return y.clamp(qmin, qmax).to(torch.int8)


def dequantize(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    gran: Granularity,
) -> torch.Tensor:
    """Codes (any shape) -> float32 values: (q - zero_point) * scale."""
    y = q.float()
    if zero_point is not None:
        y = y - broadcast_to(zero_point, q, gran).float()
    return y * broadcast_to(scale.float(), q, gran)


def fake_quantize(x: torch.Tensor, gran: Granularity, qtype: str, symmetric: bool = True) -> torch.Tensor:
    """Round trip with round-to-nearest parameters from x itself; returns x's dtype."""
    scale, zp = choose_qparams(x, gran, qtype, symmetric)
    return dequantize(quantize(x, scale, zp, gran, qtype), scale, zp, gran).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# int4 packing
# ---------------------------------------------------------------------------------------------
def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int4 codes (..., k) int8 in [-8, 7], k even -> uint8 (..., k // 2).

    Layout: byte j holds element 2j in its LOW nibble and element 2j+1 in its HIGH
    nibble, each as 4-bit two's complement (e.g. [-1, 2] -> 0x2F).
    """
    if q.shape[-1] % 2:
        raise SSMQError(f"int4 packing needs an even last dim, got {q.shape[-1]}")
    u = q.to(torch.int16) & 0xF  # two's complement nibble
    return (u[..., 0::2] | (u[..., 1::2] << 4)).to(torch.uint8)


def unpack_int4(p: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_int4``: uint8 (..., k // 2) -> int8 (..., k) in [-8, 7]."""
    b = p.to(torch.int16)
    nib = torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)  # (..., k): low, high, low, ...
    return torch.where(nib >= 8, nib - 16, nib).to(torch.int8)


# ---------------------------------------------------------------------------------------------
# the integer GEMM reference
# ---------------------------------------------------------------------------------------------
def int_matmul_ref(
    a_q: torch.Tensor,
    a_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    group_size: int | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact integer GEMM: the result every W8A8 / W4A8 GPU kernel must reproduce bit for bit.

    a_q: (m, k) int8 activation codes (symmetric); a_scale: () per-tensor or (m,) per-token.
    w_q: (n, k) int8 codes (int8 or unpacked int4, symmetric); w_scale: () per-tensor,
    (n,) per-channel, or (n, k // group_size) per-group.
    bias: (n,) or None. Returns (m, n) float32.

    Semantics (the bit-exact contract):
      1. acc = sum_j a_q[i, j] * w_q[o, j] in int32 (exact: |acc| < 2^31 for k < 2^17);
         per group when ``group_size`` is set: acc_t over columns [t*g, (t+1)*g).
      2. epilogue in float32, in this order: s = a_scale[i] * w_scale[o] (or w_scale[o, t]);
         out = float32(acc) * s, and per-group: out = 0; out += float32(acc_t) * s_t for t = 0, 1, ...
      3. out += bias (float32), if any.
    """
    if a_q.dtype != torch.int8 or w_q.dtype != torch.int8:
        raise SSMQError(f"int_matmul_ref takes int8 codes, got {a_q.dtype} and {w_q.dtype}")
    m, k = a_q.shape
    n = w_q.shape[0]
    # int32 GEMM is CPU-only in torch; float64 gives the same integers wherever it runs
    # (every partial sum is an integer below 2^53), so CUDA tensors take that route.
    acc_dtype = torch.float64 if a_q.is_cuda else torch.int32
    a32, w32 = a_q.to(acc_dtype), w_q.to(acc_dtype)
    a_s = a_scale.float().reshape(-1, 1) if a_scale.numel() > 1 else a_scale.float().reshape(1, 1)  # (m|1, 1)
    if group_size is None:
        w_s = w_scale.float().reshape(1, -1) if w_scale.numel() > 1 else w_scale.float().reshape(1, 1)
        out = (a32 @ w32.T).float() * (a_s * w_s)
    else:
        if k % group_size:
            raise SSMQError(f"group size {group_size} does not divide k = {k}")
        out = torch.zeros(m, n, dtype=torch.float32, device=a_q.device)
        for t in range(k // group_size):
            cols = slice(t * group_size, (t + 1) * group_size)
            acc = a32[:, cols] @ w32[:, cols].T  # (m, n) integers
            out += acc.float() * (a_s * w_scale[:, t].float().reshape(1, n))
    if bias is not None:
        out = out + bias.float()
    return out
