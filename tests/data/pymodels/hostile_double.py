"""The hostile suite's Python model: y = x + x for each request's FP32 tensor ``x``."""

from __future__ import annotations

import numpy as np


class Double:
    deterministic = True

    def setup(self, options: dict) -> None:
        self.factor = float(options.get("factor", 2.0))

    def predict(self, inputs: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        return [{"y": (np.asarray(i["x"], dtype=np.float32) * self.factor)} for i in inputs]
