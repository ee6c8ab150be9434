"""Checkpoint loading: the original ``mamba_ssm`` format and Hugging Face formats, auto-detected.

Formats (a folder with ``config.json`` and weights):
- mamba_ssm: config has ``d_model``, ``n_layer``, ``ssm_cfg``; weights ``pytorch_model.bin`` (or safetensors)
  named ``backbone.embedding.weight``, ``backbone.layers.N.mixer.*``, ``backbone.norm_f.weight``, ``lm_head.weight``.
- Hugging Face: ``model_type`` mamba (MambaForCausalLM), mamba2 (Mamba2ForCausalLM), bamba
  (BambaForCausalLM, the hybrid) or llama (LlamaForCausalLM, the hybrid with attention in every layer), and the
  families of ``ssmq.models.families`` (falcon_mamba, nemotron_h, granitemoehybrid, jamba, zamba2, falcon_h1);
  safetensors (sharded or not) or ``pytorch_model.bin``.
- GGUF: one ``.gguf`` file of a Llama model, read through transformers (``ssmq.models.gguf``).
- A packaged name (``ssmq.paths.PACKAGED``, e.g. ``smollm2-135m``) resolves to the file its pip package ships.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import torch

from ssmq.errors import SSMQError
from ssmq.models.config import ModelConfig, dt_limit_from_json
from ssmq.models.families import FAMILIES
from ssmq.models.gguf import is_gguf, read_gguf_config, read_gguf_state_dict
from ssmq.models.hf_layout import SSMQ_CONFIG_KEY
from ssmq.models.lm import SSMLM
from ssmq.paths import PACKAGED, read_json

HF_MODEL_TYPES = {"mamba": "mamba1", "mamba2": "mamba2", "bamba": "hybrid", "llama": "llama"}


# ---------------------------------------------------------------- configs

def _round_up(v: int, multiple: int) -> int:
    return v if multiple <= 1 else multiple * math.ceil(v / multiple)


_dt_limit = dt_limit_from_json


def config_from_mamba_ssm(c: dict) -> ModelConfig:
    ssm = dict(c.get("ssm_cfg") or {})
    layer = ssm.pop("layer", "Mamba1")
    if c.get("attn_layer_idx"):
        raise SSMQError("mamba_ssm-format hybrids (attn_layer_idx) are not supported; use a Hugging Face (Bamba) checkpoint")
    if not c.get("rms_norm", True):
        raise SSMQError("mamba_ssm checkpoints with LayerNorm (rms_norm: false) are not supported")
    vocab = _round_up(c["vocab_size"], c.get("pad_vocab_size_multiple", 8))
    common = dict(d_model=c["d_model"], n_layer=c["n_layer"], vocab_size=vocab,
                  d_conv=ssm.get("d_conv", 4), expand=ssm.get("expand", 2),
                  conv_bias=ssm.get("conv_bias", True), proj_bias=ssm.get("bias", False),
                  residual_in_fp32=c.get("residual_in_fp32", True), tie_embeddings=c.get("tie_embeddings", True))
    if layer == "Mamba1":
        rank = ssm.get("dt_rank", "auto")
        return ModelConfig(arch="mamba1", d_state=ssm.get("d_state", 16),
                           dt_rank=None if rank == "auto" else int(rank), **common)
    if layer == "Mamba2":
        ngroups = ssm.get("ngroups", 1)
        if ssm.get("norm_before_gate", False) or not ssm.get("rmsnorm", True):
            raise SSMQError("Mamba-2 with norm_before_gate=True or without the gated RMSNorm is not supported")
        return ModelConfig(arch="mamba2", d_state=ssm.get("d_state", 128), headdim=ssm.get("headdim", 64),
                           ngroups=ngroups, chunk_size=ssm.get("chunk_size", 256),
                           dt_limit=_dt_limit(ssm.get("dt_limit")), **common)
    raise SSMQError(f"unknown mamba_ssm layer type {layer!r} (supported: Mamba1, Mamba2)")


def config_from_hf(c: dict) -> ModelConfig:
    if c["model_type"] in FAMILIES:  # Falcon-Mamba, Nemotron-H, Granite-4.0-H, ... (ssmq.models.families)
        return FAMILIES[c["model_type"]].config(c)
    arch = HF_MODEL_TYPES[c["model_type"]]
    tie = c.get("tie_word_embeddings", True)
    if arch == "mamba1":
        return ModelConfig(arch="mamba1", d_model=c["hidden_size"], n_layer=c["num_hidden_layers"],
                           vocab_size=c["vocab_size"], d_state=c["state_size"], d_conv=c["conv_kernel"],
                           expand=c["expand"], dt_rank=c["time_step_rank"], conv_bias=c.get("use_conv_bias", True),
                           proj_bias=c.get("use_bias", False), norm_eps=c.get("layer_norm_epsilon", 1e-5),
                           residual_in_fp32=c.get("residual_in_fp32", True), tie_embeddings=tie)
    if arch == "mamba2":
        cfg = ModelConfig(arch="mamba2", d_model=c["hidden_size"], n_layer=c["num_hidden_layers"],
                          vocab_size=c["vocab_size"], d_state=c["state_size"], d_conv=c["conv_kernel"],
                          expand=c["expand"], headdim=c["head_dim"], ngroups=c["n_groups"],
                          chunk_size=c["chunk_size"], dt_limit=_dt_limit(c.get("time_step_limit")),
                          conv_bias=c.get("use_conv_bias", True), proj_bias=c.get("use_bias", False),
                          norm_eps=c.get("layer_norm_epsilon", 1e-5), residual_in_fp32=c.get("residual_in_fp32", True),
                          tie_embeddings=tie)
        cfg.norm_group_size = cfg.d_inner  # transformers normalises the gated norm over all of d_inner
        if c.get("num_heads", cfg.nheads) != cfg.nheads:
            raise SSMQError(f"config num_heads {c['num_heads']} != expand*hidden_size/head_dim = {cfg.nheads}")
        return cfg
    if arch == "llama":
        if c.get("hidden_act", "silu") != "silu" or c.get("mlp_bias", False):
            raise SSMQError(f"Llama with hidden_act={c.get('hidden_act')!r}, mlp_bias={c.get('mlp_bias')} is not "
                            "supported (only the SwiGLU MLP without biases)")
        return ModelConfig(arch="llama", d_model=c["hidden_size"], n_layer=c["num_hidden_layers"],
                           vocab_size=c["vocab_size"], norm_eps=c.get("rms_norm_eps", 1e-6), residual_in_fp32=False,
                           tie_embeddings=c.get("tie_word_embeddings", False), **_attention_fields(c))
    # Bamba hybrid
    cfg = ModelConfig(
        arch="hybrid", d_model=c["hidden_size"], n_layer=c["num_hidden_layers"], vocab_size=c["vocab_size"],
        d_state=c["mamba_d_state"], d_conv=c["mamba_d_conv"], expand=c["mamba_expand"], headdim=c["mamba_d_head"],
        ngroups=c["mamba_n_groups"], chunk_size=c["mamba_chunk_size"], dt_limit=_dt_limit(c.get("time_step_limit")),
        conv_bias=c.get("mamba_conv_bias", True), proj_bias=c.get("mamba_proj_bias", False),
        norm_eps=c.get("rms_norm_eps", 1e-5), residual_in_fp32=False, tie_embeddings=tie,
        attn_layer_idx=tuple(c.get("attn_layer_indices") or ()), **_attention_fields(c))
    cfg.norm_group_size = cfg.d_inner
    if c.get("mamba_n_heads", cfg.nheads) != cfg.nheads:
        raise SSMQError(f"config mamba_n_heads {c['mamba_n_heads']} != mamba_expand*hidden_size/mamba_d_head")
    return cfg


def _attention_fields(c: dict) -> dict:
    """The ModelConfig fields of the attention layers and MLPs, read the same way from Bamba and Llama configs
    (HF names: num_attention_heads, num_key_value_heads, head_dim, rope_parameters, attention_bias, ...)."""
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":  # llama3 / yarn / linear scaling change the frequencies: not implemented
        raise SSMQError(f"RoPE type {rope_type!r} is not supported (only 'default')")
    partial = rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    return dict(attn_heads=heads, attn_kv_heads=c.get("num_key_value_heads") or heads, attn_head_dim=head_dim,
                rotary_dim=int(head_dim * partial), rope_theta=rope.get("rope_theta", c.get("rope_theta", 10000.0)),
                attn_bias=c.get("attention_bias", False), mlp_hidden=c["intermediate_size"],
                max_position_embeddings=c.get("max_position_embeddings", 4096))


def detect_format(c: dict) -> str:
    """'mamba_ssm' or 'hf'; raises on anything else."""
    if "d_model" in c and "n_layer" in c:
        return "mamba_ssm"
    if c.get("model_type") in HF_MODEL_TYPES or c.get("model_type") in FAMILIES:
        return "hf"
    what = c.get("model_type") or ",".join(c.get("architectures") or []) or "no model_type"
    families = ", ".join(f.label for f in FAMILIES.values())
    raise SSMQError(f"unknown architecture ({what}); supported: Mamba-1, Mamba-2 (mamba_ssm or Hugging Face), "
                    f"Bamba-style hybrids, {families} and Llama (Hugging Face, or a Llama GGUF file)")


# ---------------------------------------------------------------- weight names

_HF_RENAMES = [  # (pattern, replacement), applied in order
    (r"^backbone\.embeddings\.", "embedding."),
    (r"^backbone\.embedding\.", "embedding."),
    (r"^backbone\.norm_f\.", "norm_f."),
    (r"^backbone\.layers\.", "layers."),
    (r"^model\.embed_tokens\.", "embedding."),
    (r"^model\.(final_layernorm|norm)\.", "norm_f."),  # Bamba | Llama
    (r"^model\.layers\.(\d+)\.input_layernorm\.", r"layers.\1.norm."),
    (r"^model\.layers\.(\d+)\.(pre_ff_layernorm|post_attention_layernorm)\.", r"layers.\1.mlp_norm."),
    (r"^model\.layers\.(\d+)\.(mamba|self_attn)\.", r"layers.\1.mixer."),
    (r"^model\.layers\.(\d+)\.(feed_forward|mlp)\.", r"layers.\1.mlp."),
    (r"\.mixer\.dt_proj\.bias$", ".mixer.dt_bias"),  # Mamba-1
]


def rename_to_ssmq(name: str) -> str:
    for pattern, repl in _HF_RENAMES:
        name = re.sub(pattern, repl, name)
    return name


# ---------------------------------------------------------------- files

def read_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder (safetensors, single or sharded index, or pytorch_model.bin) or of a
    GGUF file (dequantized to float32), under the checkpoint's names."""
    from safetensors.torch import load_file

    if is_gguf(folder):
        return read_gguf_state_dict(folder)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / s for s in shards]
    elif (folder / "model.safetensors").exists():
        files = [folder / "model.safetensors"]
    elif (folder / "pytorch_model.bin.index.json").exists():
        shards = sorted(set(json.loads((folder / "pytorch_model.bin.index.json").read_text())["weight_map"].values()))
        files = [folder / s for s in shards]
    elif (folder / "pytorch_model.bin").exists():
        files = [folder / "pytorch_model.bin"]
    else:
        raise SSMQError(f"no weights in {folder} (expected model.safetensors[.index.json] or pytorch_model.bin)")
    state = {}
    for f in files:
        if not f.exists():
            raise SSMQError(f"missing weight file {f}")
        try:
            part = load_file(str(f)) if f.suffix == ".safetensors" else torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # corrupt or truncated file
            raise SSMQError(f"cannot read weights from {f}: {type(e).__name__}: {str(e).splitlines()[0][:200]}") from None
        state.update(part)
    return state


