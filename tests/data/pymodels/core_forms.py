"""Python models of the other forms a user writes, for the kind's tests: ``Echo`` (each
request's values back: its arrays as they came, and what type each value reached it as;
counts its calls), ``Described`` (``async def predict`` and ``describe()``), ``Options``
(the options ``setup`` received), ``PerRequest`` (refuses or fails one request of its
batch by returning an exception in its place), and ``double`` / ``halve``, plain function
entries (``halve`` raises for a negative ``x``: that request's failure alone)."""

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


def halve(x: np.ndarray) -> dict[str, np.ndarray]:
    if (x < 0).any():
        raise ValueError("secret: negative input")
    return {"y": x / 2}


class PerRequest:
    """Each request's ``how``: ``ok`` (its ``x`` back), ``refuse`` (an ``InvalidInput`` in
    its place: a 400 for that request) or ``fail`` (a ``ValueError`` in its place)."""

    def predict(self, inputs: list[dict[str, Any]]) -> list[Any]:
        from sokuji.errors import InvalidInput

        out: list[Any] = []
        for values in inputs:
            how = values.get("how", "ok")
            out.append(InvalidInput("this request is refused", param="how")
                       if how == "refuse" else ValueError("secret") if how == "fail"
                       else {"x": values.get("x", np.zeros(1, np.float32))})
        return out
