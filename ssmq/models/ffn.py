"""Feed-forward layers beyond the gated MLP: the squared-ReLU MLP (Nemotron-H) and a mixture of experts with top-k
routing (Granite-4.0-H, Jamba).

Glossary: t tokens (b·l flattened), d d_model, f hidden size, E experts, k experts per token.

``MoE`` is the plain reference: each expert a ``GatedMLP`` (so recipes quantize experts as any linear, by name
``layers.i.mlp.experts.j.{gate,up,down}_proj``), run on the tokens routed to it and summed with the routing
weights. The router is not an ``nn.Linear``: no recipe quantizes the routing decision.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

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

    # static_shapes: every expert runs on every token, weighted by its routing weight (0 where not chosen): no
    # data-dependent shapes nor host syncs, so a CUDA graph can capture it (``static_shapes_``), at E / k times the
    # expert work; else each expert runs on the tokens routed to it
    static_shapes = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., d) -> (..., d)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (t, d)
        weights, idx = route(self.router(x), self.cfg, self.router.e_score_correction_bias)  # (t, k)
        out = self._static(x, weights, idx) if self.static_shapes else self._routed(x, weights, idx)
        if self.shared is not None:
            out = out + self.shared(x)
        return out.view(shape)

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


def static_shapes_(model: nn.Module) -> None:
    """Run the model's mixtures of experts with static shapes (``MoE.static_shapes``): what a CUDA-graph capture
    needs."""
    for m in model.modules():
        if isinstance(m, MoE):
            m.static_shapes = True


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
