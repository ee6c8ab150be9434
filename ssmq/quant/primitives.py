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
# int4 packing and the integer GEMM reference live with the quantized linear op that the kernels
# reproduce (ssmq.ops.quant_linear); re-exported: every scheme stays reachable from this module
from ssmq.ops.quant_linear import EPS, FP8_MAX, absmax_scale, int_matmul_ref, pack_int4, unpack_int4  # noqa: F401



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
        return absmax_scale(torch.maximum(-lo, hi), qmax), None
    scale = absmax_scale(hi - lo, qmax - qmin)  # the span over the code range
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

