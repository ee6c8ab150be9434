"""The SSM and hybrid families beyond Mamba / Bamba / Llama, read from their Hugging Face folders onto SSMLM.

One model assembly (``SSMLM``: blocks of norm → mixer [→ norm → feed-forward]) reads each family's layer pattern
from its config; a family here is data: how its config.json maps onto ``ModelConfig`` and how its tensor names map
onto ssmq's (both ways, for loading and for writing HF folders).

    family            HF class                       arch     mixers                 feed-forward
    falcon_mamba      FalconMambaForCausalLM         mamba1   Mamba-1 + Δ/B/C norms  -
    nemotron_h        NemotronHForCausalLM           hybrid   Mamba-2, attention     squared-ReLU MLP or MoE
    granitemoehybrid  GraniteMoeHybridForCausalLM    hybrid   Mamba-2, attention     MoE + shared MLP, or MLP
    jamba             JambaForCausalLM               hybrid   Mamba-1 + Δ/B/C norms, attention   MLP or MoE
    zamba2            Zamba2ForCausalLM              hybrid   Mamba-2 [+ a shared transformer block before it]  -
    falcon_h1         FalconH1ForCausalLM            hybrid   Mamba-2 and attention in parallel   gated MLP

Nemotron-H lists mixers and feed-forwards as separate layers (pattern ``M-M*-``: M Mamba-2, * attention, - MLP, E
MoE); each feed-forward layer joins the mixer layer before it as that block's feed-forward (the same pre-norm residual
sums), so ssmq's block j holds HF layers (i, i+1). A pattern with a feed-forward layer not right after a mixer layer
is refused.

Zamba2 and Falcon-H1 run attention beside the Mamba-2 mixer of a block (``ModelConfig.side_attention_layers``):
Zamba2 one of its shared transformer blocks (weights stored once, under its first use ``layers.j.shared.block``, as
the family's checkpoints store them; each use's LoRA adapters and output linear in ``layers.j.shared``), Falcon-H1 an attention layer in parallel
(``layers.j.attn``) with its µP multipliers.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ssmq.errors import SSMQError
from ssmq.models.config import ModelConfig, dt_limit_from_json

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Family:
    model_type: str
    label: str  # the name users know, e.g. "Nemotron-H"
    hf_class: str
    config: Callable[[dict], ModelConfig]  # HF config.json -> ModelConfig
    to_ssmq: Callable[[Tensors, ModelConfig], Tensors]  # HF tensors -> ssmq tensors
    to_hf: Callable[[Tensors, ModelConfig], Tensors]  # ssmq tensors -> HF tensors (the inverse)
    # ModelConfig -> the family's config.json, for writers of HF folders whose tensors map name for name
    # (compressed-tensors export); None where a tensor of one side is several of the other (Granite's fused ones)
    config_to_hf: Callable[[ModelConfig], dict] | None = None


def _rename(state: Tensors, rules: list[tuple[str, str]]) -> Tensors:
    out = {}
    for name, t in state.items():
        for pattern, repl in rules:
            name, n = re.subn(pattern, repl, name)
            if n:
                break
        out[name] = t
    return out


def _attention(c: dict, rotary: bool) -> dict:
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    rope = c.get("rope_parameters") or {}
    if rotary and rope.get("rope_type", "default") != "default":
        raise SSMQError(f"RoPE type {rope.get('rope_type')!r} is not supported (only 'default')")
    return dict(attn_heads=heads, attn_kv_heads=c.get("num_key_value_heads") or heads, attn_head_dim=head_dim,
                rotary_dim=head_dim if rotary else 0, rope_theta=rope.get("rope_theta", c.get("rope_theta", 10000.0)),
                max_position_embeddings=c.get("max_position_embeddings", 4096))


# ---------------------------------------------------------------- Falcon-Mamba

def _falcon_mamba_config(c: dict) -> ModelConfig:
    if c.get("hidden_act", "silu") != "silu":
        raise SSMQError(f"Falcon-Mamba with hidden_act={c.get('hidden_act')!r} is not supported (only silu)")
    return ModelConfig(arch="mamba1", family="falcon_mamba", d_model=c["hidden_size"], n_layer=c["num_hidden_layers"],
                       vocab_size=c["vocab_size"], d_state=c["state_size"], d_conv=c["conv_kernel"],
                       expand=c["expand"], ssm_d_inner=c.get("intermediate_size", 0), dt_rank=c["time_step_rank"],
                       conv_bias=c.get("use_conv_bias", True), proj_bias=c.get("use_bias", False),
                       norm_eps=c.get("layer_norm_epsilon", 1e-5), residual_in_fp32=c.get("residual_in_fp32", True),
                       tie_embeddings=c.get("tie_word_embeddings", True), bcdt_norm="weightless",
                       bcdt_norm_eps=c.get("mixer_rms_eps", 1e-6))


_BACKBONE_TO_SSMQ = [(r"^(backbone|model)\.embeddings?\.", "embedding."), (r"^(backbone|model)\.norm_f\.", "norm_f."),
                     (r"^(backbone|model)\.layers\.(\d+)\.mixer\.dt_proj\.bias$", r"layers.\2.mixer.dt_bias"),
                     (r"^(backbone|model)\.layers\.", "layers.")]
_BACKBONE_TO_HF = [(r"^embedding\.", "backbone.embeddings."), (r"^norm_f\.", "backbone.norm_f."),
                   (r"^layers\.(\d+)\.mixer\.dt_bias$", r"backbone.layers.\1.mixer.dt_proj.bias"),
                   (r"^layers\.", "backbone.layers.")]


# ---------------------------------------------------------------- Nemotron-H

_NEMOTRON_KINDS = {"M": "M", "mamba": "M", "linear_attention": "M", "*": "*", "attention": "*",
                   "full_attention": "*", "-": "-", "mlp": "-", "E": "E", "moe": "E"}


def _nemotron_blocks(c: dict) -> list[tuple[str, str]]:
    """[(mixer 'M' | '*', its feed-forward layer '-' | 'E' | '')] from layers_block_type or hybrid_override_pattern."""
    types = c.get("layers_block_type") or c.get("layer_types") or list(c.get("hybrid_override_pattern") or "")
    if not types:
        raise SSMQError("Nemotron-H config has neither layers_block_type nor hybrid_override_pattern")
    kinds = [_NEMOTRON_KINDS.get(t) for t in types]
    if None in kinds:
        raise SSMQError(f"Nemotron-H layer type {types[kinds.index(None)]!r} is unknown")
    blocks: list[list] = []
    for i, k in enumerate(kinds):
        if k in "-E":
            if not blocks or blocks[-1][1]:
                raise SSMQError(f"Nemotron-H pattern {''.join(kinds)}: the feed-forward layer {i} does not follow a "
                                "mixer layer (not supported)")
            blocks[-1][1] = k
        else:
            blocks.append([k, ""])
    return [(k, ffn) for k, ffn in blocks]


def _nemotron_config(c: dict) -> ModelConfig:
    if c.get("mlp_hidden_act", "relu2") != "relu2" or c.get("mlp_bias", False):
        raise SSMQError(f"Nemotron-H with mlp_hidden_act={c.get('mlp_hidden_act')!r}, mlp_bias={c.get('mlp_bias')} "
                        "is not supported (only the squared-ReLU MLP without biases)")
    if c.get("mamba_hidden_act", "silu") != "silu":
        raise SSMQError(f"Nemotron-H with mamba_hidden_act={c.get('mamba_hidden_act')!r} is not supported")
    blocks = _nemotron_blocks(c)
    heads, headdim = c["mamba_num_heads"], c["mamba_head_dim"]
    attn = _attention(c, rotary=False) if any(k == "*" for k, _ in blocks) else {}
    moe_idx = tuple(j for j, (_, ffn) in enumerate(blocks) if ffn == "E")
    moe = {}
    if moe_idx:
        if c.get("moe_latent_size") is not None or c.get("n_shared_experts", 1) != 1:
            raise SSMQError("Nemotron-H MoE with latent projections (moe_latent_size) or other than one shared expert "
                            "is not supported")
        moe = dict(moe_layer_idx=moe_idx, moe_experts=c.get("n_routed_experts", c.get("num_local_experts")),
                   moe_top_k=c["num_experts_per_tok"], moe_hidden=c["moe_intermediate_size"],
                   moe_routing="sigmoid_group", moe_groups=c.get("n_group", 1), moe_topk_groups=c.get("topk_group", 1),
                   moe_norm_topk=c.get("norm_topk_prob", True), moe_scale=float(c.get("routed_scaling_factor", 1.0)),
                   moe_act="relu2", moe_shared=True, moe_shared_hidden=c["moe_shared_expert_intermediate_size"])
    # transformers clamps Δ below at time_step_min in its chunked scan (dt_limit), with no upper limit
    return ModelConfig(
        arch="hybrid", family="nemotron_h", d_model=c["hidden_size"], n_layer=len(blocks), vocab_size=c["vocab_size"],
        d_state=c["ssm_state_size"], d_conv=c.get("conv_kernel", 4), expand=c.get("expand", 2),
        ssm_d_inner=heads * headdim, headdim=headdim, ngroups=c.get("n_groups", 1), chunk_size=c.get("chunk_size", 256),
        dt_limit=(float(c.get("time_step_min", 0.0)), float("inf")), conv_bias=c.get("use_conv_bias", True),
        proj_bias=c.get("use_bias", False), norm_eps=c.get("layer_norm_epsilon", 1e-5),
        residual_in_fp32=c.get("residual_in_fp32", False), tie_embeddings=c.get("tie_word_embeddings", False),
        attn_layer_idx=tuple(j for j, (k, _) in enumerate(blocks) if k == "*"),
        mlp_hidden=c.get("intermediate_size", 0) if any(ffn == "-" for _, ffn in blocks) else 0,
        mlp_layer_idx=tuple(j for j, (_, ffn) in enumerate(blocks) if ffn == "-"), mlp_act="relu2",
        **attn, **moe)


# inside a Nemotron-H MoE layer: HF names after "mixer." -> ssmq's after "mlp."
_NEMOTRON_MOE = [(r"^gate\.", "router."), (r"^shared_experts\.", "shared.")]


def _nemotron_layers(cfg: ModelConfig) -> list[tuple[int, str]]:
    """HF layer i -> (ssmq block j, "mixer" | "mlp")."""
    out = []
    for j in range(cfg.n_layer):
        out.append((j, "mixer"))
        if cfg.ffn_kind(j):
            out.append((j, "mlp"))
    return out


def _nemotron_to_ssmq(state: Tensors, cfg: ModelConfig) -> Tensors:
    layers = _nemotron_layers(cfg)
    out = {}
    for name, t in state.items():
        m = re.match(r"^(backbone|model)\.layers\.(\d+)\.(norm|mixer)\.(.*)$", name)
        if m:
            i = int(m.group(2))
            if i >= len(layers):
                raise SSMQError(f"tensor {name}: layer {i} beyond the config's {len(layers)} layers")
            j, role = layers[i]
            part = {("mixer", "norm"): "norm", ("mixer", "mixer"): "mixer", ("mlp", "norm"): "mlp_norm",
                    ("mlp", "mixer"): "mlp"}[role, m.group(3)]
            rest = m.group(4)
            if part == "mlp":
                rest = _rename({rest: t}, _NEMOTRON_MOE).popitem()[0]
            out[f"layers.{j}.{part}.{rest}"] = t
        else:
            out[_rename({name: t}, _BACKBONE_TO_SSMQ).popitem()[0]] = t
    return out


def _nemotron_to_hf(state: Tensors, cfg: ModelConfig) -> Tensors:
    index = {jr: i for i, jr in enumerate(_nemotron_layers(cfg))}
    out = {}
    for name, t in state.items():
        m = re.match(r"^layers\.(\d+)\.(norm|mixer|mlp_norm|mlp)\.(.*)$", name)
        if m:
            j, part, rest = int(m.group(1)), m.group(2), m.group(3)
            i = index[j, "mlp" if part.startswith("mlp") else "mixer"]
            if part == "mlp":
                rest = _rename({rest: t}, [(r"^router\.", "gate."), (r"^shared\.", "shared_experts.")]).popitem()[0]
            out[f"backbone.layers.{i}.{'norm' if part.endswith('norm') else 'mixer'}.{rest}"] = t
        else:
            out[_rename({name: t}, _BACKBONE_TO_HF).popitem()[0]] = t
    return out


# ---------------------------------------------------------------- Granite-4.0-H (GraniteMoeHybrid)

def _granite_config(c: dict) -> ModelConfig:
    if c.get("hidden_act", "silu") != "silu":
        raise SSMQError(f"Granite-4.0-H with hidden_act={c.get('hidden_act')!r} is not supported (only silu)")
    n = c["num_hidden_layers"]
    types = c.get("layer_types") or ["mamba"] * n
    attn_idx = tuple(i for i, t in enumerate(types) if t in ("attention", "full_attention"))
    if any(t not in ("mamba", "linear_attention", "attention", "full_attention") for t in types) or len(types) != n:
        raise SSMQError(f"Granite-4.0-H layer_types {types} not understood")
    pos = c.get("position_embedding_type")
    if pos not in (None, "nope", "rope"):
        raise SSMQError(f"Granite-4.0-H position_embedding_type {pos!r} is not supported (rope or nope)")
    d, expand = c["hidden_size"], c.get("mamba_expand", 2)
    d_inner, heads = int(expand * d), c["mamba_n_heads"]
    headdim = c.get("mamba_d_head", "auto")
    headdim = d_inner // heads if headdim == "auto" else headdim
    if heads * headdim != d_inner:
        raise SSMQError(f"Granite-4.0-H mamba_n_heads {heads} x mamba_d_head {headdim} != mamba_expand x "
                        f"hidden_size {d_inner}")
    experts = c.get("num_local_experts") or 0
    moe = dict(moe_layer_idx=tuple(range(n)), moe_experts=experts, moe_top_k=c["num_experts_per_tok"],
               moe_hidden=c["intermediate_size"], moe_routing="topk_softmax", moe_shared=True) if experts else {}
    attn = _attention(c, rotary=pos == "rope") if attn_idx else {}
    return ModelConfig(
        arch="hybrid", family="granitemoehybrid", d_model=d, n_layer=n, vocab_size=c["vocab_size"],
        d_state=c["mamba_d_state"], d_conv=c.get("mamba_d_conv", 4), expand=expand, ssm_d_inner=d_inner,
        headdim=headdim, ngroups=c.get("mamba_n_groups", 1), chunk_size=c.get("mamba_chunk_size", 256),
        norm_group_size=d_inner, dt_limit=dt_limit_from_json(c.get("time_step_limit")),
        conv_bias=c.get("mamba_conv_bias", True), proj_bias=c.get("mamba_proj_bias", False),
        norm_eps=c.get("rms_norm_eps", 1e-6), residual_in_fp32=False,
        tie_embeddings=c.get("tie_word_embeddings", False), attn_layer_idx=attn_idx,
        attn_bias=c.get("attention_bias", False), mlp_hidden=c["shared_intermediate_size"],
        embedding_multiplier=float(c.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(c.get("residual_multiplier", 1.0)),
        logits_scaling=float(c.get("logits_scaling", 1.0)), attn_scale=float(c.get("attention_multiplier", 0.0)),
        **attn, **moe)


_GRANITE_TO_SSMQ = [(r"^model\.embed_tokens\.", "embedding."), (r"^model\.norm\.", "norm_f."),
                    (r"^model\.layers\.(\d+)\.input_layernorm\.", r"layers.\1.norm."),
                    (r"^model\.layers\.(\d+)\.post_attention_layernorm\.", r"layers.\1.mlp_norm."),
                    (r"^model\.layers\.(\d+)\.(mamba|self_attn)\.", r"layers.\1.mixer."),
                    (r"^model\.layers\.(\d+)\.block_sparse_moe\.router\.layer\.", r"layers.\1.mlp.router.")]


def _granite_to_ssmq(state: Tensors, cfg: ModelConfig) -> Tensors:
    out = {}
    for name, t in state.items():
        m = re.match(r"^model\.layers\.(\d+)\.(shared_mlp|block_sparse_moe)\.(input|output)_linear\.weight$", name)
        if not m:
            out.update(_rename({name: t}, _GRANITE_TO_SSMQ))
            continue
        j, which, io = m.groups()
        if which == "shared_mlp":  # (2f, d) = [gate | up]; (d, f)
            p = f"layers.{j}.mlp.shared." if cfg.ffn_kind(int(j)) == "moe" else f"layers.{j}.mlp."
            if io == "input":
                out[p + "gate_proj.weight"], out[p + "up_proj.weight"] = t.chunk(2, dim=0)
            else:
                out[p + "down_proj.weight"] = t
        else:  # experts stacked: (E, 2F, d) = [gate | up] per expert; (E, d, F)
            for e in range(t.shape[0]):
                p = f"layers.{j}.mlp.experts.{e}."
                if io == "input":
                    out[p + "gate_proj.weight"], out[p + "up_proj.weight"] = t[e].chunk(2, dim=0)
                else:
                    out[p + "down_proj.weight"] = t[e]
    return out


def _granite_to_hf(state: Tensors, cfg: ModelConfig) -> Tensors:
    out, experts = {}, {}
    for name, t in state.items():
        m = re.match(r"^layers\.(\d+)\.mlp\.(?:(shared)\.|experts\.(\d+)\.)?(gate|up|down)_proj\.weight$", name)
        if m:
            j, _, e, proj = m.groups()
            key = (int(j), "block_sparse_moe" if e is not None else "shared_mlp")
            experts.setdefault(key, {})[(int(e) if e is not None else 0, proj)] = t
            continue
        rules = [(r"^embedding\.", "model.embed_tokens."), (r"^norm_f\.", "model.norm."),
                 (r"^layers\.(\d+)\.norm\.", r"model.layers.\1.input_layernorm."),
                 (r"^layers\.(\d+)\.mlp_norm\.", r"model.layers.\1.post_attention_layernorm."),
                 (r"^layers\.(\d+)\.mlp\.router\.", r"model.layers.\1.block_sparse_moe.router.layer.")]
        m = re.match(r"^layers\.(\d+)\.mixer\.", name)
        if m:
            kind = "self_attn" if int(m.group(1)) in cfg.attn_layer_idx else "mamba"
            out[f"model.layers.{m.group(1)}.{kind}.{name[m.end():]}"] = t
        else:
            out.update(_rename({name: t}, rules))
    for (j, which), parts in experts.items():
        n = 1 + max(e for e, _ in parts)
        gate_up = [torch.cat([parts[e, "gate"], parts[e, "up"]]) for e in range(n)]
        down = [parts[e, "down"] for e in range(n)]
        p = f"model.layers.{j}.{which}."
        out[p + "input_linear.weight"] = gate_up[0] if which == "shared_mlp" else torch.stack(gate_up)
        out[p + "output_linear.weight"] = down[0] if which == "shared_mlp" else torch.stack(down)
    return out


# ---------------------------------------------------------------- Jamba

def _jamba_config(c: dict) -> ModelConfig:
    if c.get("hidden_act", "silu") != "silu":
        raise SSMQError(f"Jamba with hidden_act={c.get('hidden_act')!r} is not supported (only silu)")
    n, d = c["num_hidden_layers"], c["hidden_size"]
    rank = c.get("mamba_dt_rank", "auto")
    period = lambda key: (c.get(f"{key}_layer_period", 1), c.get(f"{key}_layer_offset", 0))  # noqa: E731
    (ap, ao), (ep, eo) = period("attn"), period("expert")
    attn_idx = tuple(i for i in range(n) if i % ap == ao)
    experts = c.get("num_experts", 1)
    moe_idx = tuple(i for i in range(n) if i % ep == eo) if experts > 1 else ()
    moe = dict(moe_layer_idx=moe_idx, moe_experts=experts, moe_top_k=c["num_experts_per_tok"],
               moe_hidden=c["intermediate_size"], moe_routing="softmax_topk") if moe_idx else {}
    return ModelConfig(
        arch="hybrid", hybrid_ssm="mamba1", family="jamba", d_model=d, n_layer=n, vocab_size=c["vocab_size"],
        d_state=c.get("mamba_d_state", 16), d_conv=c.get("mamba_d_conv", 4), expand=c.get("mamba_expand", 2),
        dt_rank=None if rank == "auto" else int(rank), conv_bias=c.get("mamba_conv_bias", True),
        proj_bias=c.get("mamba_proj_bias", False), norm_eps=c.get("rms_norm_eps", 1e-6), residual_in_fp32=False,
        tie_embeddings=c.get("tie_word_embeddings", False), bcdt_norm="weighted",
        bcdt_norm_eps=c.get("rms_norm_eps", 1e-6),
        attn_layer_idx=attn_idx, mlp_hidden=c["intermediate_size"], **(_attention(c, rotary=False) if attn_idx else {}),
        **moe)


# HF (Bamba's naming and Jamba's): norms, mixers (mamba | self_attn), feed_forward (an MLP, or router + experts)
_JAMBA_TO_SSMQ = [(r"^model\.embed_tokens\.", "embedding."), (r"^model\.final_layernorm\.", "norm_f."),
                  (r"^model\.layers\.(\d+)\.input_layernorm\.", r"layers.\1.norm."),
                  (r"^model\.layers\.(\d+)\.pre_ff_layernorm\.", r"layers.\1.mlp_norm."),
                  (r"^model\.layers\.(\d+)\.mamba\.dt_proj\.bias$", r"layers.\1.mixer.dt_bias"),
                  (r"^model\.layers\.(\d+)\.(mamba|self_attn)\.", r"layers.\1.mixer."),
                  (r"^model\.layers\.(\d+)\.feed_forward\.", r"layers.\1.mlp.")]


def _jamba_to_hf(state: Tensors, cfg: ModelConfig) -> Tensors:
    rules = [(r"^embedding\.", "model.embed_tokens."), (r"^norm_f\.", "model.final_layernorm."),
             (r"^layers\.(\d+)\.norm\.", r"model.layers.\1.input_layernorm."),
             (r"^layers\.(\d+)\.mlp_norm\.", r"model.layers.\1.pre_ff_layernorm."),
             (r"^layers\.(\d+)\.mixer\.dt_bias$", r"model.layers.\1.mamba.dt_proj.bias"),
             (r"^layers\.(\d+)\.mlp\.", r"model.layers.\1.feed_forward.")]
    out = {}
    for name, t in state.items():
        m = re.match(r"^layers\.(\d+)\.mixer\.(?!dt_bias$)", name)
        if m:
            kind = "self_attn" if int(m.group(1)) in cfg.attn_layer_idx else "mamba"
            out[f"model.layers.{m.group(1)}.{kind}.{name[m.end():]}"] = t
        else:
            out.update(_rename({name: t}, rules))
    return out


# ---------------------------------------------------------------- Zamba2

_ZAMBA_KINDS = {"mamba": "M", "mamba2": "M", "linear_attention": "M", "hybrid": "S"}


def _zamba2_config(c: dict) -> ModelConfig:
    if c.get("hidden_act", "gelu") != "gelu" or c.get("add_bias_linear", False) or c.get("use_long_context", False):
        raise SSMQError(f"Zamba2 with hidden_act={c.get('hidden_act')!r}, add_bias_linear={c.get('add_bias_linear')}, "
                        f"use_long_context={c.get('use_long_context')} is not supported (only gelu, no biases, the "
                        "default context)")
    eps = c.get("rms_norm_eps", 1e-5)
    if eps != 1e-5:  # transformers' Mamba-2 gated norm keeps 1e-5 whatever the config says; ssmq's takes the config's
        raise SSMQError(f"Zamba2 with rms_norm_eps {eps} is not supported (only 1e-5)")
    n, d = c["num_hidden_layers"], c["hidden_size"]
    types = c.get("layers_block_type") or c.get("layer_types")
    kinds = [_ZAMBA_KINDS.get(t) for t in types or []]
    if len(kinds) != n or None in kinds:
        raise SSMQError(f"Zamba2 layers_block_type {types} not understood ({n} layers of mamba / hybrid)")
    d_inner, heads = int(c.get("mamba_expand", 2) * d), c["n_mamba_heads"]
    attn_heads = c["num_attention_heads"]
    head_dim = 2 * d // attn_heads  # the shared attention reads [stream | embeddings], 2·hidden_size
    if c.get("use_shared_attention_adapter", False) and (c.get("num_key_value_heads") or attn_heads) != attn_heads:
        raise SSMQError("Zamba2 with attention adapters and fewer KV heads than query heads is not supported (the "
                        "adapters' outputs are as wide as the queries)")
    rope = c.get("rope_parameters") or {}
    if c.get("use_mem_rope", False) and rope.get("rope_type", "default") != "default":
        raise SSMQError(f"RoPE type {rope.get('rope_type')!r} is not supported (only 'default')")
    return ModelConfig(
        arch="hybrid", family="zamba2", d_model=d, n_layer=n, vocab_size=c["vocab_size"],
        d_state=c.get("mamba_d_state", 64), d_conv=c.get("mamba_d_conv", 4), expand=c.get("mamba_expand", 2),
        ssm_d_inner=d_inner, headdim=d_inner // heads, ngroups=c.get("mamba_ngroups", 1),
        chunk_size=c.get("chunk_size", 256), dt_limit=(float(c.get("time_step_min", 0.001)), float("inf")),
        conv_bias=True, proj_bias=False, norm_eps=eps, residual_in_fp32=False,
        tie_embeddings=c.get("tie_word_embeddings", True), attn_heads=attn_heads,
        attn_kv_heads=c.get("num_key_value_heads") or attn_heads, attn_head_dim=head_dim,
        rotary_dim=head_dim if c.get("use_mem_rope", False) else 0, rope_theta=rope.get("rope_theta", 10000.0),
        max_position_embeddings=c.get("max_position_embeddings", 4096), attn_scale=(head_dim / 2) ** -0.5,
        mlp_hidden=c.get("intermediate_size") or 4 * d, mlp_act="gelu", mlp_layer_idx=(),
        shared_attn_layer_idx=tuple(i for i, k in enumerate(kinds) if k == "S"),
        # shared blocks that no layer uses are not stored
        shared_blocks=min(c.get("num_mem_blocks", 1), kinds.count("S")), shared_adapter_rank=c.get("adapter_rank", 128),
        shared_attn_adapters=c.get("use_shared_attention_adapter", False))


def _zamba2_to_ssmq(state: Tensors, cfg: ModelConfig) -> Tensors:
    uses = cfg.shared_attn_layer_idx
    out = {}
    for name, t in state.items():
        m = re.match(r"^model\.layers\.(\d+)\.shared_transformer\.(.*)$", name)
        if not m:
            out.update(_rename({name: t}, _ZAMBA_TO_SSMQ))
            continue
        j, rest = int(m.group(1)), m.group(2)
        if j not in uses:
            raise SSMQError(f"tensor {name}: layer {j} is not a hybrid layer of the config")
        b = uses.index(j) % cfg.shared_blocks  # a later use of a block may repeat its tensors: the first are kept
        a = re.match(r"^(?:self_attn\.linear_([qkv])_adapter_list|feed_forward\.gate_up_proj_adapter_list)\.(\d+)\."
                     r"([01])\.weight$", rest)
        if a:
            which, k, part = a.groups()
            if int(k) >= len(uses):
                raise SSMQError(f"tensor {name}: adapter {k} beyond the config's {len(uses)} hybrid layers")
            adapter = f"{which}_adapter" if which else "mlp_adapter"
            key = f"layers.{uses[int(k)]}.shared.{adapter}.{('down', 'up')[int(part)]}.weight"
        elif rest == "feed_forward.gate_up_proj.weight":  # (2f, d) = [gate | up]
            key = f"layers.{uses[b]}.shared.block.mlp.gate_proj.weight"
            out.setdefault(f"layers.{uses[b]}.shared.block.mlp.up_proj.weight", t.chunk(2, dim=0)[1])
            t = t.chunk(2, dim=0)[0]
        else:
            key = f"layers.{uses[b]}.shared.block." + _rename({rest: t}, _ZAMBA_SHARED).popitem()[0]
        out.setdefault(key, t)
    return out


_ZAMBA_TO_SSMQ = [(r"^model\.embed_tokens\.", "embedding."), (r"^model\.final_layernorm\.", "norm_f."),
                  (r"^model\.layers\.(\d+)\.(?:mamba_decoder\.)?input_layernorm\.", r"layers.\1.norm."),
                  (r"^model\.layers\.(\d+)\.(?:mamba_decoder\.)?mamba\.", r"layers.\1.mixer."),
                  (r"^model\.layers\.(\d+)\.linear\.", r"layers.\1.shared.linear.")]
# inside a shared transformer block: HF names -> ssmq's under layers.j.shared.block. (j its first use)
_ZAMBA_SHARED = [(r"^input_layernorm\.", "norm."), (r"^pre_ff_layernorm\.", "mlp_norm."), (r"^self_attn\.", "attn."),
                 (r"^feed_forward\.", "mlp.")]


def _zamba2_to_hf(state: Tensors, cfg: ModelConfig) -> Tensors:
    uses = cfg.shared_attn_layer_idx
    out, gate_up = {}, {}
    for name, t in state.items():
        m = re.match(r"^layers\.(\d+)\.shared\.block\.(.*)$", name)
        a = re.match(r"^layers\.(\d+)\.shared\.(q|k|v|mlp)_adapter\.(down|up)\.weight$", name)
        if m:
            p = f"model.layers.{m.group(1)}.shared_transformer."
            rest = m.group(2)
            g = re.match(r"^mlp\.(gate|up)_proj\.weight$", rest)
            if g:
                gate_up.setdefault(p, {})[g.group(1)] = t
                continue
            rules = [(r"^norm\.", "input_layernorm."), (r"^mlp_norm\.", "pre_ff_layernorm."),
                     (r"^attn\.", "self_attn."), (r"^mlp\.", "feed_forward.")]
            out[p + _rename({rest: t}, rules).popitem()[0]] = t
        elif a:
            j, which, part = int(a.group(1)), a.group(2), a.group(3)
            k = uses.index(j)
            lst = "feed_forward.gate_up_proj_adapter_list" if which == "mlp" else \
                f"self_attn.linear_{which}_adapter_list"
            out[f"model.layers.{uses[k % cfg.shared_blocks]}.shared_transformer.{lst}.{k}."
                f"{('down', 'up').index(part)}.weight"] = t
        else:
            m = re.match(r"^layers\.(\d+)\.(norm|mixer)\.(.*)$", name)
            if m:
                j, part, rest = int(m.group(1)), m.group(2), m.group(3)
                sub = "mamba_decoder." if j in uses else ""
                out[f"model.layers.{j}.{sub}{'input_layernorm' if part == 'norm' else 'mamba'}.{rest}"] = t
            else:
                rules = [(r"^embedding\.", "model.embed_tokens."), (r"^norm_f\.", "model.final_layernorm."),
                         (r"^layers\.(\d+)\.shared\.linear\.", r"model.layers.\1.linear.")]
                out.update(_rename({name: t}, rules))
    for p, parts in gate_up.items():
        out[p + "feed_forward.gate_up_proj.weight"] = torch.cat([parts["gate"], parts["up"]])
    return out


# ---------------------------------------------------------------- Falcon-H1

def _falcon_h1_config(c: dict) -> ModelConfig:
    if c.get("hidden_act", "silu") != "silu" or c.get("mlp_bias", False):
        raise SSMQError(f"Falcon-H1 with hidden_act={c.get('hidden_act')!r}, mlp_bias={c.get('mlp_bias')} is not "
                        "supported (only silu, MLPs without biases)")
    proj_bias = c.get("mamba_proj_bias", False)
    ssm_in = float(c.get("ssm_in_multiplier", 1.0))
    if proj_bias != c.get("projectors_bias", False) or proj_bias and ssm_in != 1.0:
        raise SSMQError("Falcon-H1 with mamba_proj_bias != projectors_bias, or with in_proj biases and an "
                        "ssm_in_multiplier, is not supported")
    d = c["hidden_size"]
    d_inner = c.get("mamba_d_ssm") or int(c.get("mamba_expand", 2) * d)
    heads = c["mamba_n_heads"]
    headdim = c.get("mamba_d_head", "auto")
    headdim = d_inner // heads if headdim == "auto" else headdim
    if heads * headdim != d_inner:
        raise SSMQError(f"Falcon-H1 mamba_n_heads {heads} x mamba_d_head {headdim} != mamba_d_ssm {d_inner}")
    norm = "none" if not c.get("mamba_rms_norm", False) else \
        "gated_before" if c.get("mamba_norm_before_gate", True) else "gated"
    lm_head = float(c.get("lm_head_multiplier", 1.0))
    return ModelConfig(
        arch="hybrid", family="falcon_h1", d_model=d, n_layer=c["num_hidden_layers"], vocab_size=c["vocab_size"],
        d_state=c.get("mamba_d_state", 256), d_conv=c.get("mamba_d_conv", 4), expand=c.get("mamba_expand", 2),
        ssm_d_inner=d_inner, headdim=headdim, ngroups=c.get("mamba_n_groups", 1),
        chunk_size=c.get("mamba_chunk_size", 256), dt_limit=dt_limit_from_json(c.get("time_step_limit")),
        conv_bias=c.get("mamba_conv_bias", True), proj_bias=proj_bias, norm_eps=c.get("rms_norm_eps", 1e-5),
        residual_in_fp32=False, tie_embeddings=c.get("tie_word_embeddings", False), attn_layer_idx=(),
        attn_bias=c.get("attention_bias", False), mlp_hidden=c["intermediate_size"], ssm_norm=norm,
        parallel_attn=True, embedding_multiplier=float(c.get("embedding_multiplier", 1.0)),
        logits_scaling=1.0 / lm_head, attn_in_multiplier=float(c.get("attention_in_multiplier", 1.0)),
        attn_out_multiplier=float(c.get("attention_out_multiplier", 1.0)),
        attn_key_multiplier=float(c.get("key_multiplier", 1.0)), ssm_in_multiplier=ssm_in,
        ssm_out_multiplier=float(c.get("ssm_out_multiplier", 1.0)),
        ssm_proj_multipliers=tuple(c.get("ssm_multipliers") or (1.0,) * 5),
        mlp_multipliers=tuple(c.get("mlp_multipliers") or (1.0, 1.0)), **_attention(c, rotary=True))


_FALCON_H1_TO_SSMQ = [(r"^model\.embed_tokens\.", "embedding."), (r"^model\.final_layernorm\.", "norm_f."),
                      (r"^model\.layers\.(\d+)\.input_layernorm\.", r"layers.\1.norm."),
                      (r"^model\.layers\.(\d+)\.pre_ff_layernorm\.", r"layers.\1.mlp_norm."),
                      (r"^model\.layers\.(\d+)\.mamba\.", r"layers.\1.mixer."),
                      (r"^model\.layers\.(\d+)\.self_attn\.", r"layers.\1.attn."),
                      (r"^model\.layers\.(\d+)\.feed_forward\.", r"layers.\1.mlp.")]
_FALCON_H1_TO_HF = [(r"^embedding\.", "model.embed_tokens."), (r"^norm_f\.", "model.final_layernorm."),
                    (r"^layers\.(\d+)\.norm\.", r"model.layers.\1.input_layernorm."),
                    (r"^layers\.(\d+)\.mlp_norm\.", r"model.layers.\1.pre_ff_layernorm."),
                    (r"^layers\.(\d+)\.mixer\.", r"model.layers.\1.mamba."),
                    (r"^layers\.(\d+)\.attn\.", r"model.layers.\1.self_attn."),
                    (r"^layers\.(\d+)\.mlp\.", r"model.layers.\1.feed_forward.")]


# ---------------------------------------------------------------- config.json writers

def _common_hf(cfg: ModelConfig, model_type: str, cls: str) -> dict:
    return {"model_type": model_type, "architectures": [cls], "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model, "tie_word_embeddings": cfg.tie_embeddings}


def _attention_hf(cfg: ModelConfig) -> dict:
    return {"num_attention_heads": cfg.attn_heads, "num_key_value_heads": cfg.attn_kv_heads,
            "head_dim": cfg.attn_head_dim, "max_position_embeddings": cfg.max_position_embeddings}


def _falcon_mamba_to_hf(cfg: ModelConfig) -> dict:
    return {**_common_hf(cfg, "falcon_mamba", "FalconMambaForCausalLM"), "num_hidden_layers": cfg.n_layer,
            "state_size": cfg.d_state, "conv_kernel": cfg.d_conv, "expand": cfg.expand,
            "intermediate_size": cfg.d_inner, "time_step_rank": cfg.dt_rank_, "use_conv_bias": cfg.conv_bias,
            "use_bias": cfg.proj_bias, "layer_norm_epsilon": cfg.norm_eps, "mixer_rms_eps": cfg.bcdt_norm_eps,
            "residual_in_fp32": cfg.residual_in_fp32}


def _nemotron_config_to_hf(cfg: ModelConfig) -> dict:
    pattern = layer_pattern(cfg)
    return {**_common_hf(cfg, "nemotron_h", "NemotronHForCausalLM"), "num_hidden_layers": len(pattern),
            "hybrid_override_pattern": pattern, "ssm_state_size": cfg.d_state, "mamba_num_heads": cfg.nheads,
            "mamba_head_dim": cfg.headdim, "n_groups": cfg.ngroups, "conv_kernel": cfg.d_conv, "expand": cfg.expand,
            "chunk_size": cfg.chunk_size, "time_step_min": cfg.dt_limit[0], "use_conv_bias": cfg.conv_bias,
            "use_bias": cfg.proj_bias, "layer_norm_epsilon": cfg.norm_eps, "residual_in_fp32": cfg.residual_in_fp32,
            "intermediate_size": cfg.mlp_hidden, "mlp_hidden_act": "relu2", "mlp_bias": False,
            "attention_bias": False, **(_attention_hf(cfg) if cfg.attn_layer_idx else {}),
            **({"n_routed_experts": cfg.moe_experts, "num_experts_per_tok": cfg.moe_top_k,
                "moe_intermediate_size": cfg.moe_hidden, "moe_shared_expert_intermediate_size": cfg.moe_shared_hidden,
                "n_shared_experts": 1, "n_group": cfg.moe_groups, "topk_group": cfg.moe_topk_groups,
                "norm_topk_prob": cfg.moe_norm_topk, "routed_scaling_factor": cfg.moe_scale}
               if cfg.moe_layer_idx else {})}


def _period(layers: tuple[int, ...], n: int, what: str) -> tuple[int, int]:
    """(period, offset) with layers = {i < n: i % period == offset}; SSMQError when there is none."""
    for period in range(1, n + 1):
        for offset in range(period):
            if tuple(i for i in range(n) if i % period == offset) == tuple(layers):
                return period, offset
    raise SSMQError(f"Jamba's config states {what} layers by a period and an offset; {list(layers)} has none")


def _jamba_config_to_hf(cfg: ModelConfig) -> dict:
    ap, ao = _period(cfg.attn_layer_idx, cfg.n_layer, "attention")
    ep, eo = _period(cfg.moe_layer_idx, cfg.n_layer, "expert") if cfg.moe_layer_idx else (1, 0)
    return {**_common_hf(cfg, "jamba", "JambaForCausalLM"), "num_hidden_layers": cfg.n_layer,
            "intermediate_size": cfg.mlp_hidden, "num_experts": cfg.moe_experts if cfg.moe_layer_idx else 1,
            "num_experts_per_tok": cfg.moe_top_k or 1, "expert_layer_period": ep, "expert_layer_offset": eo,
            "attn_layer_period": ap, "attn_layer_offset": ao, "mamba_d_state": cfg.d_state,
            "mamba_d_conv": cfg.d_conv, "mamba_expand": cfg.expand, "mamba_dt_rank": cfg.dt_rank_,
            "mamba_conv_bias": cfg.conv_bias, "mamba_proj_bias": cfg.proj_bias, "rms_norm_eps": cfg.norm_eps,
            "use_mamba_kernels": False, **_attention_hf(cfg)}


def _falcon_h1_config_to_hf(cfg: ModelConfig) -> dict:
    return {**_common_hf(cfg, "falcon_h1", "FalconH1ForCausalLM"), **_attention_hf(cfg),
            "num_hidden_layers": cfg.n_layer, "intermediate_size": cfg.mlp_hidden, "hidden_act": "silu",
            "mlp_bias": False, "attention_bias": cfg.attn_bias, "rms_norm_eps": cfg.norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta}, "mamba_d_ssm": cfg.d_inner,
            "mamba_n_heads": cfg.nheads, "mamba_d_head": cfg.headdim, "mamba_n_groups": cfg.ngroups,
            "mamba_d_state": cfg.d_state, "mamba_d_conv": cfg.d_conv, "mamba_expand": cfg.expand,
            "mamba_chunk_size": cfg.chunk_size, "mamba_conv_bias": cfg.conv_bias, "mamba_proj_bias": cfg.proj_bias,
            "projectors_bias": cfg.proj_bias, "mamba_rms_norm": cfg.ssm_norm != "none",
            "mamba_norm_before_gate": cfg.ssm_norm == "gated_before", "time_step_limit": list(cfg.dt_limit),
            "embedding_multiplier": cfg.embedding_multiplier, "lm_head_multiplier": 1.0 / cfg.logits_scaling,
            "attention_in_multiplier": cfg.attn_in_multiplier, "attention_out_multiplier": cfg.attn_out_multiplier,
            "key_multiplier": cfg.attn_key_multiplier, "ssm_in_multiplier": cfg.ssm_in_multiplier,
            "ssm_out_multiplier": cfg.ssm_out_multiplier,
            "ssm_multipliers": list(cfg.ssm_proj_multipliers or (1.0,) * 5),
            "mlp_multipliers": list(cfg.mlp_multipliers or (1.0, 1.0))}


FAMILIES = {f.model_type: f for f in [
    Family("falcon_mamba", "Falcon-Mamba", "FalconMambaForCausalLM", _falcon_mamba_config,
           lambda s, cfg: _rename(s, _BACKBONE_TO_SSMQ), lambda s, cfg: _rename(s, _BACKBONE_TO_HF),
           _falcon_mamba_to_hf),
    Family("nemotron_h", "Nemotron-H", "NemotronHForCausalLM", _nemotron_config, _nemotron_to_ssmq, _nemotron_to_hf,
           _nemotron_config_to_hf),
    Family("granitemoehybrid", "Granite-4.0-H", "GraniteMoeHybridForCausalLM", _granite_config, _granite_to_ssmq,
           _granite_to_hf),
    Family("jamba", "Jamba", "JambaForCausalLM", _jamba_config, lambda s, cfg: _rename(s, _JAMBA_TO_SSMQ),
           _jamba_to_hf, _jamba_config_to_hf),
    Family("zamba2", "Zamba2", "Zamba2ForCausalLM", _zamba2_config, _zamba2_to_ssmq, _zamba2_to_hf),
    Family("falcon_h1", "Falcon-H1", "FalconH1ForCausalLM", _falcon_h1_config,
           lambda s, cfg: _rename(s, _FALCON_H1_TO_SSMQ), lambda s, cfg: _rename(s, _FALCON_H1_TO_HF),
           _falcon_h1_config_to_hf),
]}


def family_of(cfg: ModelConfig) -> Family | None:
    return FAMILIES.get(cfg.family)


def name_to_hf(name: str, cfg: ModelConfig) -> str:
    """One ssmq tensor or module name -> the family's HF name (families whose tensors map name for name)."""
    return _one_name(FAMILIES[cfg.family].to_hf, name, cfg)


