"""Structured outputs, the request side (on the event loop, cheap, nothing compiled): a
request's ``response_format`` (OpenAI), ``json_schema`` or ``grammar`` (llama-server) checked
into a ``GrammarSpec``, within the limits on its size and nesting; every refusal an
``InvalidInput`` (400) or ``LimitExceeded`` (413) naming the field. ``grammar.py`` compiles a
spec and walks it per sequence."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from sokuji.core.limits import Limit, LimitExceeded
from sokuji.errors import InvalidInput

MAX_SCHEMA_BYTES = Limit("max_schema_bytes", 64 * 1024, "bytes",
                         "bytes of one JSON schema, written as compact JSON")
MAX_SCHEMA_DEPTH = Limit("max_schema_depth", 64, "levels",
                         "nesting of objects and arrays in one JSON schema document")
MAX_GRAMMAR_BYTES = Limit("max_grammar_bytes", 32 * 1024, "bytes",
                          "bytes of one GBNF grammar (UTF-8)")
LIMITS = (MAX_SCHEMA_BYTES, MAX_SCHEMA_DEPTH, MAX_GRAMMAR_BYTES)
"""The request-side limits (module constants for now; show them with the model's limits)."""

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

Kind = Literal["json_schema", "gbnf", "lark"]
"""``lark``: llguidance's own grammar language (tool calls: ``llm/tools.py``)."""


@dataclass(frozen=True)
class GrammarSpec:
    """One request's constraint, checked but not compiled."""

    kind: Kind
    text: str
    """The compact JSON schema (key order kept: it is the order of the output's keys), or
    the GBNF source."""
    param: str
    """The request field it came from (``response_format``, ``grammar``, ``json_schema``):
    what a compile error names."""
    name: str | None = None
    """``json_schema.name`` (OpenAI's): informative only."""
    strict: bool = True
    """``json_schema.strict``. OpenAI calls ``strict: false`` best-effort; here both are
    enforced alike (a schema llguidance cannot enforce is refused either way)."""


# -- 1. request side (event loop) ----------------------------------------------------------


def parse_response_format(value: Any, param: str = "response_format") -> GrammarSpec | None:
    """OpenAI's ``response_format``: ``None`` or ``{"type": "text"}`` -> ``None``;
    ``{"type": "json_object"}`` -> any JSON object; ``{"type": "json_schema", "json_schema":
    {"name", "schema", "strict", "description"}}`` -> that schema (no ``schema``: any JSON
    object, as OpenAI). Cheap: no compile. Raises ``InvalidInput`` / ``LimitExceeded``
    naming the field."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidInput(f"{param} must be an object", param=param)
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_schema", '{"type":"object"}', param)
    if kind != "json_schema":
        raise InvalidInput(f"{param}.type must be 'text', 'json_object' or 'json_schema', "
                           f"not {_short(kind)}", param=f"{param}.type")
    field = f"{param}.json_schema"
    inner = value.get("json_schema")
    if not isinstance(inner, dict):
        raise InvalidInput(f"{field} must be an object (with name and schema)", param=field)
    name = inner.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidInput(f"{field}.name must be a string of 1 to 64 letters, digits, '_' "
                           f"or '-'", param=f"{field}.name")
    strict = inner.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidInput(f"{field}.strict must be a boolean", param=f"{field}.strict")
    schema = inner.get("schema")
    text = '{"type":"object"}' if schema is None else schema_text(schema, f"{field}.schema")
    return GrammarSpec("json_schema", text, param, name=name, strict=strict is not False)


def parse_json_schema(value: Any, param: str = "json_schema") -> GrammarSpec | None:
    """llama-server's ``json_schema`` field (a bare schema object); ``None`` -> ``None``."""
    if value is None:
        return None
    return GrammarSpec("json_schema", schema_text(value, param), param)


def parse_gbnf(value: Any, param: str = "grammar") -> GrammarSpec | None:
    """llama-server's ``grammar`` field: a GBNF grammar (llama.cpp's syntax, ``root`` is the
    start rule). ``None`` or ``""`` -> ``None``. Only its size is checked here; its syntax
    is checked by ``Grammars.compile``."""
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise InvalidInput(f"{param} must be a string (a GBNF grammar)", param=param)
    _check(MAX_GRAMMAR_BYTES, len(value.encode("utf-8")), param)
    return GrammarSpec("gbnf", value, param)


def schema_text(schema: Any, param: str) -> str:
    """The schema as compact JSON, after the checks that need no compile: an object, not
    nested past ``MAX_SCHEMA_DEPTH`` (checked first, without recursion), no ``x-guidance``,
    at most ``MAX_SCHEMA_BYTES``."""
    if not isinstance(schema, dict):
        raise InvalidInput(f"{param} must be a JSON Schema object, not {_short(schema)}",
                           param=param)
    _check(MAX_SCHEMA_DEPTH, _depth(schema, MAX_SCHEMA_DEPTH.value), param)
    if "x-guidance" in schema:
        raise InvalidInput(f"{param}: 'x-guidance' (the grammar engine's own options) is not "
                           "accepted", param=param)
    try:
        text = json.dumps(schema, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"{param} is not JSON: {exc}", param=param) from None
    _check(MAX_SCHEMA_BYTES, len(text.encode("utf-8")), param)
    return text


def _depth(value: Any, stop: float) -> int:
    """The nesting of dicts and lists in ``value`` (1: a flat object), iteratively; it stops
    counting once past ``stop`` (the work stays bounded by the limit)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        if level > deepest:
            deepest = level
            if deepest > stop:
                return deepest
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, level + 1) for c in children if isinstance(c, dict | list))
    return deepest


def _check(limit: Limit, need: int, param: str) -> None:
    try:
        limit.check(need, param)
    except LimitExceeded as exc:
        exc.param = param  # the field; the message names the limit's key
        raise


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
