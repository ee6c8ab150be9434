"""Calibration: draw token windows from a text file, run them through a model with hooks by module path.

    calib = load_calibration()                          # 512 windows x 512 tokens of WikiText-2 train
    obs = attach_observers(model, ["layers.*.mixer.act_x"], lambda path, m: MinMaxObserver())
    run_calibration(model, calib)                       # tqdm bar; SSMQError on NaN/inf
    obs.remove(); obs.observers["layers.0.mixer.act_x"].range()

Windows: the whole file is tokenized (GPT-NeoX tokenizer, no special tokens) into one stream;
window starts are drawn uniformly with ``torch.Generator().manual_seed(seed)``, so (source, seed,
n_samples, seqlen) identify the data exactly; ``CalibrationData.record()`` is what checkpoints store.
"""

from __future__ import annotations

import fnmatch
import gzip
import hashlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

from ssmq.errors import SSMQError

DEFAULT_SOURCE = "wikitext2_train.txt.gz"


def default_source() -> Path:
    from ssmq.paths import shared_path

    p = shared_path("data", "train", DEFAULT_SOURCE)
    if p is None:
        raise SSMQError(f"default calibration data data/train/{DEFAULT_SOURCE} not found in the data folder "
                        "($SSMQ_SHARED); pass a text file (--calib FILE)")
    return p


def resolve_source(source: str | Path | None) -> Path:
    """None -> the default; a bare name -> data/train/<name> of the data folder; else a path to a text file."""
    if source is None:
        return default_source()
    p = Path(source).expanduser()
    if p.is_file():
        return p
    from ssmq.paths import shared_path

    shared = shared_path("data", "train", str(source))
    if shared is not None and shared.is_file():
        return shared
    raise SSMQError(f"calibration text {source} not found (a file path, or a file name in data/train/ of the "
                    "data folder $SSMQ_SHARED)")


def read_text(path: Path) -> str:
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rt", encoding="utf-8") as f:
                return f.read()
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SSMQError(f"cannot read calibration text {path}: {e}") from None


def tokenize(text: str, tokenizer=None) -> torch.Tensor:
    """text -> (T,) long token stream. Lines are encoded in parallel batches and concatenated
    (each chunk ends with its newline, so the split does not change the tokens of whole lines)."""
    if tokenizer is None:
        from ssmq.tokenizer import load_tokenizer

        tokenizer = load_tokenizer()
    lines = text.splitlines(keepends=True)
    chunks = ["".join(lines[i:i + 64]) for i in range(0, len(lines), 64)]
    ids: list[int] = []
    for part in tokenizer.encode_batch(chunks):
        ids.extend(part)
    return torch.tensor(ids, dtype=torch.long)


_STREAM: dict = {}  # the last (file, tokenizer) -> token stream: a search draws held-out windows from the same file


def _token_stream(path: Path, tokenizer=None) -> torch.Tensor:
    """``tokenize(read_text(path), tokenizer)``, kept for the next call on the same unchanged file with the same
    tokenizer (WikiText-2 train: ~17 s of a 2-core CPU)."""
    if tokenizer is None:
        from ssmq.tokenizer import load_tokenizer

        tokenizer = load_tokenizer()
    backend = getattr(tokenizer, "backend", None)
    st = path.stat()
    ident = hashlib.sha256(backend.to_str().encode()).hexdigest() if hasattr(backend, "to_str") else None
    key = (str(path.resolve()), st.st_mtime_ns, st.st_size, ident)
    if ident is None or key not in _STREAM:
        stream = tokenize(read_text(path), tokenizer)
        if ident is None:
            return stream
        _STREAM.clear()
        _STREAM[key] = stream
    return _STREAM[key]


@dataclass
class CalibrationData:
    """input_ids: (N, L) long windows; where they came from."""

    input_ids: torch.Tensor
    source: str
    seed: int
    sha256: str = ""  # of the source file

    def record(self) -> dict:
        n, l = self.input_ids.shape
        return {"source": self.source, "sha256": self.sha256, "seed": self.seed, "n_samples": n, "seqlen": l}


