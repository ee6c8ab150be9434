"""Tokenizer loading, offline: a model folder's tokenizer.json (GPT-NeoX for the state-spaces Mamba models), or
the tokenizer stored in a GGUF file (through transformers)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ssmq.errors import SSMQError
from ssmq.paths import PACKAGED, shared_dir


@dataclass
class Tokenizer:
    """Thin wrapper over ``tokenizers.Tokenizer``: no BOS/EOS added on encode, as the Mamba models expect."""

    backend: object
    eos_id: int = 0

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=False)

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)


def _candidates(where: str | os.PathLike | None) -> list[Path]:
    found = []
    if where is not None:
        p = Path(where)
        found += [p / "tokenizer.json", p] if p.is_dir() else [p]
    env = os.environ.get("SSMQ_TOKENIZER")
    if env:
        found.append(Path(env) / "tokenizer.json" if Path(env).is_dir() else Path(env))
    shared = shared_dir()
    if shared is not None:
        found.append(shared / "tokenizers" / "gpt-neox-20b" / "tokenizer.json")
    return found


def _from_gguf(path: Path) -> Tokenizer:
    """The tokenizer in a GGUF file's metadata, rebuilt by transformers; its fast backend is a ``tokenizers``
    object like the one tokenizer.json gives, so encode/decode are the same code."""
    try:
        import gguf  # noqa: F401  (transformers needs it to read the file)
        from transformers import AutoTokenizer
    except ImportError as e:
        raise SSMQError(f"the tokenizer of a GGUF file needs transformers and gguf ({e.name} is missing): "
                        "pip install -e \".[kv]\"") from None
    from gguf import GGUFReader

    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    # the file's own EOS (SmolLM2: 2, <|im_end|>, what transformers' generate stops at); transformers 5.17's
    # tokenizer reports the BOS id as eos_token_id for this file
    field = GGUFReader(str(path)).fields.get("tokenizer.ggml.eos_token_id")
    eos = int(field.contents()) if field is not None else hf.eos_token_id
    return Tokenizer(hf.backend_tokenizer, eos_id=eos or 0)


def load_tokenizer(where: str | os.PathLike | None = None) -> Tokenizer:
    """Load ``tokenizer.json`` from a model folder or file, or the tokenizer of a ``.gguf`` file or packaged name
    (``smollm2-135m``); fall back to $SSMQ_TOKENIZER, then ../shared's GPT-NeoX."""
    from tokenizers import Tokenizer as _Backend

    if where is not None and not Path(where).exists() and str(where) in PACKAGED:  # e.g. smollm2-135m
        where = PACKAGED[str(where)].path()
    if where is not None and Path(where).is_file() and Path(where).suffix == ".gguf":
        return _from_gguf(Path(where))
    for path in _candidates(where):
        if path.is_file() and path.name.endswith(".json"):
            backend = _Backend.from_file(str(path))
            eos = backend.token_to_id("<|endoftext|>")
            return Tokenizer(backend, eos_id=0 if eos is None else eos)
    raise SSMQError(
        f"no tokenizer.json found (looked in {where or 'no model folder'}, $SSMQ_TOKENIZER, tokenizers/ of the data "
        "folder $SSMQ_SHARED); "
        "pass a folder that holds tokenizer.json"
    )
