"""``ssmq info``: what a model folder holds, for every folder ssmq loads (float checkpoints, ssmq-quantized,
compressed-tensors, GGUF), read from the configs, manifests and file headers alone (no weights loaded).

``describe(path)`` returns ordered sections ``{title: {key: value}}``: ``model`` (architecture, sizes, state and KV
bytes), ``quantization`` (recipe, formats of the quantized modules), ``files`` (bytes on disk, storage dtype,
temporary folders a killed writer left beside the folder); a new section is one more entry in the dict.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from ssmq.paths import human_bytes, leftover_temporaries


def describe(path: Path, bytes_per_value: int = 2) -> dict[str, dict[str, str]]:
    """The sections of ``ssmq info`` for the folder or GGUF file ``path``."""
    from ssmq.quant.checkpoint import MANIFEST
    from ssmq.quant.compressed_tensors.load import is_compressed_tensors

    path = Path(path)
    if (path / MANIFEST).is_file():
        cfg, fmt, quant = _ssmq_quantized(path)
    elif path.is_dir() and is_compressed_tensors(path):
        cfg, fmt, quant = _compressed_tensors(path)
    else:
        from ssmq.models.loading import load_config

        cfg, fmt = load_config(path)
        quant = _gguf_types(path) if fmt == "gguf" else {"recipe": "none (float checkpoint)"}
    return {"model": _model(cfg, fmt, path, bytes_per_value), "quantization": quant, "files": _files(path)}


def print_sections(sections: dict[str, dict[str, str]]) -> None:
    for i, (title, rows) in enumerate(sections.items()):
        if not rows:
            continue
        print(("\n" if i else "") + f"[{title}]")
        for key, value in rows.items():
            print(f"{key:<28} {value}")


def _model(cfg, fmt: str, path: Path, bytes_per_value: int) -> dict[str, str]:
    from ssmq.runtime.footprint import footprint

    return footprint(cfg, bytes_per_value, format_name=fmt, path=str(path))


def _ssmq_quantized(path: Path):
    from ssmq.quant.checkpoint import model_config_of, read_manifest, recipe_of

    manifest = read_manifest(path)
    cfg = model_config_of(manifest, str(path))
    recipe = recipe_of(manifest, str(path))
    kinds = Counter()
    ends = {"RotatedEmbedding", "UnrotatingRMSNorm"}  # not quantized: the residual rotation's online ends
    quantized = [spec for spec in manifest["modules"].values() if spec["kind"] not in ends]
    for spec in quantized:
        kinds[_module_format(spec)] += 1
    calib = manifest.get("calibration") or {}
    quant = {
        "recipe": recipe.name + (f" ({recipe.description})" if recipe.description else ""),
        "calibration": (f"{calib.get('source', '?')}, {calib.get('n_samples', '?')} x {calib.get('seqlen', '?')} "
                        f"tokens, seed {calib.get('seed', '?')}") if calib else "none",
        "quantized modules": str(len(quantized)),
        **{f"  {k}": f"x {n}" for k, n in sorted(kinds.items())},
        **({"residual rotation": "online at both ends (RotatedEmbedding, UnrotatingRMSNorm): embedding and lm_head "
                                 "stay one tied matrix"}
           if any(spec["kind"] in ends for spec in manifest["modules"].values()) else {}),
        "cache": _cache_text(recipe),
        "float tensors stored in": manifest.get("dtype", "float32"),
        "written by": f"ssmq {manifest.get('ssmq_version', '?')} (format {manifest['format_version']})",
    }
    return cfg, "ssmq-quantized", quant


def _module_format(spec: dict) -> str:
    kind = spec["kind"]
    w, a = spec.get("weight"), spec.get("act")
    if kind == "QuantConv1d":  # the SSM's int8 conv (its input codes: one static per-tensor scale)
        return f"{kind} W int8 {spec.get('granularity')} / A int8 static per_tensor" + \
            (" / bias int8 per_tensor" if spec.get("bias") else "")
    if not isinstance(w, dict):
        return kind
    text = f"{kind} W {w.get('dtype')} {w.get('granularity')} {w.get('method', 'rtn')}"
    if kind == "QuantLinear":
        text += " / A " + ("16-bit" if not a else f"{a.get('dtype')} "
                           f"{'static' if a.get('static') else 'dynamic'} {a.get('granularity')}")
        text += " (rotated input)" if spec.get("rotate_input") else ""
    return text


def _cache_text(recipe) -> str:
    from ssmq.models.kv_format import KV_PRESETS

    c = recipe.cache
    state = "16-bit SSM state" if c.state_bits == 16 else (
        "int8 SSM state (SSDi8 scan scales)" if recipe.has("ssdi8") else f"int8 SSM state ({c.state_scales} scales)")
    if c.kv is None:
        return state
    kv = next((name for name, (spec, _) in KV_PRESETS.items() if spec == c.kv), "custom format")
    return f"{state}; KV cache {kv}"


def _compressed_tensors(path: Path):
    from ssmq.models.loading import load_config

    cfg, _ = load_config(path)
    raw = json.loads((path / "config.json").read_text())
    qc = raw["quantization_config"]
    quant = {"recipe": raw.get("ssmq_recipe", "(not written by ssmq)"),
             "compressed-tensors format": f"{qc.get('format')} (version {qc.get('version', '?')})"}
    for name, group in (qc.get("config_groups") or {}).items():
        w, a = group.get("weights") or {}, group.get("input_activations")
        targets = group.get("targets") or []
        what = f"W {w.get('type')}{w.get('num_bits')} {w.get('strategy')}"
        what += f" g{w['group_size']}" if w.get("group_size") else ""
        what += " / A 16-bit" if not a else f" / A {a.get('type')}{a.get('num_bits')} " \
                                             f"{'dynamic' if a.get('dynamic') else 'static'} {a.get('strategy')}"
        quant[f"  {name}"] = f"{what}; {group.get('format') or qc.get('format')}; {len(targets)} target(s)"
    quant["not quantized"] = ", ".join(qc.get("ignore") or []) or "-"
    return cfg, "compressed-tensors", quant


def _gguf_types(path: Path) -> dict[str, str]:
    try:
        from gguf import GGUFReader
    except ImportError:
        return {"recipe": "GGUF (tensor types need the gguf package)"}
    types = Counter(t.tensor_type.name for t in GGUFReader(str(path)).tensors)
    return {"recipe": "GGUF", "tensor types": ", ".join(f"{k} x {n}" for k, n in types.most_common())}


def _files(path: Path) -> dict[str, str]:
    from ssmq.quant.checkpoint import source_dtype, weight_files

    files = weight_files(path)
    rows = {"weights on disk": f"{human_bytes(sum(f.stat().st_size for f in files))} "
                               f"({', '.join(f.name for f in files[:3])}{' ...' if len(files) > 3 else ''})"}
    if path.is_dir():
        rows["folder total"] = human_bytes(sum(f.stat().st_size for f in path.rglob("*") if f.is_file()))
        if not (path / "quantization.json").is_file() and any(f.suffix == ".safetensors" for f in files):
            rows["float tensors stored in"] = str(source_dtype(path)).replace("torch.", "")
    left = leftover_temporaries(path.parent) + (leftover_temporaries(path) if path.is_dir() else [])
    for p, pid, alive in left:
        size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
        rows[f"temporary folder {p.name}"] = (
            f"{human_bytes(size)}; its writer (PID {pid}) is "
            + ("still running" if alive else "gone: the next ssmq run writing in this folder removes it"))
    return rows
