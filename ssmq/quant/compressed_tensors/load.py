"""compressed-tensors HF folder (llm-compressor's output, or ``ssmq export``'s) -> SSMLM with QuantLinears.

The float skeleton comes from the HF config (``models.loading``); every module whose tensors are
compressed (``weight_packed`` or ``weight_scale`` beside it) becomes a QuantLinear holding the
stored codes as they are (unpacked bits straight into ssmq's layout, no float detour), so it runs
on ssmq's quantized kernels. Schemes ssmq has no kernel for are refused with one line.
"""

from __future__ import annotations

import json
import os
from functools import partial
from pathlib import Path

import torch
import torch.nn as nn

from ssmq.errors import SSMQError
from ssmq.paths import read_json
from ssmq.quant.compressed_tensors.schemes import quant_linear_from, require_library

QUANT_METHOD = "compressed-tensors"
SUPPORTED_FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized", "mixed-precision")
_COMPRESSED_KEYS = ("weight_packed", "weight_scale")


def is_compressed_tensors(folder: str | os.PathLike) -> bool:
    """True when ``folder/config.json`` says quant_method compressed-tensors."""
    f = Path(folder) / "config.json"
    if not f.is_file():
        return False
    qc = read_json(f, f"unreadable {f}").get("quantization_config") or {}
    return isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD


def read_quantization_config(raw: dict, where: str):
    """compressed-tensors' QuantizationConfig of config.json, after the refusals of what ssmq cannot run."""
    from compressed_tensors.quantization import QuantizationConfig

    qc = dict(raw["quantization_config"])
    if qc.get("sparsity_config"):
        fmt = qc["sparsity_config"].get("format", "sparse")
        raise SSMQError(f"{where}: sparse checkpoints ({fmt}, e.g. 2:4 sparsity) are not supported; "
                        "ssmq runs dense quantized weights only")
    if qc.get("transform_config"):
        raise SSMQError(f"{where}: online transforms (transform_config, e.g. SpinQuant/QuIP Hadamards) "
                        "are not supported when loading compressed-tensors checkpoints")
    if qc.get("kv_cache_scheme"):
        raise SSMQError(f"{where}: KV-cache quantization (kv_cache_scheme) is not supported")
    fmt = qc.get("format")
    if fmt not in SUPPORTED_FORMATS:
        raise SSMQError(f"{where}: compressed-tensors format {fmt!r} is not supported "
                        f"(supported: {', '.join(SUPPORTED_FORMATS)})")
    try:
        config = QuantizationConfig.model_validate(qc)
    except Exception as e:  # pydantic's ValidationError, or the library's own ValueError
        raise SSMQError(f"{where}: invalid quantization_config: {str(e).splitlines()[0][:200]}") from None
    for name, scheme in config.config_groups.items():
        if scheme.format is not None and scheme.format not in SUPPORTED_FORMATS:
            raise SSMQError(f"{where}: config group {name} has format {scheme.format!r}, not supported "
                            f"(supported: {', '.join(SUPPORTED_FORMATS[:-1])})")
    return config


def _scheme_for(name: str, config, where: str):
    """The scheme compressed-tensors itself would pick: exact name, then regex, then class target."""
    from compressed_tensors.utils.match import match_targets

    target_to_scheme = {t: scheme for scheme in config.config_groups.values() for t in scheme.targets}
    probe = torch.nn.Linear(1, 1, device="meta")  # class targets ("Linear") match any linear
    matched = match_targets(name, probe, target_to_scheme)
    if not matched:
        raise SSMQError(f"{where}: {name} holds compressed tensors but no config group targets it")
    return target_to_scheme[matched[0]]


def _cast_floats(model: nn.Module, dtype: torch.dtype) -> None:
    """Float parameters to ``dtype``; QuantLinear codes and scales (buffers) stay as stored (float32)."""
    for m in model.modules():
        for key, p in list(m._parameters.items()):
            if p is not None and p.dtype.is_floating_point and p.dtype != dtype:
                m._parameters[key] = nn.Parameter(p.data.to(dtype), requires_grad=False)


@torch.no_grad()
def load_compressed_tensors(folder: str | os.PathLike, dtype: torch.dtype = torch.float32,
                            device="cpu") -> nn.Module:
    """Build an SSMLM of a compressed-tensors checkpoint folder (Mamba-1, Mamba-2, Bamba hybrid, Llama, and the
    families of ``ssmq.models.families`` whose tensors map name for name)."""
    from ssmq.models.lm import SSMLM
    from ssmq.models.loading import load_config, load_weights, read_state_dict, rename_to_ssmq

    require_library()
    folder = Path(folder)
    where = str(folder)
    raw = read_json(folder / "config.json", f"no config.json in {folder}")
    config = read_quantization_config(raw, where)
    cfg, _ = load_config(folder)
    state = read_state_dict(folder)
    prefixes = sorted({k.rpartition(".")[0] for k in state if k.rpartition(".")[2] in _COMPRESSED_KEYS})
    if not prefixes:
        raise SSMQError(f"{where}: config.json says compressed-tensors but no tensor is compressed")
    with torch.device("meta"):
        model = SSMLM(cfg)
    rules: dict[str, list[str]] = {}  # (weight, act) specs -> module paths
    rename = rename_to_ssmq
    if cfg.family:  # the family's names (ssmq.models.families), one for one
        from ssmq.models.families import name_to_ssmq

        rename = partial(name_to_ssmq, cfg=cfg)
    for prefix in prefixes:
        path = rename(prefix + ".weight").removesuffix(".weight")
        try:
            target = model.get_submodule(path)
        except AttributeError:
            raise SSMQError(f"{where}: compressed tensors for {prefix}, which this {cfg.arch} model does not "
                            "have (architecture mismatch?)") from None
        if not isinstance(target, nn.Linear):
            raise SSMQError(f"{where}: {prefix} is a quantized {type(target).__name__}; ssmq loads quantized "
                            "linear layers only from compressed-tensors checkpoints")
        local = {k[len(prefix) + 1:]: state.pop(k) for k in list(state)
                 if k.startswith(prefix + ".") and "." not in k[len(prefix) + 1:] and not k.endswith(".bias")}
        q = quant_linear_from(local, _scheme_for(prefix, config, where), target.in_features, target.out_features,
                              target.bias is not None, f"{where}: {prefix}")
        parent, _, attr = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, q)
        rules.setdefault(json.dumps([q.wspec.to_dict(), q.act and q.act.to_dict()], sort_keys=True), []).append(path)
    # biases (and Mamba-1's dt_proj.bias = dt_bias) and the float tensors load as for any HF folder
    load_weights(model, {rename(k): v for k, v in state.items()}, where=where)
    _cast_floats(model, dtype)
    model.quantization = {"recipe": _recipe(rules, config.format, where).to_dict(), "calibration": None}
    return model.to(device).eval()


def _recipe(rules: dict[str, list[str]], fmt: str, where: str):
    """The ssmq recipe that states what the checkpoint holds (one rule per scheme, exact module paths),
    so a loaded model saves with ``save_quantized`` like any ssmq-quantized one."""
    from ssmq.quant.recipe import Recipe, Rule
    from ssmq.quant.spec import ActSpec, WeightSpec

    out = []
    for key, paths in rules.items():
        w, a = json.loads(key)
        out.append(Rule(paths, WeightSpec.from_dict(w), None if a is None else ActSpec.from_dict(a)))
    return Recipe(f"compressed-tensors:{fmt}", out, description=f"loaded from {where}").validate()
