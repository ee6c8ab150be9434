"""ModelConfig: one dataclass describing Mamba-1, Mamba-2, hybrid (Mamba-2 + attention) and Llama LMs."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from ssmq.ops import layout
from ssmq.ops.layout import LayerKind, Segments

ARCHS = ("mamba1", "mamba2", "hybrid", "llama")
ATTENTION_ARCHS = ("hybrid", "llama")  # architectures with attention layers and MLPs


def dt_limit_from_json(raw) -> tuple[float, float]:
    """A config.json's Δ limit, [lo, hi] with hi a number or transformers' {"__float__": "Infinity"}; None: none."""
    if raw is None:
        return (0.0, math.inf)
    lo, hi = raw
    hi = float(hi["__float__"]) if isinstance(hi, dict) else float(hi)
    return (float(lo), hi)


@dataclass
class ModelConfig:
    """Architecture of an SSM language model (the vocabulary size is the padded embedding size).

    Mamba-2 / hybrid SSM layers: d_inner = expand · d_model = nheads · headdim.
    Hybrid: layers listed in ``attn_layer_idx`` are attention, the rest Mamba-2;
    every hybrid layer has a gated MLP when ``mlp_hidden > 0``.
    Llama: the degenerate hybrid — every layer attention (``attn_layer_idx`` is set to all of them; the SSM
    fields are unused), full RoPE (``rotary_dim = attn_head_dim``), GQA, SwiGLU MLP, RMSNorm.
    The families of ``ssmq.models.families`` are these architectures with more fields set: which blocks have a
    feed-forward and of which kind (``ffn_kind``: gated or squared-ReLU MLP, mixture of experts), Mamba-1 hybrids
    (``hybrid_ssm``), norms on Mamba-1's Δ/B/C, scalar multipliers.
    """

    arch: str
    d_model: int
    n_layer: int
    vocab_size: int
    d_state: int = 16
    d_conv: int = 4
    expand: int = 2
    dt_rank: int | None = None  # Mamba-1 only; None means ceil(d_model / 16)
    headdim: int = 64  # Mamba-2
    ngroups: int = 1  # Mamba-2
    chunk_size: int = 256  # Mamba-2
    norm_group_size: int | None = None  # gated-norm group; None = d_inner // ngroups (mamba_ssm)
    dt_limit: tuple[float, float] = (0.0, math.inf)
    conv_bias: bool = True
    proj_bias: bool = False
    norm_eps: float = 1e-5
    residual_in_fp32: bool = True
    tie_embeddings: bool = True
    # attention layers of hybrids
    attn_layer_idx: tuple[int, ...] = field(default_factory=tuple)
    attn_heads: int = 0
    attn_kv_heads: int = 0
    attn_head_dim: int = 0
    rotary_dim: int = 0
    rope_theta: float = 10000.0
    attn_bias: bool = False
    mlp_hidden: int = 0
    max_position_embeddings: int = 4096
    # the families beyond Bamba / Llama (``ssmq.models.families`` reads their HF configs into these fields)
    hybrid_ssm: str = "mamba2"  # the SSM layers of a hybrid: "mamba2" (Bamba and most) | "mamba1" (Jamba)
    family: str = ""  # the checkpoint family (HF model_type) when it is not one of the four base architectures
    ssm_d_inner: int = 0  # SSM inner width when it is not expand · d_model (0: expand · d_model)
    bcdt_norm: str = ""  # Mamba-1: RMSNorm on x_proj's Δ, B, C: "weightless" (Falcon-Mamba) | "weighted" (Jamba)
    bcdt_norm_eps: float = 1e-6
    mlp_layer_idx: tuple[int, ...] | None = None  # blocks with a feed-forward (None: every block, as Bamba/Llama)
    mlp_act: str = "silu"  # "silu": gated SwiGLU (gate, up, down); "gelu": gated GELU; "relu2": down(relu(up(x))²)
    moe_layer_idx: tuple[int, ...] = field(default_factory=tuple)  # blocks whose feed-forward is a MoE
    moe_experts: int = 0
    moe_top_k: int = 0
    moe_hidden: int = 0
    moe_routing: str = "topk_softmax"  # softmax over the top-k logits | "softmax_topk": top-k of the softmax |
    # "sigmoid_group": sigmoid scores + a correction bias, top-k among the best moe_topk_groups of moe_groups
    # groups, weights normalised (moe_norm_topk) and scaled by moe_scale (Nemotron-H)
    moe_groups: int = 1
    moe_topk_groups: int = 1
    moe_norm_topk: bool = True
    moe_scale: float = 1.0
    moe_act: str = "silu"  # the experts: "silu" gated MLPs | "relu2" squared-ReLU MLPs (as mlp_act)
    moe_shared: bool = False  # a MoE block also runs an always-on expert on every token (Granite, Nemotron-H)
    moe_shared_hidden: int = 0  # its hidden size (0: mlp_hidden)
    embedding_multiplier: float = 1.0  # embeddings scaled by it (Granite)
    residual_multiplier: float = 1.0  # each mixer / feed-forward output scaled by it before the residual add
    logits_scaling: float = 1.0  # logits divided by it
    attn_scale: float = 0.0  # attention softmax scale; 0: 1 / sqrt(attn_head_dim)
    # attention beside a block's mixer (``side_attention_layers``), each with a KV cache of its own:
    # Zamba2: before the Mamba-2 mixer of the blocks in shared_attn_layer_idx, one of shared_blocks transformer blocks
    # (weights stored once, used in turn), fed [stream | embeddings] (2·d_model), with per-use LoRA adapters of rank
    # shared_adapter_rank (on the MLP's [gate | up]; on q, k, v too with shared_attn_adapters); its output, through a
    # per-use linear, is added to the mixer's input only (not to the residual stream)
    shared_attn_layer_idx: tuple[int, ...] = field(default_factory=tuple)
    shared_blocks: int = 0
    shared_adapter_rank: int = 0
    shared_attn_adapters: bool = False
    # Falcon-H1: attention in parallel with the Mamba-2 mixer of every block, reading the same normed input
    parallel_attn: bool = False
    # µP-style scalars (Falcon-H1): attention input / output / keys, the Mamba-2 mixer's input and output, its
    # in_proj output per segment (z, x, B, C, Δ), the MLP's gate and down outputs ((): all 1)
    attn_in_multiplier: float = 1.0
    attn_out_multiplier: float = 1.0
    attn_key_multiplier: float = 1.0
    ssm_in_multiplier: float = 1.0
    ssm_out_multiplier: float = 1.0
    ssm_proj_multipliers: tuple[float, ...] = field(default_factory=tuple)
    mlp_multipliers: tuple[float, ...] = field(default_factory=tuple)
    # the Mamba-2 output norm: "gated" norm(y · silu(z)) · w | "gated_before" norm(y) · w · silu(z) |
    # "none" y · silu(z)
    ssm_norm: str = "gated"

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise ValueError(f"unknown architecture {self.arch!r}; expected one of {', '.join(ARCHS)}")
        self.attn_layer_idx = tuple(int(i) for i in self.attn_layer_idx)
        self.moe_layer_idx = tuple(int(i) for i in self.moe_layer_idx)
        if self.mlp_layer_idx is not None:
            self.mlp_layer_idx = tuple(int(i) for i in self.mlp_layer_idx)
        self.shared_attn_layer_idx = tuple(int(i) for i in self.shared_attn_layer_idx)
        self.ssm_proj_multipliers = tuple(float(m) for m in self.ssm_proj_multipliers)
        self.mlp_multipliers = tuple(float(m) for m in self.mlp_multipliers)
        if self.ssm_norm not in ("gated", "gated_before", "none") or len(self.ssm_proj_multipliers) not in (0, 5) \
                or len(self.mlp_multipliers) not in (0, 2):
            raise ValueError(f"unknown ssm_norm {self.ssm_norm!r}, or multipliers of other lengths than 5 (Mamba-2 "
                             f"in_proj) and 2 (MLP): {self.ssm_proj_multipliers}, {self.mlp_multipliers}")
        if self.shared_attn_layer_idx and self.shared_blocks < 1:
            raise ValueError("shared attention layers need shared_blocks >= 1")
        if self.mlp_act not in ("silu", "gelu", "relu2") or self.bcdt_norm not in ("", "weightless", "weighted"):
            raise ValueError(f"unknown mlp_act {self.mlp_act!r} or bcdt_norm {self.bcdt_norm!r}")
        if self.moe_layer_idx and not (0 < self.moe_top_k <= self.moe_experts and self.moe_hidden > 0):
            raise ValueError(f"MoE blocks need 0 < top_k {self.moe_top_k} <= experts {self.moe_experts} and a hidden "
                             f"size ({self.moe_hidden})")
        if self.hybrid_ssm not in ("mamba1", "mamba2"):
            raise ValueError(f"unknown hybrid_ssm {self.hybrid_ssm!r}")
        if self.moe_act not in ("silu", "relu2") or self.moe_layer_idx and self.moe_experts % self.moe_groups:
            raise ValueError(f"unknown moe_act {self.moe_act!r}, or {self.moe_experts} experts in {self.moe_groups} "
                             "groups")
        if self.moe_routing not in ("topk_softmax", "softmax_topk", "sigmoid_group"):
            raise ValueError(f"unknown moe_routing {self.moe_routing!r}")
        if self.arch == "llama":  # every layer attention: one source of truth for layer_kind and the cache
            if self.attn_layer_idx and self.attn_layer_idx != tuple(range(self.n_layer)):
                raise ValueError(f"a llama model has attention in every layer, not only {list(self.attn_layer_idx)}")
            self.attn_layer_idx = tuple(range(self.n_layer))
        self.dt_limit = (float(self.dt_limit[0]), float(self.dt_limit[1]))
        if self.ssm_layers():  # the SSM layout is checked only where there are SSM layers
            if self.ssm_kind is LayerKind.MAMBA2 and self.d_inner % self.headdim:
                raise ValueError(f"d_inner {self.d_inner} is not a multiple of headdim {self.headdim}")
            if self.ssm_kind is LayerKind.MAMBA2:
                layout.heads_per_group(self.nheads, self.ngroups)
        if self.attn_layer_idx and self.attn_heads % max(self.attn_kv_heads, 1):
            raise ValueError(f"attention heads {self.attn_heads} not a multiple of kv heads {self.attn_kv_heads}")

    @property
    def d_inner(self) -> int:
        return self.ssm_d_inner or self.expand * self.d_model

    @property
    def nheads(self) -> int:
        return self.d_inner // self.headdim

    @property
    def dt_rank_(self) -> int:
        return self.dt_rank if self.dt_rank is not None else math.ceil(self.d_model / 16)

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: x only for Mamba-1, [x, B, C] for Mamba-2."""
        return self.conv_segments().total

    @property
    def ssm_kind(self) -> LayerKind:
        """The kind of this model's SSM layers (hybrids: Mamba-2 unless ``hybrid_ssm`` says Mamba-1)."""
        mamba1 = self.arch == "mamba1" or self.arch == "hybrid" and self.hybrid_ssm == "mamba1"
        return LayerKind.MAMBA1 if mamba1 else LayerKind.MAMBA2

    @property
    def has_mlp(self) -> bool:
        """Blocks have a gated MLP after their mixer (hybrid and llama, when ``mlp_hidden > 0``: every block, or those
        of ``mlp_layer_idx``; a MoE block's always-on expert when ``moe_shared``)."""
        return self.arch in ATTENTION_ARCHS and self.mlp_hidden > 0

    def ffn_kind(self, i: int) -> str:
        """The feed-forward after block i's mixer: "moe", "mlp" or "" (none)."""
        if i in self.moe_layer_idx:
            return "moe"
        if self.has_mlp and (self.mlp_layer_idx is None or i in self.mlp_layer_idx):
            return "mlp"
        return ""

    def layer_kind(self, i: int) -> LayerKind:
        if self.arch != "mamba1" and i in self.attn_layer_idx:
            return LayerKind.ATTENTION
        return self.ssm_kind

    def ssm_layers(self) -> list[int]:
        """Indices of the Mamba layers."""
        return [i for i in range(self.n_layer) if self.layer_kind(i).is_ssm]

    def attention_layers(self) -> list[int]:
        """Blocks with attention, each with its KV cache: the mixer, or attention beside it
        (``side_attention_layers``)."""
        side = set(self.side_attention_layers())
        return [i for i in range(self.n_layer) if self.layer_kind(i) is LayerKind.ATTENTION or i in side]

    def side_attention_layers(self) -> list[int]:
        """Blocks that run attention beside their mixer (Falcon-H1's parallel attention, Zamba2's shared blocks);
        the k-th keeps its KV cache in the cache's state n_layer + k."""
        if self.parallel_attn:
            return list(range(self.n_layer))
        return list(self.shared_attn_layer_idx)

    # the layouts of ``ssmq.ops.layout`` at this model's sizes
    def in_proj_segments(self) -> Segments:
        """Mamba-1 [x | z]; Mamba-2 [z | x | B | C | dt]."""
        if self.ssm_kind is LayerKind.MAMBA1:
            return layout.mamba1_in_proj_segments(self.d_inner)
        return layout.mamba2_in_proj_segments(self.d_inner, self.ngroups, self.d_state, self.nheads)

    def conv_segments(self) -> Segments:
        """Mamba-1 [x]; Mamba-2 [x | B | C]."""
        if self.ssm_kind is LayerKind.MAMBA1:
            return layout.mamba1_conv_segments(self.d_inner)
        return layout.mamba2_conv_segments(self.d_inner, self.ngroups, self.d_state)

    def x_proj_segments(self) -> Segments:
        """Mamba-1 only: [dt | B | C]."""
        return layout.mamba1_x_proj_segments(self.dt_rank_, self.d_state)

    @property
    def heads_per_group(self) -> int:
        return layout.heads_per_group(self.nheads, self.ngroups)

    @property
    def norm_group(self) -> int:
        """Channels per gated-RMSNorm group (Mamba-2)."""
        return layout.norm_group_size(self.d_inner, self.ngroups, self.norm_group_size)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["dt_limit"] = [d["dt_limit"][0], "inf" if math.isinf(d["dt_limit"][1]) else d["dt_limit"][1]]
        d["attn_layer_idx"] = list(self.attn_layer_idx)
        d["moe_layer_idx"] = list(self.moe_layer_idx)
        for key in ("shared_attn_layer_idx", "ssm_proj_multipliers", "mlp_multipliers"):
            d[key] = list(getattr(self, key))
        if self.mlp_layer_idx is not None:
            d["mlp_layer_idx"] = list(self.mlp_layer_idx)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        d = dict(d)
        if "dt_limit" in d:
            d["dt_limit"] = tuple(float(v) for v in d["dt_limit"])
        return cls(**d)
