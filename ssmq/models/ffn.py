"""Feed-forward layers beyond the gated MLP: the squared-ReLU MLP (Nemotron-H) and a mixture of experts with top-k
routing (Granite-4.0-H, Jamba).

Glossary: t tokens (b·l flattened), d d_model, f hidden size, E experts, k experts per token.

``MoE`` keeps each expert a ``GatedMLP`` (so recipes quantize experts as any linear, by name
``layers.i.mlp.experts.j.{gate,up,down}_proj``). How the experts run is chosen once (``MoE.set_mode``): by default
each on the tokens routed to it (the plain reference: data-dependent shapes); with static shapes, as a CUDA graph
needs (``static_shapes_``), as one grouped GEMM on their stacked weights (``kernels.moe_experts``) where the experts
are float or quantized in a format it takes (symmetric int8 / int4 / fp8 weight-only, FP8 W8A8 with dynamic
per-token activations: ``MoE.groupable``), else each on every token, weighted 0 where not chosen. The router is not
an ``nn.Linear``: no recipe quantizes the routing decision.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ssmq import kernels
from ssmq.errors import SSMQError
from ssmq.models.config import ModelConfig
from ssmq.models.hybrid import GatedMLP
from ssmq.models.linear import Linear


class MLP(nn.Module):
    """down(relu(up(x))²): Nemotron-H's feed-forward, no gate."""

    def __init__(self, cfg: ModelConfig, hidden: int | None = None):
        super().__init__()
        hidden = hidden or cfg.mlp_hidden
        self.up_proj = Linear(cfg.d_model, hidden, bias=False)
        self.down_proj = Linear(hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.relu(self.up_proj(x)).square())


class Router(nn.Module):
    """Routing logits x @ weightᵀ (weight (E, d)), in float32; a parameter, not a linear, so it stays float. With
    sigmoid-group routing, also the per-expert correction bias added to the scores when choosing."""

    def __init__(self, d: int, n_experts: int, correction_bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_experts, d))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(n_experts)) if correction_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())


