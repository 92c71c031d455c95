"""Python models of the other forms a user writes, for the kind's tests: ``Echo`` (each
request's values back: its arrays as they came, and what type each value reached it as;
counts its calls), ``Described`` (``async def predict`` and ``describe()``), ``Options``
(the options ``setup`` received), and ``double``, a plain function entry."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import numpy as np

CALLS: list[int] = []
"""One entry per batch ``Echo`` ran (the tests read how many reached the code)."""


class Echo:
    def predict(self, inputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        CALLS.append(len(inputs))
        out = []
        for values in inputs:
            result: dict[str, Any] = {k: v for k, v in values.items()
                                      if isinstance(v, np.ndarray)}
            result["types"] = ",".join(f"{k}={type(v).__name__}"
                                       for k, v in sorted(values.items()))
            out.append(result)
        return out


class Deterministic(Echo):
    deterministic = True


class Described:
    """y = 2x, for x of two columns; declares it."""

    def describe(self) -> dict:
        return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 2]}],
                "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 2]}]}

    async def predict(self, inputs: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        await asyncio.sleep(0)
        return [{"y": i["x"] * 2} for i in inputs]


class Options:
    def setup(self, options: dict) -> None:
        self.options = dict(options)

    def predict(self, inputs: list[dict]) -> list[dict]:
        text = msgspec.json.encode(self.options, order="sorted").decode()
        return [{"options": text} for _ in inputs]


def double(x: np.ndarray) -> dict[str, np.ndarray]:
    return {"y": x * 2}
