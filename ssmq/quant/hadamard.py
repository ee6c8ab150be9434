"""Fusion of Hadamard rotations into linears: ``rotate_*_`` (offline, on weights) and ``RotatedLinear`` (online);
the two ends of a rotated residual stream kept online (``RotatedEmbedding``, ``UnrotatingRMSNorm``) when the
embedding and lm_head share one matrix.

The matrices and the transform itself live in ``ssmq.ops.hadamard`` (kernels use them too); re-exported here.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ssmq.models.norm import RMSNorm
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


# ---------------------------------------------------------------------------------------------
# the ends of a rotated residual stream, online: a tied embedding / lm_head stays one matrix
# ---------------------------------------------------------------------------------------------
class RotatedEmbedding(nn.Embedding):
    """An embedding whose looked-up rows come out rotated: ids (...) -> Q e_id (..., d).

    The table itself is the unrotated one, so an lm_head tied to it stays tied; folding Q into the rows
    instead would need lm_head to read the unrotated table (an untied copy). Cost: one d-point Hadamard
    per token. State-dict names are those of nn.Embedding (weight).
    """

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return hadamard_transform(super().forward(ids))

    @classmethod
    def from_embedding(cls, emb: nn.Embedding) -> "RotatedEmbedding":
        """The same table (the same Parameter: a tie to lm_head is kept), rows rotated on lookup."""
        new = cls(emb.num_embeddings, emb.embedding_dim, padding_idx=emb.padding_idx, device="meta")
        new.weight = emb.weight
        return new

    def spec(self) -> dict:
        return {"kind": "RotatedEmbedding", "num_embeddings": self.num_embeddings,
                "embedding_dim": self.embedding_dim}

    @classmethod
    def from_spec(cls, spec: dict, dtype=torch.float32, device=None) -> "RotatedEmbedding":
        return cls(spec["num_embeddings"], spec["embedding_dim"], dtype=dtype, device=device)


class UnrotatingRMSNorm(RMSNorm):
    """The final norm of a model whose residual stream is rotated (h -> Q h): the stream is turned back
    (Q.T (x + residual), in float32) and then normalised with the norm's own weight, so lm_head reads what it
    read before the rotation. RMSNorm commutes with Q only at a unit weight, and folding this weight into
    lm_head would untie it from the embedding. Returns (out, the unrotated sum) as ``RMSNorm``; with
    ``codes``, out comes as the int8 ``ActCodes`` of an A8 lm_head."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, codes=None):
        r = x.float() if residual is None else x.float() + residual.float()
        return super().forward(hadamard_transform(r, inverse=True), None, codes)

    @classmethod
    def from_norm(cls, norm: RMSNorm) -> "UnrotatingRMSNorm":
        new = cls(norm.weight.shape[0], norm.eps, norm.residual_in_fp32)
        new.weight = norm.weight
        return new

    def spec(self) -> dict:
        return {"kind": "UnrotatingRMSNorm", "d": self.weight.shape[0], "eps": self.eps,
                "residual_in_fp32": self.residual_in_fp32}

    @classmethod
    def from_spec(cls, spec: dict, dtype=torch.float32, device=None) -> "UnrotatingRMSNorm":
        norm = cls(spec["d"], spec["eps"], spec["residual_in_fp32"])
        return norm.to(dtype=dtype, device=device)
