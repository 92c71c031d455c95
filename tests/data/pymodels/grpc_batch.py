"""A Python model for the gRPC tests: each request's ``x`` back, with ``n``, the size of the
batch it ran in, after a pause (``pause_s``): requests sent meanwhile queue and run as the
next batch together, whatever protocol each came by."""

from __future__ import annotations

import time

import numpy as np


class BatchSize:
    def setup(self, options: dict) -> None:
        self.pause_s = float(options.get("pause_s", 0.3))

    def predict(self, inputs: list[dict]) -> list[dict]:
        time.sleep(self.pause_s)
        return [{"x": values["x"], "n": np.array([len(inputs)], dtype=np.int64)}
                for values in inputs]
