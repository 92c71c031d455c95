"""The one translator from msgspec's validation errors to ``ConfigError``: every table of the
configuration (the server's own, and each kind's ``options`` schema) is checked by msgspec and
its first error reported the same way, naming the key as the file spells it
(``models[0].options.n_ctx``), the value (masked where it may be a secret) and a reason
(the constraint's own ``_why`` reason, else one derived from the type).

``convert(raw, schema, at)`` is what a kind calls for its options (and a pipeline step for
its own, a model for its ``semantic_cache``); ``config.py`` calls ``translate`` with the whole
file as ``raw`` and the server's schema as ``root``.
"""

from __future__ import annotations

import enum
import re
import types
from collections.abc import Mapping
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import msgspec
from msgspec import Meta, Struct

from sokuji.errors import ConfigError

S = TypeVar("S")

_AT = re.compile(r"(?s)(.*?)(?: - at `\$(.*)`)?")
_PART = re.compile(r"\.([^.\[]+)|\[(\d+)\]")
_FIELD = re.compile(r"Object (contains unknown|missing required) field `(.+)`")
_BOUND = re.compile(r"Expected `\w+` (>=|>|<=|<) (\S+)")
_TYPE = re.compile(r"Expected `(\w+)[^`]*`, got")
_TYPE_REASONS = {"int": "not a valid integer", "float": "not a valid number",
                 "bool": "not a valid bool", "str": "not a string", "object": "must be a table"}


def convert(raw: Mapping[str, Any] | None, schema: type[S], at: str) -> S:
    """``raw`` as ``schema``, or a ``ConfigError`` naming ``at`` + the key that is wrong.

    Strict: these tables come from the file only, so a value has the type TOML gave it
    (``"2"`` is not an integer, ``1`` not a bool); only the server's own top-level keys
    arrive as strings (environment variables) and are converted leniently (``config.py``)."""
    data = dict(raw or {})
    try:
        return msgspec.convert(data, schema, strict=True)
    except msgspec.ValidationError as exc:
        raise translate(str(exc), data, {}, schema, at, strict=True) from None


def translate(message: str, raw: Any, names: Mapping[str, str], root: Any,
              prefix: str = "", secret_tables: tuple[str, ...] = (),
              strict: bool = False) -> ConfigError:
    """msgspec's ``message`` (``Expected `int` >= 1 - at `$.models[0].max_batch_size```) about
    ``raw`` converted as ``root``, as a ``ConfigError``. ``names``: top-level keys whose value
    came from elsewhere (an environment variable), named so; ``prefix``: where ``raw`` sits
    in the file; ``secret_tables``: top-level tables whose items (API keys) are never echoed;
    ``strict``: whether ``raw`` was converted strictly (then a value is echoed as written)."""
    match = _AT.fullmatch(message)
    text, path = (match[1], match[2] or "") if match else (message, "")
    parts: list[str | int] = [name or int(index) for name, index in _PART.findall(path)]
    unknown = _FIELD.match(text)
    if unknown:
        parts.append(unknown[2])
    kind = _annotation(root, parts)
    if parts and isinstance(parts[-1], int) and not _is_table(kind):
        parts.pop()  # an item of a list of strings: name the list, as the file does
        kind = _annotation(root, parts)
    if not parts:
        return ConfigError(f"Config '{prefix}': {text}" if prefix else f"Config: {text}",
                           param=prefix or None)
    value = _lookup(raw, parts)
    if unknown and unknown[1] == "contains unknown":
        reason = "unknown key"
        table = _bare(_annotation(root, parts[:-1]))
        if _is_table(table):
            reason += f"; known: {', '.join(sorted(table.__struct_fields__))}"
    elif unknown:
        reason = "required key missing"
    else:
        reason = _reason(text, kind)
        value = _typed(value, kind, strict)
    if isinstance(value, Mapping) or (parts[0] in secret_tables and (
            len(parts) == 1 or isinstance(parts[-1], int) or unknown)):
        value = "..."  # a table, or what may be a key (``kye = ...``), is not echoed
    if len(parts) == 1 and parts[0] in names:
        key = names[str(parts[0])]
    else:
        key = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts)
        key = f"{prefix}{key}" if prefix else key[1:]
    return ConfigError.for_key(key, value, reason)


def _reason(text: str, kind: Any) -> str:
    wrong = _TYPE.match(text)
    union = "|" in text.partition(", got")[0]  # ``float | str``: the field's reason says more
    if wrong and wrong[1] in ("int", "float", "bool") and not union:
        return _TYPE_REASONS[wrong[1]]
    for meta in getattr(kind, "__metadata__", ()):
        if isinstance(meta, Meta) and meta.extra and "reason" in meta.extra:
            return str(meta.extra["reason"])
    if wrong and wrong[1] in ("int", "float", "bool"):
        return _TYPE_REASONS[wrong[1]]
    bare = _bare(kind)
    choices = get_args(bare) if get_origin(bare) is Literal else (
        tuple(m.value for m in bare) if isinstance(bare, type) and issubclass(bare, enum.Enum)
        else ())
    if choices:
        return (f"must be {choices[0]} or {choices[1]}" if len(choices) == 2
                else f"must be one of: {', '.join(map(str, choices))}")
    bound = _BOUND.match(text)
    if bound:
        op, limit = bound[1], bound[2]
        zero = float(limit) == 0
        return {">=": "must be zero or more" if zero else f"must be at least {limit}",
                ">": "must be more than zero" if zero else f"must be more than {limit}",
                "<=": f"must be at most {limit}", "<": f"must be less than {limit}"}[op]
    if wrong and wrong[1] == "array":
        return "must be an array of tables" if _is_table(_item(kind)) else "must be a list"
    if wrong and wrong[1] in _TYPE_REASONS:
        return _TYPE_REASONS[wrong[1]]
    return text[:1].lower() + text[1:]


def _bare(kind: Any) -> Any:
    """The type without its ``Meta``, and an optional table (``SloConfig | None``) as the
    table: its keys are named the same either way."""
    if get_origin(kind) is Annotated:
        kind = get_args(kind)[0]
    if get_origin(kind) in (Union, types.UnionType):
        present = [a for a in get_args(kind) if a is not type(None)]
        if len(present) == 1:
            return _bare(present[0])
    return kind


def _item(kind: Any) -> Any:
    args = get_args(_bare(kind))
    return args[0] if args else Any


def _is_table(kind: Any) -> bool:
    bare = _bare(kind)
    return isinstance(bare, type) and issubclass(bare, Struct)


def _annotation(root: Any, parts: list[str | int]) -> Any:
    """The declared type (with its ``Meta``) of the value at ``parts``; ``Any`` if none."""
    kind: Any = root
    for part in parts:
        if isinstance(part, int):
            kind = _item(kind)
        elif _is_table(kind):
            kind = get_type_hints(_bare(kind), include_extras=True).get(part, Any)
        else:
            return Any
    return kind


def _lookup(raw: Any, parts: list[str | int]) -> Any:
    for part in parts:
        try:
            raw = raw[part]
        except (KeyError, IndexError, TypeError):
            return None
    return raw


def _typed(value: Any, kind: Any, strict: bool) -> Any:
    """The value as its field's type would hold it (``-1`` for a float field: ``-1.0``)."""
    bare = _bare(kind)
    if bare in (int, float, str, bool):
        try:
            return msgspec.convert(value, bare, strict=strict)
        except msgspec.ValidationError:
            pass
    return value
