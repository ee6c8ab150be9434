"""Quantized checkpoints: a folder of plain data, written atomically, verified on load.

    out/
      model.safetensors     the state dict (codes, float32 scales and buffers; float parameters in the
                            storage dtype: the source checkpoint's, e.g. bfloat16, so that no unquantized
                            tensor takes more bytes than in the source); lm_head.weight is left out when tied
                            to the embedding
      quantization.json     {"format_version", "ssmq_version", "recipe", "calibration" (source, sha256,
                            seed, n_samples, seqlen), "model_config", "dtype",
                            "modules": {path: spec of each replaced module}, "files": {name: sha256}}
      tokenizer files       copied from the source model (``extra_files``), also checksummed

``load_model`` is the loader every caller uses (``ssmq.load_model``): a quantized folder loads here, anything
else through ``ssmq.models.load_model`` (the models layer knows nothing of quantization).
Loading rebuilds the float skeleton from ``model_config``, swaps in empty modules from
``modules`` (``MODULE_KINDS``), and copies the tensors in: no Python class is pickled. The
folder is written under a temporary name beside ``out`` (``ssmq.paths.TMP_PREFIX`` + the writer's PID) and
renamed at the end (quantization.json last), so an interrupted save leaves no folder at ``out``; a killed
writer's temporary folder is removed by the next save into the same parent folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
import torch.nn as nn

from ssmq.errors import SSMQError
from ssmq.models.linear import Linear
from ssmq.paths import read_json, remove_stale_temporaries, temporary_name
from ssmq.quant.conv import QuantConv1d
from ssmq.quant.hadamard import RotatedEmbedding, RotatedLinear, UnrotatingRMSNorm
from ssmq.quant.linear import QuantEmbedding, QuantLinear
from ssmq.quant.recipe import Recipe

FORMAT_VERSION = 1
MANIFEST = "quantization.json"
WEIGHTS = "model.safetensors"
# spec "kind" -> constructor of an empty module; later packages (Quamba) add their own
MODULE_KINDS = {"QuantLinear": QuantLinear.from_spec, "QuantEmbedding": QuantEmbedding.from_spec,
                "RotatedLinear": RotatedLinear.from_spec, "RotatedEmbedding": RotatedEmbedding.from_spec,
                "UnrotatingRMSNorm": UnrotatingRMSNorm.from_spec, "QuantConv1d": QuantConv1d.from_spec}


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


def _tie(model: nn.Module) -> None:
    """lm_head reads the embedding's weight, as the config says, where both are float (a rotated embedding's table
    is the plain one; a quantized lm_head or embedding has its own tensors)."""
    if model.config.tie_embeddings and type(model.lm_head) in (nn.Linear, Linear) and \
            type(model.embedding) in (nn.Embedding, RotatedEmbedding):
        model.lm_head.weight = model.embedding.weight


def _tied(model: nn.Module) -> bool:
    head = getattr(model.lm_head, "weight", None)
    return head is not None and head is getattr(model.embedding, "weight", None)


_FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)  # not float8 codes


def _state(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The tensors to store; float parameters (the unquantized weights) cast to ``dtype``, buffers (scales, tables)
    as they are."""
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    state = {}
    for k, v in model.state_dict().items():
        v = v.detach()
        if dtype is not None and k in params and v.dtype in _FLOATS:
            v = v.to(dtype)
        state[k] = v.contiguous().cpu()
    if _tied(model):
        state.pop("lm_head.weight", None)
    return state


def save_quantized(model: nn.Module, out: str | os.PathLike, extra_files=(), overwrite: bool = False,
                   dtype: torch.dtype | None = None) -> Path:
    """Write ``model`` (quantized by ``ssmq.quant.quantize``) to the folder ``out``, atomically.

    dtype: the storage dtype of the float parameters (``source_dtype`` of the checkpoint the model came from);
    None keeps the model's.
    """
    from safetensors.torch import save_file

    from ssmq.version import __version__

    info = getattr(model, "quantization", None)
    if info is None:
        raise SSMQError("save_quantized needs a model quantized by ssmq.quant.quantize")
    if dtype is not None and dtype not in _FLOATS:
        raise SSMQError(f"storage dtype must be a float dtype, not {dtype}")
    with atomic_folder(out, overwrite) as tmp:
        specs = ((p, m.spec()) for p, m in model.named_modules() if p and callable(getattr(m, "spec", None)))
        modules = {p: s for p, s in specs if s is not None}  # None: nothing beyond the float skeleton
        save_file(_state(model, dtype), str(tmp / WEIGHTS), metadata={"format": "ssmq-quantized"})
        for f in extra_files:
            shutil.copyfile(f, tmp / Path(f).name)
        files = sorted(p.name for p in tmp.iterdir())
        for name in files:
            _fsync(tmp / name)
        manifest = {
            "format_version": FORMAT_VERSION, "ssmq_version": __version__,
            "recipe": info["recipe"], "calibration": info["calibration"],
            "model_config": model.config.to_dict(),
            "dtype": str(dtype or _float_dtype(model)).replace("torch.", ""),
            "modules": modules, "files": {name: sha256_file(tmp / name) for name in files},
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        _fsync(tmp / MANIFEST)
    return Path(out).expanduser()


@contextlib.contextmanager
def atomic_folder(out: str | os.PathLike, overwrite: bool = False):
    """Yield a temporary folder beside ``out``; renamed to ``out`` when the block ends without an error.

    An error (or an interrupt) removes the temporary folder, so nothing appears at ``out``; an
    existing ``out`` (overwrite) is moved aside only once the new folder is complete. Temporary
    folders that killed writers left in the same parent folder are removed first.
    """
    out = Path(out).expanduser()
    if out.exists() and not overwrite:
        raise SSMQError(f"output folder {out} already exists (choose another, or overwrite)")
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out.parent)
    tmp = temporary_name(out)
    tmp.mkdir()
    try:
        yield tmp
        if out.exists():
            trash = temporary_name(out)
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


