"""A pure-Python, GIL-bound scorer (``benchmarks/python_processes.py``): each request's
``x`` (a few thousand floats) scored in a Python loop, ~2-5 ms a request on this machine's
cores, the GIL held throughout; so threads of one process cannot run two at once, and
worker processes can."""

from __future__ import annotations

import math

import numpy as np


class Scorer:
    deterministic = True

    def setup(self, options: dict) -> None:
        self.rounds = int(options.get("rounds", 12))

    def predict(self, inputs: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        out = []
        for item in inputs:
            values = item["x"].tolist()
            score = 0.0
            for r in range(self.rounds):
                for i, v in enumerate(values):
                    score += math.sin(v * (r + 1)) * (i % 7) - v * v * 1e-3
            out.append({"score": np.array([score])})
        return out
