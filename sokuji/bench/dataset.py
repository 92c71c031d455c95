"""Benchmark inputs: JSONL files, one request per line, sampled with a seed.

Each line is an object with ``text`` (embeddings, classification) or ``prompt`` (completions)
or ``messages`` (chat); any of them is accepted by every target, which takes what it needs.
Built-in datasets ship inside the package (``sokuji/bench/data``): ``short`` (~12 tokens,
search queries), ``mixed`` (5-200 tokens, log-uniform), ``long`` (~120-token passages) and
``passages`` (eight ~70-word narrative passages, which SmolLM2 repeats when asked: the
speculative-decoding benchmark's and tests' copy workload).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATA_DIR = Path(__file__).resolve().parent / "data"
BUILTIN = ("short", "mixed", "long", "passages")
GENERATED = ("short", "mixed", "long")
"""The 400-line sets ``data/make_datasets.py`` writes (``passages`` is written by hand)."""


@dataclass(frozen=True)
class Item:
    text: str
    messages: tuple[dict[str, str], ...] = ()

    @classmethod
    def from_json(cls, doc: dict[str, Any], where: str) -> Item:
        if isinstance(doc.get("messages"), list):
            messages = tuple({"role": str(m["role"]), "content": str(m["content"])}
                             for m in doc["messages"])
            return cls(text=messages[-1]["content"] if messages else "", messages=messages)
        for key in ("text", "prompt"):
            if isinstance(doc.get(key), str):
                return cls(text=doc[key])
        raise ValueError(f"{where}: each line needs 'text', 'prompt' or 'messages'")


def resolve(name_or_path: str) -> Path:
    if name_or_path in BUILTIN:
        return DATA_DIR / f"{name_or_path}.jsonl"
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"dataset {name_or_path!r}: no such file, and not one of "
                         f"{', '.join(BUILTIN)}")
    return path


def load(name_or_path: str) -> list[Item]:
    path = resolve(name_or_path)
    items = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if line.strip():
                items.append(Item.from_json(json.loads(line), f"{path}:{n}"))
    if not items:
        raise ValueError(f"dataset {path} is empty")
    return items


class Sampler:
    """Draws items in a seeded random order (a fresh permutation each pass over the data)."""

    def __init__(self, items: list[Item], seed: int) -> None:
        self.items = items
        self.rng = random.Random(seed)
        self.order: list[int] = []

    def next(self) -> Item:
        if not self.order:
            self.order = list(range(len(self.items)))
            self.rng.shuffle(self.order)
        return self.items[self.order.pop()]
