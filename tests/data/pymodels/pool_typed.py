"""A model with typed inputs and outputs (msgspec records), for the process pool's tests:
records of a class defined in the user's own file cross the pipe both ways."""

from __future__ import annotations

import msgspec


class Point(msgspec.Struct):
    x: float
    y: float


class Norm(msgspec.Struct):
    length: float
    label: str


class Typed:
    def predict(self, inputs: list[Point]) -> list[Norm]:
        return [Norm(length=(p.x * p.x + p.y * p.y) ** 0.5, label=f"{p.x},{p.y}")
                for p in inputs]
