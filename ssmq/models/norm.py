"""The block norm: RMSNorm with the residual add fused (``kernels.rms_norm``), its output float or, for an A8 linear
reading it, int8 codes."""

from __future__ import annotations

import torch
import torch.nn as nn

from ssmq import kernels
from ssmq.models.act_codes import ActCodes, CodeInput


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float, residual_in_fp32: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps, self.residual_in_fp32 = eps, residual_in_fp32

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, codes: CodeInput | None = None):
        """Returns (norm(x + residual), x + residual); with ``codes`` (what the A8 linear reading the norm wants),
        the norm's output comes as its int8 ``ActCodes``, quantized in the norm's epilogue."""
        if codes is None:
            return kernels.rms_norm(x, self.weight, self.eps, residual, self.residual_in_fp32)
        q, scale, residual = kernels.rms_norm_quant(x, self.weight, self.eps, residual, self.residual_in_fp32,
                                                    codes.scale, dtype=codes.dtype)
        return ActCodes(q, scale, self.weight.dtype), residual
