"""A character tokenizer over 64 symbols (id 0 is EOS), with the ssmq Tokenizer interface, for the tiny models."""

from __future__ import annotations

import string

ALPHABET = "~" + string.ascii_lowercase + string.ascii_uppercase + " .,!?\n-:;'"  # 63 symbols; "~" is EOS
assert len(set(ALPHABET)) == len(ALPHABET) <= 64


class CharTokenizer:
    eos_id = 0

    def encode(self, text: str) -> list[int]:
        return [ALPHABET.index(c) for c in text if c in ALPHABET]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return "".join(ALPHABET[i] if i < len(ALPHABET) else "\ufffd" for i in ids)

    def __len__(self) -> int:
        return len(ALPHABET)