def route(logits: torch.Tensor, cfg: ModelConfig, bias: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (t, E) float32 -> (weights (t, k) float32, expert indices (t, k)), by ``cfg.moe_routing``:

    topk_softmax: softmax over the k largest logits (weights sum to 1; Granite); softmax_topk: the k largest of the
    softmax over all E (no renormalisation; Jamba); sigmoid_group: sigmoid scores, chosen with ``bias`` (E,) added
    among the experts of the moe_topk_groups groups whose two best scores sum highest, weighted by their scores
    (without the bias), normalised (moe_norm_topk) and times moe_scale (Nemotron-H, DeepSeek-V3)."""
    k = cfg.moe_top_k
    if cfg.moe_routing == "topk_softmax":
        top, idx = logits.topk(k, dim=-1)
        return top.softmax(dim=-1), idx
    if cfg.moe_routing == "softmax_topk":
        return logits.softmax(dim=-1).topk(k, dim=-1)
    scores = logits.sigmoid()
    choice = scores + bias.float()
    t, e, g = logits.shape[0], logits.shape[1], cfg.moe_groups
    group = choice.view(t, g, e // g).topk(min(2, e // g), dim=-1)[0].sum(dim=-1)  # (t, g)
    keep = torch.zeros_like(group).scatter_(1, group.topk(cfg.moe_topk_groups, dim=-1, sorted=False)[1], 1)
    choice = choice.masked_fill(keep.repeat_interleave(e // g, dim=1) == 0, float("-inf"))
    idx = choice.topk(k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, idx)
    if cfg.moe_norm_topk:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * cfg.moe_scale, idx


class MoE(nn.Module):
    """Σ_k w_k · expert_k(x) over the top-k experts of each token [+ shared(x), an always-on expert]; experts are
    gated MLPs or squared-ReLU MLPs (``cfg.moe_act``)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.router = Router(cfg.d_model, cfg.moe_experts, correction_bias=cfg.moe_routing == "sigmoid_group")
        expert = MLP if cfg.moe_act == "relu2" else GatedMLP
        self.experts = nn.ModuleList(expert(cfg, cfg.moe_hidden) for _ in range(cfg.moe_experts))
        self.shared = expert(cfg, cfg.moe_shared_hidden or cfg.mlp_hidden) if cfg.moe_shared else None
        # "grouped" mode: per projection name, the stacked weights (E, out, in) and None, or codes and scales
        self._stacked: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._act_fp8 = False  # "grouped" mode: FP8 W8A8 experts

    # how the experts run (``set_mode``): "routed" each on the tokens routed to it; "static" every expert on every
    # token, weighted by its routing weight (0 where not chosen), at E / k times the expert work; "grouped" the
    # stacked weights (float, or quantized codes and scales) through ``kernels.moe_experts``. The last two have no
    # data-dependent shapes nor host syncs, so a CUDA graph can capture them
    mode = "routed"
    MODES = ("routed", "static", "grouped")

    def groupable(self) -> bool:
        """Every expert linear in one format ``kernels.moe_experts`` takes (``_stack_format``): plain float linears,
        or quantized ones with symmetric int8 / int4 / fp8 codes per channel or per group of a multiple of 16 columns,
        float or FP8 W8A8 (dynamic per-token e4m3) activations, no bias, rotation nor tensor-parallel scale hook;
        and each gated MLP SiLU without multipliers (what the kernel computes)."""
        per_name = {n: {_stack_format(getattr(e, n)) for e in self.experts} for n in self._proj_names()}
        if any(len(f) != 1 or None in f for f in per_name.values()):  # one stack a projection: one format
            return False
        # one code type and activation format for both kernels, one scale layout for gate and up (one launch)
        if len({(f[0], f[3]) for (f,) in per_name.values()}) != 1:
            return False
        if per_name.get("gate_proj", per_name["up_proj"]) != per_name["up_proj"]:
            return False
        return all(not isinstance(e, GatedMLP) or e.act is F.silu and e.gate_scale is None
                   and e.down_scale is None for e in self.experts)

    def _proj_names(self) -> tuple[str, ...]:
        return ("up_proj", "down_proj") if self.cfg.moe_act == "relu2" else ("gate_proj", "up_proj", "down_proj")

    @torch.no_grad()
    def set_mode(self, mode: str) -> None:
        """Choose how the experts run. "grouped" stacks each projection's weights into one (E, out, in) tensor (codes:
        (E, out, in) or packed int4 (E, out, in // 2), with their scales (E, out) or (E, out, groups)) whose slices
        become the experts' weights (the same memory, no copy kept)."""
        if mode not in self.MODES:
            raise ValueError(f"unknown MoE mode {mode!r}; expected one of {', '.join(self.MODES)}")
        if mode == "grouped" and not self.groupable():
            raise SSMQError("the grouped MoE runs float experts and symmetric int8 / int4 / fp8 weight-only or FP8 "
                            "W8A8 experts per channel or per group of a multiple of 16 columns; these are quantized "
                            "otherwise")
        self.mode = mode
        for e in self.experts:  # a quantized expert run as its own module makes its decode GEMV's copy of the codes
            for name in self._proj_names():
                if hasattr(getattr(e, name), "decode_copy"):
                    getattr(e, name).decode_copy = mode != "grouped"
        if mode != "grouped":
            return
        for name in self._proj_names():
            linears = [getattr(e, name) for e in self.experts]
            if _stack_format(linears[0])[0] == "float":
                stacked = torch.stack([lin.weight for lin in linears])
                for lin, w in zip(linears, stacked):
                    lin.weight = nn.Parameter(w, requires_grad=False)
                self._stacked[name] = (stacked, None)
                continue
            codes = torch.stack([lin.weight_q for lin in linears])
            scales = torch.stack([lin.weight_scale for lin in linears])
            for lin, q, sc in zip(linears, codes, scales):
                lin.weight_q, lin.weight_scale = q, sc
                lin.weight_words = None  # the kernel reads the stack, not a decode GEMV's copy
            self._stacked[name] = (codes, scales)
        self._act_fp8 = _stack_format(self.experts[0].up_proj)[3]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., d) -> (..., d)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (t, d)
        weights, idx = route(self.router(x), self.cfg, self.router.e_score_correction_bias)  # (t, k)
        run = {"routed": self._routed, "static": self._static, "grouped": self._grouped}[self.mode]
        out = run(x, weights, idx)
        if self.shared is not None:
            out = out + self.shared(x)
        return out.view(shape)

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        st = self._stacked
        up, s_up = st["up_proj"]
        source = getattr(self.experts[0].up_proj, "weight" if s_up is None else "weight_q", None)
        if source is None or up.data_ptr() != source.data_ptr():
            raise SSMQError("the MoE's experts changed (moved, cast or quantized) after their weights were stacked: "
                            "set its mode again")
        down, s_down = st["down_proj"]
        gate, s_gate = st.get("gate_proj", (None, None))
        scales = None if s_up is None else (s_up, s_down, s_gate)
        return kernels.moe_experts(x, weights, idx, up, down, gate, self.cfg.moe_act, scales, self._act_fp8)

    def _routed(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(idx == e)  # the tokens routed to expert e, and at which of their k places
            if token.numel():
                y = expert(x[token]) * weights[token, slot, None].to(x.dtype)
                out.index_add_(0, token, y)
        return out

    def _static(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        combine = torch.zeros(x.shape[0], len(self.experts), dtype=weights.dtype, device=x.device)
        combine.scatter_(1, idx, weights)  # (t, E): each token's weight for every expert, 0 for the unchosen
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out = out + expert(x) * combine[:, e, None].to(x.dtype)
        return out


def feed_forward(cfg: ModelConfig, layer_idx: int) -> nn.Module | None:
    """Block ``layer_idx``'s feed-forward as ``cfg.ffn_kind`` says: MoE, GatedMLP (silu), MLP (relu2) or None."""
    kind = cfg.ffn_kind(layer_idx)
    if kind == "moe":
        return MoE(cfg)
    if kind == "mlp":
        return MLP(cfg) if cfg.mlp_act == "relu2" else GatedMLP(cfg)
    return None


def _stack_format(linear: nn.Module) -> tuple | None:
    """How ``kernels.moe_experts`` takes an expert linear's weight: ("float", None, None, False) for a plain float
    linear without bias; (code dtype, scale shape, groups' width, FP8 activations) for a quantized one
    (``QuantLinear``, read through its buffers and ``code_input``) with symmetric codes per channel or per group of a
    multiple of 16 columns, float or dynamic per-token e4m3 activations, no bias, rotation nor tensor-parallel scale
    hook; None otherwise."""
    if type(linear) in (Linear, nn.Linear):
        return ("float", None, None, False) if linear.bias is None else None
    q, s = getattr(linear, "weight_q", None), getattr(linear, "weight_scale", None)
    if q is None or linear.bias is not None or linear.weight_zero is not None or linear.rotate_input \
            or linear.scale_hook is not None or s.dim() not in (1, 2):
        return None
    codes = linear.code_input() if linear.act is not None else None
    fp8_act = codes is not None and codes.scale is None and codes.dtype == torch.float8_e4m3fn
    if linear.act is not None and not (fp8_act and q.dtype == torch.float8_e4m3fn and s.dim() == 1):
        return None
    width = linear.in_features // (s.shape[1] if s.dim() == 2 else 1)
    if s.dim() == 2 and width % 16:
        return None
    return (str(q.dtype), tuple(s.shape), width, fp8_act)


def static_shapes_(model: nn.Module) -> None:
    """Run the model's mixtures of experts with static shapes, what a CUDA-graph capture needs: grouped (one grouped
    GEMM launch on CUDA, ``kernels.moe_experts``) where their experts are float or quantized in a format it takes
    (``MoE.groupable``), else each expert on every token (``MoE.set_mode``)."""
    for m in model.modules():
        if isinstance(m, MoE) and m.mode == "routed":
            m.set_mode("grouped" if m.groupable() else "static")


def ffn_linears(mlp: nn.Module) -> tuple[list[str], list[str], list[tuple[str, str]]]:
    """The linears of a feed-forward, as paths relative to it, for transforms that fold into them (SmoothQuant,
    Hadamard rotation): (readers of the norm before it, writers into the residual stream, [(up, down)] pairs of
    gated MLPs, where up's output rows scale down's input columns linearly; not so under relu²). A MoE's router reads
    the norm too: it is a reader (it has a (E, d) weight) though no linear."""
    if isinstance(mlp, MoE):
        parts = [(f"experts.{e}.", m) for e, m in enumerate(mlp.experts)]
        parts += [("shared.", mlp.shared)] if mlp.shared is not None else []
        readers, writers, pairs = ["router"], [], []
        for prefix, m in parts:
            r, w, g = ffn_linears(m)
            readers += [prefix + n for n in r]
            writers += [prefix + n for n in w]
            pairs += [(prefix + up, prefix + down) for up, down in g]
        return readers, writers, pairs
    if isinstance(mlp, MLP):
        return ["up_proj"], ["down_proj"], []
    return ["gate_proj", "up_proj"], ["down_proj"], [("up_proj", "down_proj")]
