"""Fusion of Hadamard rotations into linears: ``rotate_*_`` (offline, on weights) and ``RotatedLinear`` (online).

The matrices and the transform itself live in ``ssmq.ops.hadamard`` (kernels use them too); re-exported here.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ssmq.ops.hadamard import (  # noqa: F401  (re-exported: the quantization code and benchmarks import them here)
    _sylvester,
    base_matrix,
    hadamard_matrix,
    hadamard_transform,
    hadamard_transform_gemm,
    has_hadamard,
    kron_factors,
    split_order,
)


# ---------------------------------------------------------------------------------------------
# fusion into linear weights (Q = H / sqrt(n) orthogonal, so Q^-1 = Q.T)
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def rotate_input_(linear: nn.Linear) -> None:
    """W <- W Q.T in place, so that linear'(Q x) == linear(x). Weight (n_out, k)."""
    linear.weight.copy_(hadamard_transform(linear.weight.double()).to(linear.weight.dtype))


@torch.no_grad()
def rotate_output_(linear: nn.Linear) -> None:
    """W <- Q W, b <- Q b in place, so that linear'(x) == Q linear(x)."""
    linear.weight.copy_(hadamard_transform(linear.weight.double().T).T.to(linear.weight.dtype))
    if linear.bias is not None:
        linear.bias.copy_(hadamard_transform(linear.bias.double()).to(linear.bias.dtype))


@torch.no_grad()
def rotate_embedding_(embedding: nn.Embedding) -> None:
    """Rows e_t <- Q e_t in place (weight (vocab, d))."""
    embedding.weight.copy_(hadamard_transform(embedding.weight.double()).to(embedding.weight.dtype))


class RotatedLinear(nn.Linear):
    """A linear that applies the online transform x -> Q x before its (pre-rotated) weight.

    ``RotatedLinear.from_linear(lin)(x) == lin(x)`` in exact arithmetic: the weight holds W Q.T.
    The input is what gets quantized downstream, which is the point: Q spreads outliers.
    State-dict names are those of nn.Linear (weight, bias).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(hadamard_transform(x), self.weight, self.bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "RotatedLinear":
        new = cls(linear.in_features, linear.out_features, linear.bias is not None,
                  device=linear.weight.device, dtype=linear.weight.dtype)
        with torch.no_grad():
            new.weight.copy_(linear.weight)
            if linear.bias is not None:
                new.bias.copy_(linear.bias)
        rotate_input_(new)
        return new

    def spec(self) -> dict:
        return {"kind": "RotatedLinear", "in_features": self.in_features, "out_features": self.out_features,
                "bias": self.bias is not None}

    @classmethod
    def from_spec(cls, spec: dict, dtype=torch.float32, device=None) -> "RotatedLinear":
        return cls(spec["in_features"], spec["out_features"], spec["bias"], dtype=dtype, device=device)
