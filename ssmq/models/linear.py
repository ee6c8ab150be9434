"""The float linear layer of every model: ``nn.Linear`` whose few-row products run the decode GEMV.

At decode a projection multiplies one token per sequence by its weight: ``kernels.linear``
streams the weight once with a Triton GEMV on CUDA (faster than cuBLAS at these shapes) and is
plain ``F.linear`` elsewhere (CPU, prefill, more than a few rows). Parameters and state-dict
names are nn.Linear's, so loaders, transforms and quantization recipes see an ``nn.Linear``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ssmq import kernels


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.linear(x, self.weight, self.bias)
