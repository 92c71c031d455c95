"""Chat classes (``task = "chat"``), rules-based: ``Reverser`` answers the last user
message's words in reverse order, one word a step (a generator: streamed as SSE deltas);
``Echo`` answers it whole, with its own token counts. Both honour ``max_tokens`` (a word a
token) and ``stop``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def _last_user(doc: dict[str, Any]) -> str:
    if "prompt" in doc:
        return str(doc["prompt"])
    return next((m.get("content") or "" for m in reversed(doc["messages"])
                 if m.get("role") == "user"), "")


class Reverser:
    task = "chat"
    max_tokens = 64

    def predict(self, inputs: list[dict[str, Any]]) -> Iterator[list[dict[str, Any] | None]]:
        words = [_last_user(doc).split()[::-1] for doc in inputs]
        for step in range(max(map(len, words), default=0)):
            out: list[dict[str, Any] | None] = []
            for doc, ws in zip(inputs, words, strict=True):
                if step >= len(ws) or ws[step] in doc["stop"]:
                    out.append(None)
                    continue
                out.append({"text": ws[step] if step == 0 else " " + ws[step]})
            if all(o is None for o in out):
                return
            yield out


class Echo:
    task = "chat"
    max_tokens = 32

    def predict(self, inputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for doc in inputs:
            words = _last_user(doc).split()
            kept = words[:doc["max_tokens"]]
            out.append({"text": " ".join(kept), "prompt_tokens": len(words),
                        "completion_tokens": len(kept),
                        "finish_reason": "length" if len(kept) < len(words) else "stop"})
        return out