STORAGE_DTYPES = ("float32", "float16", "bfloat16", "float64")
# quantization.json: field -> (JSON types it may have, required)
MANIFEST_FIELDS = {"format_version": ((int,), True), "ssmq_version": ((str,), False), "recipe": ((dict,), True),
                   "calibration": ((dict, type(None)), False), "model_config": ((dict,), True),
                   "dtype": ((str,), False), "modules": ((dict,), True), "files": ((dict,), True)}


def validate_manifest(manifest, where: str) -> dict:
    """The schema of quantization.json (types, the dtype enum, checksums, module specs); one line naming the
    field otherwise. The recipe and model_config are checked by ``Recipe.from_dict`` and ``ModelConfig``."""
    if not isinstance(manifest, dict):
        raise SSMQError(f"{where}: {MANIFEST} is not a JSON object")
    unknown = sorted(set(manifest) - set(MANIFEST_FIELDS))
    if unknown:
        raise SSMQError(f"{where}: unknown {MANIFEST} field(s) {unknown}; known: {sorted(MANIFEST_FIELDS)}")
    for name, (kinds, required) in MANIFEST_FIELDS.items():
        if name not in manifest:
            if required:
                raise SSMQError(f"{where}: {MANIFEST} lacks the field {name!r}")
            continue
        v = manifest[name]
        if not isinstance(v, kinds) or isinstance(v, bool):
            raise SSMQError(f"{where}: {MANIFEST} field {name!r} must be "
                            f"{' or '.join(k.__name__.replace('NoneType', 'null') for k in kinds)}, got {v!r}"[:300])
    if manifest["format_version"] != FORMAT_VERSION:
        raise SSMQError(f"{where}: quantized checkpoint format version {manifest['format_version']}, this ssmq reads "
                        f"version {FORMAT_VERSION}; re-quantize with this version")
    if manifest.get("dtype", "float32") not in STORAGE_DTYPES:
        raise SSMQError(f"{where}: {MANIFEST} field 'dtype' must be one of {', '.join(STORAGE_DTYPES)}, "
                        f"got {manifest['dtype']!r}")
    for name, digest in manifest["files"].items():
        if not (isinstance(digest, str) and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)) \
                or "/" in name or name.startswith("."):
            raise SSMQError(f"{where}: {MANIFEST} field 'files' entry {name!r} must map a file name to a sha256 "
                            f"hex digest, got {digest!r}")
    for path, spec in manifest["modules"].items():
        if not (isinstance(spec, dict) and isinstance(spec.get("kind"), str)):
            raise SSMQError(f"{where}: {MANIFEST} field 'modules' entry {path!r} must be an object with a 'kind' "
                            "string")
    return manifest


def read_manifest(folder: str | os.PathLike) -> dict:
    folder = Path(folder)
    manifest = read_json(folder / MANIFEST, f"{folder} is not a quantized checkpoint (no {MANIFEST})")
    return validate_manifest(manifest, str(folder))


def recipe_of(manifest: dict, where: str) -> Recipe:
    """The manifest's recipe (format 1 or 2), validated; one line naming the checkpoint otherwise."""
    try:
        return Recipe.from_dict(manifest["recipe"])
    except SSMQError as e:
        raise SSMQError(f"{where}: {MANIFEST} recipe: {e}") from None
    except (KeyError, TypeError) as e:
        raise SSMQError(f"{where}: {MANIFEST} recipe is malformed ({type(e).__name__}: {e})") from None