def name_to_ssmq(name: str, cfg: ModelConfig) -> str:
    """One HF tensor or module name of the family -> ssmq's."""
    return _one_name(FAMILIES[cfg.family].to_ssmq, name, cfg)


def _one_name(rename: Callable[[Tensors, ModelConfig], Tensors], name: str, cfg: ModelConfig) -> str:
    family = FAMILIES[cfg.family]
    if family.config_to_hf is None:
        raise SSMQError(f"{family.label}'s checkpoint tensors do not map name for name onto ssmq's (fused or stacked "
                        "in the checkpoint)")
    (out,) = rename({name: torch.empty(0)}, cfg)  # prefix rules: module paths map as their tensors do
    return out


def layer_pattern(cfg: ModelConfig) -> str:
    """One character per mixer and per feed-forward, in order: M Mamba, * attention, - MLP, E MoE
    (Nemotron-H's alphabet), e.g. 'M-M*-' or 'MEME*E'; and for attention beside a mixer, S a shared transformer
    block before it (Zamba2: 'MMSM'), P attention in parallel with Mamba-2 (Falcon-H1: 'P-P-')."""
    ffn = {"": "", "mlp": "-", "moe": "E"}
    shared = set(cfg.shared_attn_layer_idx)

    def mixer(i: int) -> str:
        if cfg.parallel_attn:
            return "P"
        return ("S" if i in shared else "") + ("*" if cfg.layer_kind(i) == "attention" else "M")

    return "".join(mixer(i) + ffn[cfg.ffn_kind(i)] for i in range(cfg.n_layer))


def describe(cfg: ModelConfig) -> str:
    """'Nemotron-H: M-M*-M-' — the family's name (or the architecture's) and its layer pattern."""
    f = family_of(cfg)
    return f"{f.label if f else cfg.arch}: {layer_pattern(cfg)}"
