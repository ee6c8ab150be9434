"""Triton fake quantization: x -> dequantize(quantize(x)) in one pass, as ``ssmq.ops.quant_ssm.fake_quantize_ref``
(the output of an ``ActQuantizer`` tap; torch runs it as eight elementwise kernels). Bit-exact: IEEE division, round
half to even, one float32 multiply, one cast.

Glossary: m rows (all leading dims), d channels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ssmq.errors import SSMQError
from ssmq.kernels._common import cdiv, pow2, quantize_rne
from ssmq.kernels.launch import fast_launch


@fast_launch
@triton.jit
def _fake_quant(x_ptr, s_ptr, out_ptr, d, s_xm, s_om, s_sd, BD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BD + tl.arange(0, BD)
    m = offs < d
    x = tl.load(x_ptr + row * s_xm + offs, mask=m, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + offs * s_sd, mask=m, other=1.0)
    y = quantize_rne(x, s).to(tl.float32) * s
    tl.store(out_ptr + row * s_om + offs, y.to(out_ptr.dtype.element_ty), mask=m)


def fake_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (..., d) float, scale () or (d,) -> (..., d) in x's dtype."""
    d = x.shape[-1]
    if not (scale.dim() == 0 or tuple(scale.shape) == (d,)):
        raise SSMQError(f"fake-quant scale must be () or ({d},), got {tuple(scale.shape)}")
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    s = scale.to(device=x.device, dtype=torch.float32).reshape(-1).expand(d)
    out = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    if x2.shape[0] == 0 or d == 0:
        return out
    o2 = out.view(-1, d)
    BD = min(1024, pow2(d, 16))
    _fake_quant[(x2.shape[0], cdiv(d, BD))](x2, s, o2, d, x2.stride(0), o2.stride(0), s.stride(0), BD=BD,
                                                   num_warps=4)
    return out
