"""The one exception type users see: its message is a single line saying what is wrong; and the one strict way a
JSON object becomes a dataclass (recipes, KV specs), which refuses unknown keys with such a line."""

from dataclasses import fields


class SSMQError(Exception):
    """A user-facing error (bad input, missing file, unsupported combination); the CLI prints it and exits 1."""


def from_json_object(cls, d, what: str):
    """cls(**d), refusing a non-object or unknown keys with one line naming ``what`` and the known fields."""
    if not isinstance(d, dict):
        raise SSMQError(f"a {what} is a JSON object, not {type(d).__name__}")
    known = [f.name for f in fields(cls)]
    unknown = set(d) - set(known)
    if unknown:
        raise SSMQError(f"unknown {what} field(s) {sorted(unknown)}; known: {sorted(known)}")
    return cls(**d)