def model_config_of(manifest: dict, where: str):
    """The ModelConfig recorded in a manifest; one line naming the field when it is malformed."""
    from ssmq.errors import check_field_types
    from ssmq.models import ModelConfig

    d = manifest["model_config"]
    try:
        # dt_limit's upper bound is stored as the string "inf" (JSON has no infinity); ModelConfig parses it
        check_field_types(ModelConfig, {k: v for k, v in d.items() if k != "dt_limit"}, f"{MANIFEST} model_config")
        return ModelConfig.from_dict(d)
    except (TypeError, ValueError) as e:
        raise SSMQError(f"{where}: {MANIFEST} field 'model_config' is not a valid model config ({e})") from None
    except SSMQError as e:
        raise SSMQError(f"{where}: {e}") from None


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
    cfg = model_config_of(manifest, str(folder))
    with torch.device("meta"):
        model = SSMLM(cfg)
        for path, spec in manifest["modules"].items():
            kind = spec.get("kind")
            if kind not in MODULE_KINDS:
                raise SSMQError(f"{folder}: unknown module kind {kind!r} at {path} (saved by a newer ssmq?)")
            _set(model, path, MODULE_KINDS[kind](spec))
        _tie(model)  # a swapped-in embedding has a new weight
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
    _tie(model)  # re-tie: the embedding got a new Parameter above
    float_dtype = dtype or getattr(torch, manifest.get("dtype", "float32"))
    for m in model.modules():  # non-persistent dtype markers (QuantEmbedding) follow the float dtype
        if "_dtype" in m._buffers:
            m._buffers["_dtype"] = torch.empty(0, dtype=float_dtype, device=dev)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise SSMQError(f"{folder}: no stored value for {left[:3]}")
    recipe = recipe_of(manifest, str(folder)).to_dict()  # a format-1 recipe (ssmq 0.1) reads as format 2
    model.quantization = {"recipe": recipe, "calibration": manifest["calibration"]}
    return model.to(device).eval()


# ---------------------------------------------------------------------------------------------
# sizes: the source checkpoint's storage dtype and bytes, the quantized checkpoint's predicted bytes
# ---------------------------------------------------------------------------------------------
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def weight_files(path: str | os.PathLike) -> list[Path]:
    """The weight files of a checkpoint folder (safetensors, pytorch_model*.bin) or a GGUF file."""
    p = Path(path)
    if p.is_file():
        return [p]
    return sorted(f for f in p.iterdir() if f.is_file() and (f.suffix in (".safetensors", ".gguf")
                                                              or (f.suffix == ".bin" and "model" in f.name)))


def source_bytes(path: str | os.PathLike) -> int:
    """Bytes of the weight files of a checkpoint (what ``ssmq quantize`` compares its output with)."""
    return sum(f.stat().st_size for f in weight_files(path))


def _safetensors_header(f: Path) -> dict:
    with open(f, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        if not 0 < n < 1 << 28:
            raise SSMQError(f"{f}: not a safetensors file (header length {n})")
        try:
            return json.loads(fh.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SSMQError(f"{f}: corrupt safetensors header ({e})") from None


def source_dtype(path: str | os.PathLike) -> torch.dtype:
    """The float dtype most of a source checkpoint's float tensors are stored in (bfloat16 for the trained
    reference models): the dtype a quantized checkpoint stores the unquantized tensors in. Safetensors headers
    are read (no tensor data); a GGUF file gives float16; a ``pytorch_model.bin`` its config's ``torch_dtype``."""
    p = Path(path)
    if p.is_file():  # GGUF: its float tensors are F16/F32, its quantized ones smaller still
        return torch.float16
    counts: dict[torch.dtype, int] = {}
    for f in weight_files(p):
        if f.suffix != ".safetensors":
            continue
        for name, entry in _safetensors_header(f).items():
            if name == "__metadata__" or entry.get("dtype") not in _SAFETENSORS_DTYPES:
                continue
            n = 1
            for d in entry.get("shape", []):
                n *= d
            counts[_SAFETENSORS_DTYPES[entry["dtype"]]] = counts.get(_SAFETENSORS_DTYPES[entry["dtype"]], 0) + n
    if counts:
        return max(counts, key=counts.get)
    config = p / "config.json"
    raw = read_json(config, f"no config.json in {p}") if config.is_file() else {}
    name = raw.get("torch_dtype") or raw.get("dtype") or "float32"
    dtype = getattr(torch, str(name), None)
    return dtype if dtype in _FLOATS else torch.float32


def predicted_bytes(model: nn.Module, targets: dict, embedding_spec=None, dtype: torch.dtype | None = None) -> int:
    """About the bytes of ``save_quantized(model)`` once ``targets`` ({linear path: Rule}, ``ssmq.quant.check``)
    are quantized: codes at their bits plus float32 scales, every other tensor at ``dtype`` (default: its own)."""
    from ssmq.quant.primitives import PerChannel, PerGroup

    bits = {"int4": 4, "int8": 8, "fp8": 8}
    total, seen = 0, set()
    for name, t in model.state_dict().items():
        owner, _, attr = name.rpartition(".")
        if id(t) in seen or (name == "lm_head.weight" and _tied(model)):
            continue
        seen.add(id(t))
        spec = targets[owner].weight if owner in targets and attr == "weight" else None
        if spec is None and owner == "embedding" and attr == "weight" and embedding_spec is not None:
            spec = embedding_spec
        if spec is None:
            size = torch.empty(0, dtype=dtype).element_size() if dtype is not None and t.is_floating_point() \
                else t.element_size()
            total += t.numel() * size
            continue
        n, k = t.shape[0], t.numel() // max(t.shape[0], 1)
        g = spec.granularity
        scales = n * (k // g.group_size) if isinstance(g, PerGroup) else n if isinstance(g, PerChannel) else 1
        total += t.numel() * bits.get(spec.dtype, 8) // 8 + 4 * scales * (1 if spec.symmetric else 2)
    return total