def resolve_model_path(name_or_path: str | os.PathLike) -> Path:
    """A local folder or ``.gguf`` file as is; a packaged name (``smollm2-135m``) to the file its pip package
    ships; otherwise a hub id, downloaded (fails offline with one clear line)."""
    p = Path(name_or_path).expanduser()
    if p.exists():
        if not p.is_dir() and not is_gguf(p):
            raise SSMQError(f"--model must be a folder or a .gguf file, got file {p}")
        return p
    s = str(name_or_path)
    if s in PACKAGED:
        return PACKAGED[s].path()
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", s):
        raise SSMQError(f"model path {s} does not exist (nor is it a packaged model name: {', '.join(PACKAGED)})")
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(s, allow_patterns=["*.json", "*.safetensors", "*.bin", "*.txt"])
    except Exception as e:
        raise SSMQError(f"could not download {s} from the Hugging Face hub ({type(e).__name__}); "
                        "no network? pass a local folder instead, e.g. --model /path/to/model") from None
    return Path(local)


def load_config(folder: Path) -> tuple[ModelConfig, str]:
    """(config, format) of a checkpoint folder or GGUF file; format is 'mamba_ssm', 'hf' or 'gguf'."""
    raw = read_gguf_config(folder) if is_gguf(folder) else read_json(folder / "config.json", f"no config.json in {folder}")
    fmt = "gguf" if is_gguf(folder) else detect_format(raw)
    if fmt == "gguf" and raw.get("model_type") not in HF_MODEL_TYPES:
        raise SSMQError(f"{folder}: GGUF model type {raw.get('model_type')!r} is not supported (only llama)")
    try:
        if fmt == "hf" and SSMQ_CONFIG_KEY in raw:  # written by ssmq (export): exact, incl. what HF cannot say
            return ModelConfig.from_dict(raw[SSMQ_CONFIG_KEY]), fmt
        cfg = config_from_mamba_ssm(raw) if fmt == "mamba_ssm" else config_from_hf(raw)  # gguf: an HF dict
    except KeyError as e:
        raise SSMQError(f"config.json in {folder} lacks the field {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise SSMQError(f"config.json in {folder}: {SSMQ_CONFIG_KEY} is not a valid ssmq config ({e})") from None
    return cfg, fmt


def _is_compressed_tensors(folder: Path) -> bool:
    """config.json's quantization_config names compressed-tensors (``ssmq.quant.compressed_tensors`` loads it)."""
    f = folder / "config.json"
    qc = (read_json(f, f"unreadable {f}").get("quantization_config") or {}) if f.is_file() else {}
    return isinstance(qc, dict) and qc.get("quant_method") == "compressed-tensors"


def load_model(name_or_path: str | os.PathLike, dtype: torch.dtype = torch.float32, device="cpu") -> SSMLM:
    """Build an SSMLM from a checkpoint folder, GGUF file, packaged name or hub id; weights cast to ``dtype``
    on ``device``."""
    folder = resolve_model_path(name_or_path)
    if (folder / "quantization.json").exists() or _is_compressed_tensors(folder):
        # the models layer does not know quantized modules
        raise SSMQError(f"{folder} is a quantized checkpoint: load it with ssmq.load_model (ssmq.quant.load_model)")
    cfg, _ = load_config(folder)
    state = read_state_dict(folder)
    state = FAMILIES[cfg.family].to_ssmq(state, cfg) if cfg.family else {rename_to_ssmq(k): v for k, v in state.items()}
    with torch.device("meta"):
        model = SSMLM(cfg)
    load_weights(model, state, where=str(folder))
    return model.to(device=device, dtype=dtype)


def load_weights(model: SSMLM, state: dict[str, torch.Tensor], where: str = "checkpoint") -> None:
    """Assign tensors by name with shape checks; every parameter must be present (lm_head may be tied)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    if model.config.tie_embeddings:
        state.pop("lm_head.weight", None)
    unexpected = sorted(set(state) - set(params))
    if unexpected:
        raise SSMQError(f"{where}: unexpected tensors {unexpected[:3]}{' ...' if len(unexpected) > 3 else ''} "
                        "(architecture mismatch?)")
    missing = sorted(k for k in params if k not in state and not (k == "lm_head.weight" and model.config.tie_embeddings))
    if missing:
        raise SSMQError(f"{where}: missing tensors {missing[:3]}{' ...' if len(missing) > 3 else ''}")
    for name, p in params.items():
        if name == "lm_head.weight" and model.config.tie_embeddings:
            continue
        t = state[name]
        if tuple(t.shape) != tuple(p.shape):
            raise SSMQError(f"{where}: shape mismatch for {name}: checkpoint {tuple(t.shape)} vs model {tuple(p.shape)}")
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        setattr(module, attr, torch.nn.Parameter(t.float(), requires_grad=False))
    if model.config.tie_embeddings and isinstance(model.lm_head, torch.nn.Linear):  # not a quantized head
        model.lm_head.weight = model.embedding.weight
