"""The experts of a mixture-of-experts feed-forward on stacked weights: the reference of ``kernels.moe``.

Glossary: t tokens (b·l flattened), d model width, f expert hidden size, E experts, k experts per token.

The stacked weights are float (E, out, in), or the codes of a quantized linear stacked per expert with their scales
(the formats of ``ops.quant_linear``, symmetric, without zero points):

    codes                            scales (float32)                    activations
    int8 (E, out, in)                (E, out) per channel                float (weight-only: W8A16)
    uint8 (E, out, in // 2) int4     (E, out, in // g) per group of g    float (weight-only: W4A16)
    float8_e4m3fn (E, out, in)       (E, out) per channel                float, or with ``act_fp8`` e4m3 codes with a
                                                                         dynamic per-token scale (FP8 W8A8)

Each expert's linear then computes what its ``QuantLinear`` computes: ``quant_linear_ref`` (weight-only) or
``quant_linear_act_ref`` (FP8 W8A8).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ssmq.errors import SSMQError
from ssmq.ops.quant_linear import quant_linear_act_ref, quant_linear_ref

MOE_ACTS = ("silu", "relu2")
CODE_DTYPES = (torch.int8, torch.uint8, torch.float8_e4m3fn)


def check_experts(w_up, w_down, w_gate=None, act="silu", w_scales=None, act_fp8=False) -> None:
    """One clear error for stacked expert weights ``moe_experts_ref`` does not take (formats: module docstring)."""
    if act not in MOE_ACTS or (w_gate is None) != (act == "relu2"):
        raise ValueError(f"act {act!r} with{'out' if w_gate is None else ''} a gate: expected silu with a gate or "
                         "relu2 without")
    stacks = [w for w in (w_up, w_down, w_gate) if w is not None]
    if w_scales is None:
        if any(w.dtype in CODE_DTYPES for w in stacks) or act_fp8:
            raise SSMQError("quantized expert codes need their w_scales (and act_fp8 fp8 codes)")
        return
    scales = [s for s in w_scales if s is not None]
    if len(w_scales) != 3 or len(scales) != len(stacks) or (w_scales[2] is None) != (w_gate is None):
        raise SSMQError("w_scales holds the (up, down, gate) scale stacks, gate None where there is no gate")
    if len({w.dtype for w in stacks}) != 1 or stacks[0].dtype not in CODE_DTYPES:
        raise SSMQError(f"quantized experts take one code dtype of int8, uint8 (int4) or float8_e4m3fn, got "
                        f"{sorted({str(w.dtype) for w in stacks})}")
    for w, s in zip(stacks, scales):
        if s.dtype != torch.float32 or s.shape[:2] != w.shape[:2] or s.dim() not in (2, 3):
            raise SSMQError(f"expert scales must be float32 (E, out) or (E, out, groups) for codes "
                            f"{tuple(w.shape)}, got {s.dtype} {tuple(s.shape)}")
    if act_fp8 and (stacks[0].dtype != torch.float8_e4m3fn or any(s.dim() != 2 for s in scales)):
        raise SSMQError("fp8 activations need fp8 expert weights with per-channel scales")


def _linear(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor | None, act_fp8: bool) -> torch.Tensor:
    """x (m, in) @ w.T as the expert's linear computes it: float, weight-only or FP8 W8A8 (x quantized per token)."""
    if s is None:
        return F.linear(x, w)
    if act_fp8:
        return quant_linear_act_ref(x, w, s, None, True, torch.float8_e4m3fn)
    return quant_linear_ref(x, w, s)


def moe_experts_ref(
    x: torch.Tensor,
    weights: torch.Tensor,
    idx: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    w_gate: torch.Tensor | None = None,
    act: str = "silu",
    w_scales: tuple | None = None,
    act_fp8: bool = False,
) -> torch.Tensor:
    """Σ_j weights[:, j] · expert_idx[:, j](x) for each token.

    x: (t, d); weights: (t, k) float32 routing weights; idx: (t, k) int, each token's k experts (distinct);
    w_up, w_gate: (E, f, d) (int4 codes (E, f, d // 2)); w_down: (E, d, f) (int4 (E, d, f // 2)); w_scales: None
    for float weights, else (up, down, gate or None) scale stacks of the codes (formats: module docstring);
    act_fp8: FP8 W8A8 experts (x and h quantized to e4m3 per token, dynamically). Expert e is
    down_e(silu(gate_e(x)) · up_e(x)) with act "silu" (a gated MLP), down_e(relu(up_e(x))²) with act "relu2" (no
    gate: w_gate None). Each product is the expert's linear in x's dtype (``F.linear``, or its quantized op), the
    weighted sum over the k experts in float32. Returns (t, d) in x's dtype.
    """
    check_experts(w_up, w_down, w_gate, act, w_scales, act_fp8)
    s_up, s_down, s_gate = w_scales or (None, None, None)
    out = torch.zeros(x.shape[0], w_down.shape[1], dtype=torch.float32, device=x.device)
    for e in range(w_up.shape[0]):
        token, slot = torch.where(idx == e)  # the tokens routed to e, and at which of their k places
        if not token.numel():
            continue
        xe = x[token]
        lin = lambda inp, w, s: _linear(inp, w[e], None if s is None else s[e], act_fp8)  # noqa: E731
        up = lin(xe, w_up, s_up)
        h = F.silu(lin(xe, w_gate, s_gate)) * up if act == "silu" else F.relu(up).square()
        y = lin(h, w_down, s_down)
        out.index_add_(0, token, y.float() * weights[token, slot, None].float())
    return out.to(x.dtype)
