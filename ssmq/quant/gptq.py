"""GPTQ: quantize a weight column by column, pushing each column's error onto the columns not yet
quantized through the inverse Hessian of the layer inputs (Frantar et al., 2022).

Glossary: n output rows, k input columns (weight (n, k)), N calibration rows (inputs (N, k)).

    H = 2/N sum x x^T  (k, k)            accumulated by ``HessianAccumulator`` (float64)
    H += damp * mean(diag H) * I          dead columns (diag 0) get H_jj = 1 and weight 0
    U = chol(H^-1) upper                  column j's error err_j = (w_j - q(w_j)) / U_jj updates
                                          w_{j+1..} -= err_j * U_j,{j+1..}  (lazily per block of 128)
Group size g: one (scale, zero) per g consecutive columns, chosen when the group's first column
is reached (from the already-updated weights). With ``act_order`` (columns processed by
decreasing diag H), group parameters are fixed up front from the original weights ("static
groups"), so groups stay contiguous in the original column order and the result is stored like
any per-group weight (no column permutation / g_idx at inference).

Quantization of a column is ``primitives.quantize`` with ``PerChannel(0)`` parameters: one
definition of the scheme for RTN and GPTQ alike.
"""

from __future__ import annotations

import torch

from ssmq.errors import SSMQError
from ssmq.quant.primitives import PerChannel, PerGroup, PerTensor, choose_qparams, dequantize, quantize
from ssmq.quant.spec import WeightSpec


class HessianAccumulator:
    """Running H = 2/N sum x x^T over all rows x (..., k) passed to ``add`` (float64, (k, k))."""

    def __init__(self, k: int, device=None):
        self.H = torch.zeros(k, k, dtype=torch.float64, device=device)
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, self.H.shape[0]).double()
        m = x.shape[0]
        self.H *= self.n / (self.n + m)
        self.n += m
        x = x * (2.0 / self.n) ** 0.5
        self.H += x.T @ x


def _group_params(w: torch.Tensor, spec: WeightSpec):
    """(scale (n,), zero (n,) or None) for the columns w (n, c) of one group."""
    return choose_qparams(w, PerChannel(0), spec.dtype, spec.symmetric)


@torch.no_grad()
def gptq_quantize(weight: torch.Tensor, H: torch.Tensor, spec: WeightSpec):
    """weight (n, k), H (k, k) -> (codes int8 (n, k), scale, zero or None) in ``spec``'s canonical shapes.

    Per-channel and per-tensor specs use parameters from the whole original weight; per_group:g as
    described in the module docstring. The result feeds ``QuantLinear.from_float(..., qweight=...)``.
    """
    if spec.dtype not in ("int8", "int4"):
        raise SSMQError(f"gptq supports int8/int4 weights, not {spec.dtype}")
    W = weight.detach().double().clone()
    n, k = W.shape
    gran = spec.granularity
    g = gran.group_size if isinstance(gran, PerGroup) else None
    if g is not None and k % g:
        raise SSMQError(f"group size {g} does not divide in_features {k}")
    H = H.double().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0

    # fixed parameters: whole-matrix (per channel / tensor), or static groups under act_order
    if g is None:
        scale, zero = choose_qparams(W, gran, spec.dtype, spec.symmetric)
        col_scale = scale.expand(n) if isinstance(gran, PerTensor) else scale
        col_zero = None if zero is None else (zero.expand(n) if isinstance(gran, PerTensor) else zero)
        scales = zeros = None
    else:
        scales = torch.zeros(n, k // g, dtype=torch.float32, device=W.device)
        zeros = None if spec.symmetric else torch.zeros(n, k // g, dtype=torch.int32, device=W.device)
        if spec.act_order:
            for t in range(k // g):
                s, z = _group_params(W[:, t * g:(t + 1) * g], spec)
                scales[:, t] = s
                if zeros is not None:
                    zeros[:, t] = z

    perm = torch.argsort(torch.diag(H), descending=True) if spec.act_order else torch.arange(k, device=W.device)
    W, H = W[:, perm], H[perm][:, perm]
    H += spec.damp * torch.mean(torch.diag(H)) * torch.eye(k, dtype=H.dtype, device=H.device)
    try:
        U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    except RuntimeError:
        raise SSMQError("gptq: the Hessian is not positive definite even after damping; "
                        "use more calibration data or a larger damp") from None

    Q = torch.zeros(n, k, dtype=torch.int8, device=W.device)
    for b0 in range(0, k, spec.block_size):
        b1 = min(b0 + spec.block_size, k)
        W1, Err1 = W[:, b0:b1].clone(), torch.zeros(n, b1 - b0, dtype=W.dtype, device=W.device)
        U1 = U[b0:b1, b0:b1]
        for i in range(b1 - b0):
            j = perm[b0 + i].item()  # original column index
            if g is not None:
                t = j // g
                if not spec.act_order and j % g == 0:  # first column of a group: parameters from now
                    s, z = _group_params(W1[:, i:i + g] if i + g <= b1 - b0 else
                                         torch.cat((W1[:, i:], W[:, b1:b0 + i + g]), 1), spec)
                    scales[:, t] = s
                    if zeros is not None:
                        zeros[:, t] = z
                col_scale = scales[:, t]
                col_zero = None if zeros is None else zeros[:, t]
            w = W1[:, i:i + 1]  # (n, 1)
            q = quantize(w, col_scale, col_zero, PerChannel(0), spec.dtype)
            Q[:, j] = q[:, 0]
            err = (w - dequantize(q, col_scale, col_zero, PerChannel(0)).double()) / U1[i, i]
            W1[:, i:] -= err @ U1[i:i + 1, i:]
            Err1[:, i:i + 1] = err
        W[:, b1:] -= Err1 @ U[b0:b1, b1:]

    if g is None:
        return Q, scale, zero
    return Q, scales, zeros
