"""Task classes that break their contract, each one way: the server must answer a 502
naming the model (or refuse the class at start-up), never a 500 or a hang."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np


class WrongWidth:
    """Declares 8-wide rows, returns 4-wide ones after the first call."""

    task = "embeddings"

    def describe(self) -> dict[str, Any]:
        return {"inputs": [{"name": "input", "datatype": "BYTES", "shape": [-1]}],
                "outputs": [{"name": "embedding", "datatype": "FP32", "shape": [-1, 8]}]}

    def predict(self, inputs: list[dict[str, np.ndarray]]) -> list[dict[str, Any]]:
        return [{"embedding": np.zeros((len(i["input"]), 4), np.float32)} for i in inputs]


class NoRows:
    """Its rows are one flat vector: its width cannot be measured."""

    task = "embeddings"

    def predict(self, inputs: list[dict[str, np.ndarray]]) -> list[dict[str, Any]]:
        return [{"embedding": np.zeros(4, np.float32)} for _ in inputs]


class Streams:
    """An embeddings class that yields: refused at start-up."""

    task = "embeddings"

    def predict(self, inputs: list[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
        yield [{"embedding": np.zeros((1, 4), np.float32)} for _ in inputs]


class Raises:
    task = "chat"

    def predict(self, inputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        raise RuntimeError("the rules engine broke")


class NotText:
    """Yields a number where the text should be, after one good step."""

    task = "chat"

    def predict(self, inputs: list[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
        yield [{"text": "fine"} for _ in inputs]
        yield [{"text": 42} for _ in inputs]


class Overclaims:
    """Says it made more tokens than it was allowed."""

    task = "chat"

    def predict(self, inputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{"text": "x", "completion_tokens": doc["max_tokens"] + 1} for doc in inputs]
