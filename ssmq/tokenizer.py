"""GPT-NeoX tokenizer loading (the tokenizer of the state-spaces Mamba models), offline."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ssmq.errors import SSMQError
from ssmq.paths import shared_dir


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


def load_tokenizer(where: str | os.PathLike | None = None) -> Tokenizer:
    """Load ``tokenizer.json`` from a model folder or file; fall back to $SSMQ_TOKENIZER, then ../shared's GPT-NeoX."""
    from tokenizers import Tokenizer as _Backend

    for path in _candidates(where):
        if path.is_file() and path.name.endswith(".json"):
            backend = _Backend.from_file(str(path))
            eos = backend.token_to_id("<|endoftext|>")
            return Tokenizer(backend, eos_id=0 if eos is None else eos)
    raise SSMQError(
        f"no tokenizer.json found (looked in {where or 'no model folder'}, $SSMQ_TOKENIZER, ../shared/tokenizers); "
        "pass a folder that holds tokenizer.json"
    )
