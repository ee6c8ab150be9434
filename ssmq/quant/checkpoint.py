"""Quantized checkpoints: a folder of plain data, written atomically, verified on load.

    out/
      model.safetensors     the state dict (codes, float32 scales, float weights in the model dtype);
                            lm_head.weight is left out when tied to the embedding
      quantization.json     {"format_version", "ssmq_version", "recipe", "calibration" (source, sha256,
                            seed, n_samples, seqlen), "model_config", "dtype",
                            "modules": {path: spec of each replaced module}, "files": {name: sha256}}
      tokenizer files       copied from the source model (``extra_files``), also checksummed

``load_model`` is the loader every caller uses (``ssmq.load_model``): a quantized folder loads here, anything
else through ``ssmq.models.load_model`` (the models layer knows nothing of quantization).
Loading rebuilds the float skeleton from ``model_config``, swaps in empty modules from
``modules`` (``MODULE_KINDS``), and copies the tensors in: no Python class is pickled. The
folder is written under a temporary name beside ``out`` and renamed at the end (quantization.json
last), so an interrupted save leaves no folder at ``out``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path

import torch
import torch.nn as nn

from ssmq.errors import SSMQError
from ssmq.models.linear import Linear
from ssmq.paths import read_json
from ssmq.quant.hadamard import RotatedLinear
from ssmq.quant.linear import QuantEmbedding, QuantLinear
from ssmq.quant.recipe import Recipe

FORMAT_VERSION = 1
MANIFEST = "quantization.json"
WEIGHTS = "model.safetensors"
# spec "kind" -> constructor of an empty module; later packages (Quamba) add their own
MODULE_KINDS = {"QuantLinear": QuantLinear.from_spec, "QuantEmbedding": QuantEmbedding.from_spec,
                "RotatedLinear": RotatedLinear.from_spec}


def register_module_kind(kind: str, from_spec) -> None:
    """``from_spec(spec: dict, dtype=, device=) -> nn.Module`` for modules whose ``spec()`` has this kind."""
    MODULE_KINDS[kind] = from_spec


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _tied(model: nn.Module) -> bool:
    head = getattr(model.lm_head, "weight", None)
    return head is not None and head is getattr(model.embedding, "weight", None)


_FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)  # not float8 codes


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if _tied(model):
        state.pop("lm_head.weight", None)
    return state


def save_quantized(model: nn.Module, out: str | os.PathLike, extra_files=(), overwrite: bool = False) -> Path:
    """Write ``model`` (quantized by ``ssmq.quant.quantize``) to the folder ``out``, atomically."""
    from safetensors.torch import save_file

    from ssmq.version import __version__

    info = getattr(model, "quantization", None)
    if info is None:
        raise SSMQError("save_quantized needs a model quantized by ssmq.quant.quantize")
    with atomic_folder(out, overwrite) as tmp:
        specs = ((p, m.spec()) for p, m in model.named_modules() if p and callable(getattr(m, "spec", None)))
        modules = {p: s for p, s in specs if s is not None}  # None: nothing beyond the float skeleton
        save_file(_state(model), str(tmp / WEIGHTS), metadata={"format": "ssmq-quantized"})
        for f in extra_files:
            shutil.copyfile(f, tmp / Path(f).name)
        files = sorted(p.name for p in tmp.iterdir())
        for name in files:
            _fsync(tmp / name)
        manifest = {
            "format_version": FORMAT_VERSION, "ssmq_version": __version__,
            "recipe": info["recipe"], "calibration": info["calibration"],
            "model_config": model.config.to_dict(), "dtype": str(_float_dtype(model)).replace("torch.", ""),
            "modules": modules, "files": {name: sha256_file(tmp / name) for name in files},
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        _fsync(tmp / MANIFEST)
    return Path(out).expanduser()


@contextlib.contextmanager
def atomic_folder(out: str | os.PathLike, overwrite: bool = False):
    """Yield a temporary folder beside ``out``; renamed to ``out`` when the block ends without an error.

    An error (or an interrupt) removes the temporary folder, so nothing appears at ``out``; an
    existing ``out`` (overwrite) is moved aside only once the new folder is complete.
    """
    out = Path(out).expanduser()
    if out.exists() and not overwrite:
        raise SSMQError(f"output folder {out} already exists (choose another, or overwrite)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        if out.exists():
            trash = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
            out.rename(trash)
            tmp.rename(out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _float_dtype(model: nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.dtype in _FLOATS:
            return p.dtype
    return torch.float32


def read_manifest(folder: str | os.PathLike) -> dict:
    folder = Path(folder)
    manifest = read_json(folder / MANIFEST, f"{folder} is not a quantized checkpoint (no {MANIFEST})")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise SSMQError(f"{folder}: quantized checkpoint format version {version}, this ssmq reads "
                        f"version {FORMAT_VERSION}; re-quantize with this version")
    return manifest


def verify(folder: str | os.PathLike, manifest: dict) -> None:
    folder = Path(folder)
    for name, digest in manifest.get("files", {}).items():
        f = folder / name
        if not f.is_file():
            raise SSMQError(f"{folder}: file {name} listed in {MANIFEST} is missing")
        if sha256_file(f) != digest:
            raise SSMQError(f"{folder}: checksum mismatch for {name}; the checkpoint is corrupt or was modified")
    if WEIGHTS not in manifest.get("files", {}):
        raise SSMQError(f"{folder}: {MANIFEST} lists no {WEIGHTS}")


def _set(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, module)


def load_model(name_or_path: str | os.PathLike, dtype: torch.dtype = torch.float32, device="cpu") -> nn.Module:
    """An SSMLM from a float checkpoint folder or hub id, from a quantized folder (``quantization.json``), or from
    a compressed-tensors folder (llm-compressor / ``ssmq export``: QuantLinears from the packed tensors)."""
    from ssmq.models.loading import load_model as load_float, resolve_model_path
    from ssmq.quant.compressed_tensors.load import is_compressed_tensors, load_compressed_tensors

    folder = resolve_model_path(name_or_path)
    if (folder / MANIFEST).exists():
        return load_quantized(folder, dtype=dtype, device=device)
    if is_compressed_tensors(folder):
        return load_compressed_tensors(folder, dtype=dtype, device=device)
    return load_float(folder, dtype=dtype, device=device)


@torch.no_grad()
def load_quantized(folder: str | os.PathLike, dtype: torch.dtype | None = None, device="cpu") -> nn.Module:
    """Rebuild a quantized SSMLM; float tensors in ``dtype`` (default: as saved), scales float32.

    The skeleton is built on the meta device (no float weights are ever materialized) and each
    stored tensor is read straight onto ``device`` and cast there, one at a time: peak memory
    is the quantized model's own bytes plus one tensor.
    """
    from safetensors import safe_open

    from ssmq.models import SSMLM, ModelConfig

    folder = Path(folder)
    manifest = read_manifest(folder)
    verify(folder, manifest)
    cfg = ModelConfig.from_dict(manifest["model_config"])
    with torch.device("meta"):
        model = SSMLM(cfg)
        for path, spec in manifest["modules"].items():
            kind = spec.get("kind")
            if kind not in MODULE_KINDS:
                raise SSMQError(f"{folder}: unknown module kind {kind!r} at {path} (saved by a newer ssmq?)")
            _set(model, path, MODULE_KINDS[kind](spec))
    expected = model.state_dict()
    if _tied(model):
        expected.pop("lm_head.weight", None)
    dev = torch.device(device)
    with safe_open(str(folder / WEIGHTS), framework="pt", device=str(dev) if dev.type != "cpu" else "cpu") as f:
        names = set(f.keys())
        missing, unexpected = sorted(set(expected) - names), sorted(names - set(expected))
        if missing or unexpected:
            raise SSMQError(f"{folder}: tensors do not match the recorded structure "
                            f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
        for name in sorted(names):
            t = f.get_tensor(name)
            dst = expected[name]
            if dst.shape != t.shape:
                raise SSMQError(f"{folder}: shape mismatch for {name}: {tuple(t.shape)} vs {tuple(dst.shape)}")
            owner, _, attr = name.rpartition(".")
            mod = model.get_submodule(owner) if owner else model
            keep = t.to(dtype) if dtype is not None and t.dtype in _FLOATS and "scale" not in attr else t
            if attr in mod._parameters:
                mod._parameters[attr] = nn.Parameter(keep, requires_grad=False)
            else:
                mod._buffers[attr] = keep
    if cfg.tie_embeddings and type(model.lm_head) in (nn.Linear, Linear) and type(model.embedding) is nn.Embedding:
        model.lm_head.weight = model.embedding.weight  # re-tie: the embedding got a new Parameter above
    float_dtype = dtype or getattr(torch, manifest.get("dtype", "float32"))
    for m in model.modules():  # non-persistent dtype markers (QuantEmbedding) follow the float dtype
        if "_dtype" in m._buffers:
            m._buffers["_dtype"] = torch.empty(0, dtype=float_dtype, device=dev)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise SSMQError(f"{folder}: no stored value for {left[:3]}")
    recipe = Recipe.from_dict(manifest["recipe"]).to_dict()  # a format-1 recipe (ssmq 0.1) reads as format 2
    model.quantization = {"recipe": recipe, "calibration": manifest["calibration"]}
    return model.to(device).eval()
