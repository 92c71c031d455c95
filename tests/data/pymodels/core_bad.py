"""Python models whose code breaks its contract, for the tests of what a client then gets
(``tests/integration/test_python_models.py``): ``Bad`` answers as its requests' parameter
``how`` says (a result too few, a result that is no dict, a value that is no array, an
object array of ints, a list that is no tensor, a dtype V2 has no name for, an exception
whose text must not reach the client), else correctly; ``FailsSetup`` cannot start."""

from __future__ import annotations

from typing import Any

import numpy as np


class Bad:
    def predict(self, inputs: list[dict[str, Any]]) -> Any:
        how = {str(i.get("how", "")) for i in inputs}
        n = len(inputs)
        if "count" in how:
            return [{"y": np.zeros(1, np.float32)}] * (n - 1)
        if "not-a-list" in how:
            return {"y": np.zeros(1, np.float32)}
        if "not-a-dict" in how:
            return [1.0] * n
        if "set" in how:
            return [{"y": {1, 2}}] * n
        if "object-ints" in how:
            return [{"y": np.array([1, 2], dtype=object)}] * n
        if "ragged" in how:
            return [{"y": [[1.0], [1.0, 2.0]]}] * n
        if "complex" in how:
            return [{"y": np.zeros(2, np.complex64)}] * n
        if "raise" in how:
            raise ValueError("secret of another tenant")
        return [{"y": np.full(1, float(n), np.float32)}] * n


class FailsSetup:
    def setup(self, options: dict) -> None:
        raise RuntimeError("no weights here")

    def predict(self, inputs: list[dict]) -> list[dict]:
        return [{}] * len(inputs)
