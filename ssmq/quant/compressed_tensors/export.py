"""ssmq checkpoint -> Hugging Face folder in the compressed-tensors format (what vLLM and transformers load).

    out/
      config.json         the HF config of the architecture (``models.hf_layout``), with
                          ``quantization_config`` written by compressed-tensors' ``ModelCompressor``
      model.safetensors   HF tensor names; each QuantLinear as its compressor writes it
                          (weight_packed + weight_shape, or weight int8 / float8), weight_scale,
                          input_scale (static activations), bias; every other tensor as is
      tokenizer files     copied from the ssmq checkpoint

Only quantization that lives in linear layers has a representation in the format. Recipes that
quantize inside the SSM (Quamba / Quamba2 tap scales, the int8 state), a quantized embedding, or
an online Hadamard are refused with one line before anything is written. A pack-quantized (4-bit) out_proj of a
Mamba-1 / Mamba-2 mixer is written int-quantized (int8 codes, ``NEEDS_WEIGHT_NAME``): transformers reads
that module's ``weight`` while loading. (The format's
``transform_config`` can state a power-of-two Sylvester Hadamard on a linear's input, but
transformers 5.17 does not apply transform configs, so such a folder would run wrong there.)
"""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from pathlib import Path

import torch
import torch.nn as nn

from ssmq.errors import SSMQError
from ssmq.models.ffn import Router
from ssmq.quant.checkpoint import MANIFEST, WEIGHTS, atomic_folder, load_quantized, read_manifest
from ssmq.quant.compressed_tensors.schemes import compress_linear, decompress_weight, require_library, scheme_of
from ssmq.quant.linear import QuantLinear

# module kinds of ssmq checkpoints that the format cannot hold, and what they are
NOT_REPRESENTABLE = {
    "SSMActQuantizer": "the SSM's int8 inputs and their scales (x / B / C / z / dt taps, {n} quantizers)",
    "SSMMixer": "the int8 SSM state ({n} mixers)",
    "SSMInt8StateMixer": "the int8 SSM state ({n} mixers)",  # the kind before SSMMixer
    "QuantEmbedding": "the quantized embedding",
    "QuantConv1d": "the int8 conv1d ({n} layers)",
    "SSDi8Scan": "SSDi8's integer SSD scan ({n} layers)",
    "RotatedEmbedding": "the online Hadamard rotation of the residual stream after the embedding lookup",
    "UnrotatingRMSNorm": "its inverse before the final norm",
}


def check_exportable(manifest: dict, where: str) -> None:
    """Refuse, with one line naming the parts, a checkpoint whose quantization is not only in linears."""
    kinds = Counter(spec.get("kind") for spec in manifest.get("modules", {}).values())
    parts = [text.format(n=kinds[k]) for k, text in NOT_REPRESENTABLE.items() if kinds[k]]
    recipe = manifest.get("recipe", {})
    state_bits = recipe.get("state_bits", (recipe.get("cache") or {}).get("state_bits"))  # recipe format 1 / 2
    if state_bits == 8 and not (kinds["SSMMixer"] or kinds["SSMInt8StateMixer"]):
        parts.append("the int8 SSM state")
    unknown = sorted(set(kinds) - set(NOT_REPRESENTABLE) - {"QuantLinear", "RotatedLinear"})
    if unknown:
        parts.append(f"module kind(s) {', '.join(map(str, unknown))}")
    if parts:
        name = manifest.get("recipe", {}).get("name", "?")
        raise SSMQError(f"{where}: recipe {name!r} cannot be exported to compressed-tensors: "
                        f"{'; '.join(parts)} have no representation in the format (it describes the weights "
                        "and inputs of linear layers only)")
    rotated = sorted(p for p, s in manifest["modules"].items()
                     if s.get("kind") == "RotatedLinear" or s.get("rotate_input"))
    if rotated:
        raise SSMQError(f"{where}: recipe {name_of(manifest)!r} has an online Hadamard on the inputs of "
                        f"{len(rotated)} linears ({rotated[0]}, ...); compressed-tensors states one only as a "
                        "transform_config ('hadamard': Sylvester, power-of-two orders), which transformers 5.17 "
                        "ignores (it would run without the rotation, silently wrong), so ssmq does not write it: "
                        "export a recipe without the online rotation")


def name_of(manifest: dict) -> str:
    return manifest.get("recipe", {}).get("name", "?")


