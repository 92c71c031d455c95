"""Reading an OpenAI-style server-sent-event stream, one line at a time: the one place that
knows the wire format, for ``sokuji bench`` (``targets.StreamParse``) and every benchmark
under ``benchmarks/`` that streams (they iterate ``aiohttp``'s ``response.content``, which
yields lines, and time each one as it arrives).

- ``data(line)``: a ``data:`` line's JSON object; None for ``[DONE]``, blank lines, comments
  and anything that is not a JSON object.
- ``comment(line, name)``: the value of a ``: name value`` comment line (Sokuji sends its
  ``server-timing`` at the end of a stream this way).
- ``pieces(doc)``: the text each choice of a chunk carries (completions' ``text`` or chat's
  ``delta.content``), empty pieces left out; ``piece(doc)`` the first choice's.
- ``completion_tokens(doc)``: ``usage.completion_tokens`` where the chunk carries usage.
"""

from __future__ import annotations

import json
from typing import Any

DONE = b"[DONE]"


def data(line: bytes | str) -> dict[str, Any] | None:
    """The JSON object of one ``data:`` line (surrounding whitespace ignored)."""
    raw = line.encode() if isinstance(line, str) else line
    raw = raw.strip()
    if not raw.startswith(b"data:"):
        return None
    payload = raw[5:].strip()
    if payload == DONE or not payload.startswith(b"{"):
        return None
    try:
        doc = json.loads(payload)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def is_done(line: bytes | str) -> bool:
    """Whether the line is the stream's ``data: [DONE]``."""
    raw = line.encode() if isinstance(line, str) else line
    raw = raw.strip()
    return raw.startswith(b"data:") and raw[5:].strip() == DONE


def comment(line: bytes | str, name: str) -> str | None:
    """The value of a ``: <name> <value>`` comment line, else None."""
    text = (line.decode() if isinstance(line, bytes) else line).strip()
    prefix = f": {name} "
    return text[len(prefix):] if text.startswith(prefix) else None


def pieces(doc: dict[str, Any]) -> list[str]:
    """Every choice's non-empty text in one chunk, in choice order."""
    out: list[str] = []
    for choice in doc.get("choices") or ():
        text = choice.get("text")
        if text is None:
            text = (choice.get("delta") or {}).get("content")
        if text:
            out.append(text)
    return out


def piece(doc: dict[str, Any]) -> str | None:
    """The first choice's non-empty text, else None."""
    choices = doc.get("choices") or ()
    if not choices:
        return None
    first = choices[0]
    text = first.get("text")
    if text is None:
        text = (first.get("delta") or {}).get("content")
    return text or None


def completion_tokens(doc: dict[str, Any]) -> int | None:
    """``usage.completion_tokens`` of a chunk that carries usage."""
    usage = doc.get("usage")
    if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
        return int(usage["completion_tokens"])
    return None
