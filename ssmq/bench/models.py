"""The models a benchmark runs: a published architecture with random weights (speed does not depend on the
values), or a checkpoint; optionally quantized by a recipe; and peers (``mamba_ssm`` for Mamba-1 and Mamba-2,
transformers for the families of ``ssmq.models.families``) when they are installed."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import weakref

import torch

from ssmq.errors import SSMQError

FLOAT = "float"  # the unquantized model, in --dtype


def device_and_dtype(device: str | None, dtype: str | None) -> tuple[torch.device, torch.dtype]:
    """--device (default cuda when available) and --dtype (default bfloat16 on CUDA, float32 on the CPU, as every
    command)."""
    from ssmq.runtime.model_args import DTYPES

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SSMQError(f"--device {dev} asked for, but CUDA is not available on this machine")
    name = DTYPES[dtype] if dtype else ("bfloat16" if dev.type == "cuda" else "float32")
    return dev, getattr(torch, name)


def published_config(name: str, layers: int | None = None):
    """The config of a published architecture, optionally cut to its first ``layers`` layers; None if unknown."""
    from ssmq.models.published import PUBLISHED

    cfg = PUBLISHED.get(name)
    if cfg is None or layers is None:
        return cfg
    if layers < 1:
        raise SSMQError(f"--layers must be >= 1, got {layers}")
    attn = tuple(i for i in (cfg.attn_layer_idx or ()) if i < layers)
    shared = tuple(i for i in cfg.shared_attn_layer_idx if i < layers)  # Zamba2's uses of its shared blocks
    cut = dataclasses.replace(cfg, n_layer=layers, shared_attn_layer_idx=shared,
                              shared_blocks=min(cfg.shared_blocks, len(shared)))
    return dataclasses.replace(cut, attn_layer_idx=attn) if cfg.attn_layer_idx else cut


def _init_random(name: str, p: torch.Tensor) -> None:
    """Trained-looking random values for the parameter at path ``name``: A = -[1..16], Δ biases of softplus⁻¹
    [1e-3, 1e-1], unit norms and D, N(0, 0.02) elsewhere."""
    if name.endswith("A_log"):
        p.copy_(torch.log(torch.empty_like(p).uniform_(1, 16)))
    elif name.endswith("dt_bias") or name.endswith("dt_proj.bias"):
        dt = torch.exp(torch.empty_like(p).uniform_(math.log(1e-3), math.log(1e-1)))
        p.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
    elif name.endswith(".D") or "norm" in name:
        p.fill_(1.0)
    else:
        p.normal_(0, 0.02)


def _units(model) -> list[tuple[str, torch.nn.Module]]:
    """The model's top-level parts in order, each block of ``layers`` one part: (path, module)."""
    out = []
    for name, child in model.named_children():
        out += ([(f"{name}.{i}", m) for i, m in enumerate(child)] if isinstance(child, torch.nn.ModuleList)
                else [(name, child)])
    return out


@torch.no_grad()
def random_model(cfg, device: torch.device, dtype: torch.dtype, seed: int = 0, recipe=None):
    """An SSMLM of ``cfg`` with random weights, made directly on ``device``; quantized by ``recipe`` (a linears-only
    one, ``quant.api.linears_only``) part by part as it is made, so that the float model is never whole in memory:
    Jamba-Mini's float16 weights (104 GB) exceed an 80 GB GPU, its FP8 or int4 ones do not. The same values as
    making the float model whole and then quantizing it: the parts draw their random values in the same order."""
    from ssmq.models.lm import SSMLM
    from ssmq.quant.api import check, quantization_record, quantize_linears_under

    torch.manual_seed(seed)
    with torch.device("meta"):
        model = SSMLM(cfg)
    if recipe is not None:
        check(recipe, model)
    # parameters shared between parts (Zamba2's shared blocks) are drawn once; weakly held, so that the float
    # weights a quantized part lets go are freed, and their entries with them (a new tensor may reuse their id)
    seen = weakref.WeakValueDictionary()
    for path, part in _units(model):
        part._apply(lambda t: torch.empty_like(t, device=device, dtype=dtype if t.is_floating_point() else t.dtype)
                    if t.is_meta else t)
        for name, p in part.named_parameters(prefix=path):
            if id(p) not in seen:
                seen[id(p)] = p
                _init_random(name, p)
        if path == "lm_head" and cfg.tie_embeddings:
            model.lm_head.weight = model.embedding.weight
        if recipe is not None:
            quantize_linears_under(model, recipe, path)
    if recipe is not None:
        model.quantization = quantization_record(recipe)
    return model.eval()


