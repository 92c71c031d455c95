"""A streaming model for the process pool's tests: each request's ``n`` steps, one partial
result per request and step (None once a request has no more); ``x`` comes back in the last
step, so a large array travels in a stream too."""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np


class Steps:
    def predict(self, inputs: list[dict[str, np.ndarray]]
                ) -> Iterator[list[dict[str, np.ndarray] | None]]:
        steps = max(int(item["n"]) for item in inputs)
        for i in range(steps):
            yield [{"i": np.int64(i), "pid": np.int64(os.getpid()),
                    **({"x": item["x"]} if "x" in item and i == int(item["n"]) - 1 else {})}
                   if i < int(item["n"]) else None for item in inputs]
