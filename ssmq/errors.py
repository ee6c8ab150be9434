"""The one exception type users see: its message is a single line saying what is wrong; and the one strict way a
JSON object becomes a dataclass (recipes, KV specs), which refuses unknown keys and values of the wrong JSON type
with such a line naming the field."""

import types
import typing
from dataclasses import fields


class SSMQError(Exception):
    """A user-facing error (bad input, missing file, unsupported combination); the CLI prints it and exits 1."""


_JSON_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string", dict: "an object",
               type(None): "null"}


def _primitive(hint) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return all(_primitive(a) for a in typing.get_args(hint))
    if origin in (list, tuple):
        return all(a is Ellipsis or _primitive(a) for a in typing.get_args(hint))
    return hint in _JSON_NAMES or origin is dict


def _type_ok(value, hint) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in args)
    if origin in (list, tuple):
        return isinstance(value, (list, tuple)) and all(_type_ok(v, args[0]) for v in value if args)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is type(None):
        return value is None
    if hint is str:
        return isinstance(value, str)
    return isinstance(value, dict) if (hint is dict or origin is dict) else True


def _type_text(hint) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_text(a) for a in args)
    if origin in (list, tuple):
        return f"a list of {_type_text(args[0]).removeprefix('a ').removeprefix('an ')}s" if args else "a list"
    return _JSON_NAMES.get(hint, "an object" if origin is dict else getattr(hint, "__name__", str(hint)))


def check_field_types(cls, d: dict, what: str) -> None:
    """Refuse (one line naming the field) a value of the wrong JSON type for a field of the dataclass ``cls`` whose
    type is a JSON type (bool, int, float, str, lists of them, dict, or unions with null); fields holding other
    dataclasses are checked by those classes."""
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        if f.name not in d:
            continue
        hint = hints[f.name]
        if _primitive(hint) and not _type_ok(d[f.name], hint):
            raise SSMQError(f"{what} field {f.name!r} must be {_type_text(hint)}, got {d[f.name]!r}")


def from_json_object(cls, d, what: str):
    """cls(**d), refusing a non-object, unknown keys or a value of the wrong type with one line naming ``what``
    and the field."""
    if not isinstance(d, dict):
        raise SSMQError(f"a {what} is a JSON object, not {type(d).__name__}")
    known = [f.name for f in fields(cls)]
    unknown = set(d) - set(known)
    if unknown:
        raise SSMQError(f"unknown {what} field(s) {sorted(unknown)}; known: {sorted(known)}")
    check_field_types(cls, d, what)
    return cls(**d)
