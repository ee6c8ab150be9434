"""QuaRot-style rotation of a whole model with normalised Hadamard matrices Q (orthogonal).

1. Fold every RMSNorm weight into the linears that read it (W <- W diag(w), w <- 1), so the norms
   commute with Q: RMSNorm(Q x) = Q RMSNorm(x). The final norm folds into lm_head (untied first).
2. Rotate the residual stream by Q (d_model): embedding rows e <- Q e; writers (out_proj, o_proj,
   down_proj) W <- Q W; readers (in_proj, q/k/v_proj, gate/up_proj, lm_head) W <- W Q.T.
3. ``online``: the writers become ``RotatedLinear``s: their input is rotated at run time
   (x -> Q' x, Q' of the writer's in_features) with W <- W Q'.T, which is what spreads outliers of the
   out_proj input (the SSM output y) before it is quantized.
4. ``online_ends`` (a model whose lm_head is tied to its embedding): steps 1-2 leave the embedding, the
   final norm and lm_head alone, and the rotation runs online at the two ends of the stream instead:
   ``RotatedEmbedding`` (h = Q e after the lookup) and ``UnrotatingRMSNorm`` (Q.T h, then the final norm
   with its own weight), so the tied matrix stays one matrix (folding Q into the rows and Q.T into lm_head
   would need two: on a model whose parameters are mostly embedding, more bytes than its source).
The float function is unchanged (up to rounding). Needs Hadamard orders for d_model and each
writer's in_features (``rotation_sizes``).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from ssmq.models.ffn import ffn_linears
from ssmq.ops.layout import LayerKind

from ssmq.quant.hadamard import (RotatedEmbedding, RotatedLinear, UnrotatingRMSNorm, rotate_embedding_, rotate_input_,
                                 rotate_output_)


def readers_writers(model: nn.Module) -> list[tuple[str, list[str], list[str]]]:
    """Per norm: (norm path, reader linear paths, writer linear paths of the block it feeds)."""
    out = []
    for i, layer in enumerate(model.layers):
        p = f"layers.{i}"
        if model.config.layer_kind(i) is LayerKind.ATTENTION:
            out.append((f"{p}.norm", [f"{p}.mixer.{n}_proj" for n in "qkv"], [f"{p}.mixer.o_proj"]))
        else:
            out.append((f"{p}.norm", [f"{p}.mixer.in_proj"], [f"{p}.mixer.out_proj"]))
        if layer.mlp is not None:
            readers, writers, _ = ffn_linears(layer.mlp)
            out.append((f"{p}.mlp_norm", [f"{p}.mlp.{n}" for n in readers], [f"{p}.mlp.{n}" for n in writers]))
    return out


def rotation_sizes(model: nn.Module, online: bool = True) -> dict[str, int]:
    """{what: order} of the Hadamard matrices ``rotate_model_`` needs."""
    sizes = {"d_model": model.config.d_model}
    if online:
        for _, _, writers in readers_writers(model):
            for w in writers:
                sizes[w] = model.get_submodule(w).in_features
    return sizes


def tied(model: nn.Module) -> bool:
    """lm_head and the embedding share one weight."""
    return getattr(model.lm_head, "weight", None) is getattr(model.embedding, "weight", None) is not None


def untie_lm_head_(model: nn.Module) -> None:
    """Give lm_head its own weight (a copy) and record it in the config (the checkpoint rebuilds it so)."""
    if model.lm_head.weight is model.embedding.weight:
        model.lm_head.weight = nn.Parameter(model.embedding.weight.detach().clone(), requires_grad=False)
    if model.config.tie_embeddings:
        model.config = dataclasses.replace(model.config, tie_embeddings=False)


@torch.no_grad()
def fold_norm_(norm: nn.Module, readers: list[nn.Linear]) -> None:
    for lin in readers:
        lin.weight.mul_(norm.weight.to(lin.weight.dtype).unsqueeze(0))
    norm.weight.fill_(1.0)


def _set(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, module)


@torch.no_grad()
def rotate_model_(model: nn.Module, online: bool = True, online_ends: bool = False) -> None:
    """Rotate a float SSMLM in place (see the module docstring). online_ends: a tied embedding / lm_head stays
    tied, the rotation at the ends of the residual stream runs online (an untied model folds it all the same)."""
    ends = online_ends and tied(model)
    if not ends:
        untie_lm_head_(model)
    sites = readers_writers(model)
    get = model.get_submodule
    for norm, readers, _ in sites:
        fold_norm_(get(norm), [get(r) for r in readers])
    if ends:
        model.embedding = RotatedEmbedding.from_embedding(model.embedding)
        model.norm_f = UnrotatingRMSNorm.from_norm(model.norm_f)
    else:
        fold_norm_(model.norm_f, [model.lm_head])
        rotate_embedding_(model.embedding)
    for _, readers, writers in sites:
        for r in readers:
            rotate_input_(get(r))
        for w in writers:
            rotate_output_(get(w))
            if online:
                _set(model, w, RotatedLinear.from_linear(get(w)))
    if not ends:
        rotate_input_(model.lm_head)