def load_calibration(source: str | Path | None = None, n_samples: int = 512, seqlen: int = 512,
                     seed: int = 0, tokenizer=None) -> CalibrationData:
    """N windows of L tokens drawn with a fixed seed from a text file (.txt or .txt.gz)."""
    if n_samples < 1 or seqlen < 1:
        raise SSMQError(f"calibration needs n_samples >= 1 and seqlen >= 1, got {n_samples}, {seqlen}")
    path = resolve_source(source)
    stream = _token_stream(path, tokenizer)
    if stream.numel() <= seqlen:
        raise SSMQError(f"calibration text {path} has {stream.numel()} tokens, fewer than one window of {seqlen}")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, stream.numel() - seqlen, (n_samples,), generator=g)
    windows = torch.stack([stream[s:s + seqlen] for s in starts.tolist()])
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return CalibrationData(windows, source=str(path), seed=seed, sha256=digest)


# ---------------------------------------------------------------------------------------------
# hooks by module path
# ---------------------------------------------------------------------------------------------
def match_modules(model: nn.Module, patterns, exclude=(), kinds: tuple[type, ...] = (nn.Module,)) -> list[str]:
    """Paths of the modules of type ``kinds`` matching any fnmatch pattern and no exclude pattern."""
    if isinstance(patterns, str):
        patterns = [patterns]
    return [p for p, m in model.named_modules() if p and isinstance(m, kinds)
            and any(fnmatch.fnmatchcase(p, pat) for pat in patterns)
            and not any(fnmatch.fnmatchcase(p, pat) for pat in exclude)]


class Hooks:
    """Forward hooks on modules by path; ``fn(path, tensor)`` gets each module's first input
    (``where="input"``) or its output (``"output"``); every tensor is checked finite first."""

    def __init__(self, model: nn.Module, paths: list[str], fn: Callable[[str, torch.Tensor], None],
                 where: str = "input"):
        if where not in ("input", "output"):
            raise ValueError(where)
        self.handles = []
        for path in paths:
            module = model.get_submodule(path)
            self.handles.append(module.register_forward_hook(self._hook(path, fn, where)))

    @staticmethod
    def _hook(path, fn, where):
        def hook(module, inputs, output):
            x = inputs[0] if where == "input" else output
            if isinstance(x, tuple):
                x = x[0]
            if not torch.isfinite(x).all():
                raise SSMQError(f"non-finite activation (NaN/inf) at the {where} of {path} during calibration; "
                                "the model or its dtype overflows on this data (try float32)")
            fn(path, x.detach())
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def attach_observers(model: nn.Module, patterns, make: Callable[[str, nn.Module], object],
                     where: str = "input", exclude=(), transform: Callable | None = None):
    """Hooks that feed ``make(path, module)`` observers (any object with ``update(x)``).

    transform(path, x) -> x optionally maps the tensor first (e.g. an online rotation).
    Returns (hooks, {path: observer}).
    """
    paths = match_modules(model, patterns, exclude)
    observers = {p: make(p, model.get_submodule(p)) for p in paths}

    def feed(path, x):
        observers[path].update(x if transform is None else transform(path, x))

    return Hooks(model, paths, feed, where), observers


@torch.no_grad()
def run_calibration(model: nn.Module, calib: CalibrationData, batch_size: int = 8, device=None,
                    desc: str = "calibration", progress: bool = True) -> None:
    """Forward every window through ``model`` (hooks do the work); logits are discarded."""
    from tqdm.auto import tqdm

    if device is None:
        device = next(model.parameters()).device
    ids = calib.input_ids
    with _eval(model):
        for i in tqdm(range(0, ids.shape[0], batch_size), desc=desc, disable=not progress, unit="batch"):
            model(ids[i:i + batch_size].to(device))


@contextmanager
def _eval(model: nn.Module):
    was = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was)