# transformers' Mamba-1 / Mamba-2 ``_init_weights`` reads ``mixer.out_proj.weight`` of every mixer while loading, and
# a pack-quantized module holds ``weight_packed`` in its place (AttributeError). Such an out_proj is written in
# int-quantized format instead: the same codes and scales, one int8 per code, under the name ``weight``.
NEEDS_WEIGHT_NAME = {"mamba1": ("mixer.out_proj",), "mamba2": ("mixer.out_proj",)}


def _format_override(path: str, arch: str, fmt: str) -> str | None:
    if fmt == "pack-quantized" and path.endswith(NEEDS_WEIGHT_NAME.get(arch, ())):
        return "int-quantized"
    return None


def _groups(qlinears: dict[str, QuantLinear], arch: str) -> list[tuple[str, list[str]]]:
    """[(key, paths)] of the distinct (weight, act, format override) triples, in order of first appearance."""
    groups: dict[str, list[str]] = {}
    for path, m in qlinears.items():
        fmt = scheme_of(m, ["Linear"]).format
        key = json.dumps([m.wspec.to_dict(), None if m.act is None else m.act.to_dict(),
                          _format_override(path, arch, fmt)], sort_keys=True)
        groups.setdefault(key, []).append(path)
    return list(groups.items())


def export_compressed_tensors(model_dir: str | os.PathLike, out: str | os.PathLike,
                              overwrite: bool = False) -> Path:
    """Write the ssmq checkpoint ``model_dir`` as a compressed-tensors HF folder ``out`` (atomically)."""
    require_library()
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import save_file

    from ssmq.models.hf_layout import config_to_hf, rename_to_hf

    src = Path(model_dir).expanduser()
    if not (src / MANIFEST).is_file():
        raise SSMQError(f"{src} is not an ssmq quantized checkpoint (no {MANIFEST}); export takes the "
                        "output folder of `ssmq quantize`")
    manifest = read_manifest(src)
    check_exportable(manifest, str(src))
    out = Path(out).expanduser()
    if out.exists() and not overwrite:
        raise SSMQError(f"output folder {out} already exists (pass --overwrite to replace it)")
    model = load_quantized(src)
    cfg = model.config
    config_to_hf(cfg)  # refuses, before any work, a family whose tensors do not map name for name
    qlinears = {p: m for p, m in model.named_modules() if isinstance(m, QuantLinear)}
    if not qlinears:
        raise SSMQError(f"{src}: no quantized linear layer to export")
    hf = {p: rename_to_hf(p, cfg) for p in qlinears}
    groups = _groups(qlinears, cfg.arch)
    tensors: dict[str, torch.Tensor] = {}
    config_groups, formats = {}, set()
    for i, (key, paths) in enumerate(groups):
        # one scheme: llm-compressor's spelling (class target + ignore list); several: exact names
        targets = ["Linear"] if len(groups) == 1 else [hf[p] for p in paths]
        scheme = scheme_of(qlinears[paths[0]], targets)
        scheme.format = json.loads(key)[2] or scheme.format
        config_groups[f"group_{i}"] = scheme
        formats.add(scheme.format)
        for p in paths:
            m = qlinears[p]
            local = compress_linear(m, scheme)
            if not torch.equal(decompress_weight(local, scheme), m.dequantized_weight()):
                raise SSMQError(f"{p}: compressed-tensors' decompression does not return ssmq's weight exactly "
                                "(scales too small for the format?); not exported")
            tensors.update({f"{hf[p]}.{k}": v.cpu() for k, v in local.items()})
    # MoE routers (linears in the HF models, float parameters in ssmq) stay float too
    ignore = sorted(rename_to_hf(p, cfg) for p, m in model.named_modules()
                    if isinstance(m, (nn.Linear, Router)) and p not in qlinears)
    tied = cfg.tie_embeddings and getattr(model.lm_head, "weight", None) is model.embedding.weight
    for name, t in model.state_dict().items():
        owner = name.rpartition(".")[0]
        if owner in qlinears or (tied and name == "lm_head.weight"):
            continue
        tensors[rename_to_hf(name, cfg)] = t.detach().contiguous().cpu()
    qcfg = QuantizationConfig(config_groups=config_groups, ignore=ignore, quantization_status="compressed",
                              format=formats.pop() if len(formats) == 1 else "mixed-precision")
    dtype = manifest.get("dtype", "float32")
    with atomic_folder(out, overwrite) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = {**config_to_hf(cfg), "dtype": dtype, "torch_dtype": dtype,
                  "ssmq_recipe": name_of(manifest)}
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        ModelCompressor(quantization_config=qcfg).update_config(str(tmp))  # the library writes its own block
        for name in manifest.get("files", {}):
            if name != WEIGHTS:
                shutil.copyfile(src / name, tmp / name)
    return out