def rtn_weights(recipe):
    """``recipe`` with its GPTQ weights rounded to nearest: the same stored format and kernels, no GPTQ solve
    (speed only)."""
    from ssmq.quant.recipe import Recipe

    d = recipe.to_dict()
    for rule in d.get("linears", []):
        if rule.get("weight", {}).get("method") == "gptq":
            rule["weight"]["method"] = "rtn"
    return Recipe.from_dict(d)


def build(model_name, recipe: str, device: torch.device, dtype: torch.dtype, layers: int | None = None,
          gptq_as_rtn: bool = False, calib_samples: int = 4, calib_seqlen: int = 256):
    """(model, vocab size): ``model_name`` as a published architecture or a ``ModelConfig`` (random weights), or a
    checkpoint, quantized by ``recipe`` unless it is ``fp16``. Calibration (when the recipe needs it) runs on random
    tokens: speed only."""
    from ssmq.models.config import ModelConfig
    from ssmq.quant import get_recipe, quantize
    from ssmq.quant.api import linears_only
    from ssmq.quant.calibration import CalibrationData

    cfg = model_name if isinstance(model_name, ModelConfig) else published_config(model_name, layers)
    spec = None if recipe == FLOAT else get_recipe(recipe)
    if spec is not None and gptq_as_rtn:
        spec = rtn_weights(spec)
    if cfg is not None and spec is not None and linears_only(spec):
        return random_model(cfg, device, dtype, recipe=spec), cfg.vocab_size
    if cfg is not None:
        model = random_model(cfg, device, dtype)
    else:
        from ssmq.models.loading import resolve_model_path
        from ssmq.quant import load_model

        if layers is not None:
            raise SSMQError("--layers applies to published architectures only")
        model = load_model(resolve_model_path(model_name), dtype=dtype, device=str(device)).eval()
    vocab = model.config.vocab_size
    if spec is None:
        return model, vocab
    calib = None
    if spec.needs_calibration():
        gen = torch.Generator().manual_seed(0)
        calib = CalibrationData(torch.randint(0, min(vocab, 50000), (calib_samples, calib_seqlen), generator=gen),
                                source="random tokens", seed=0)
    quantize(model, spec, calib, progress=False)
    return model, vocab


# ---------------------------------------------------------------------------------------------------- peers

def mamba_ssm_available() -> bool:
    return importlib.util.find_spec("mamba_ssm") is not None


def mamba_ssm_model(cfg, device: torch.device, dtype: torch.dtype):
    """mamba_ssm's MambaLMHeadModel of the same architecture (random weights)."""
    from mamba_ssm.models.config_mamba import MambaConfig
    from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel

    ssm_cfg = {"layer": "Mamba1"} if cfg.arch == "mamba1" else {
        "layer": "Mamba2", "headdim": cfg.headdim, "ngroups": cfg.ngroups, "chunk_size": cfg.chunk_size,
        "use_mem_eff_path": False}
    ssm_cfg["d_state"] = cfg.d_state
    mc = MambaConfig(d_model=cfg.d_model, n_layer=cfg.n_layer, vocab_size=cfg.vocab_size, ssm_cfg=ssm_cfg,
                     rms_norm=True, residual_in_fp32=True, fused_add_norm=True, pad_vocab_size_multiple=16,
                     tie_embeddings=True)
    return MambaLMHeadModel(mc, device=device, dtype=dtype).eval()


def transformers_available() -> bool:
    return importlib.util.find_spec("transformers") is not None


def transformers_model(name: str, device: torch.device, dtype: torch.dtype):
    """The transformers model (its ``AutoModelForCausalLM`` class, random weights) of the published family
    architecture ``name``, from the same config.json fields ssmq's config is read from; None for an architecture
    that is not one of ``ssmq.models.published.PUBLISHED_HF``."""
    from ssmq.models.published import PUBLISHED_HF

    if name not in PUBLISHED_HF:
        return None
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, fields = PUBLISHED_HF[name]
    cfg = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()
