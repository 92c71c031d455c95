"""The one ``Server-Timing`` renderer (W3C): entries of (name, milliseconds or None, a word
or None). An encoder's Timeline and a generation's Timing both produce such entries."""

from __future__ import annotations

from collections.abc import Iterable

Entry = tuple[str, float | None, str | None]


def render(entries: Iterable[Entry]) -> str:
    """``name;dur=1.234;desc="word"`` for each entry, comma-separated."""
    parts = []
    for name, ms, desc in entries:
        part = name if ms is None else f"{name};dur={ms:.3f}"
        parts.append(f'{part};desc="{desc}"' if desc else part)
    return ", ".join(parts)
