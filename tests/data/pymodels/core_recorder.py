"""A Python model that records every batch it is given and can be held: a request whose
parameter ``hold`` is true waits inside ``predict`` until the test opens the gate of its
model (``gate(key)``), so requests sent meanwhile queue behind it. The tests
(``tests/integration/test_python_models.py``) load it by its module path, so they share
its module, and read what it saw (``batches(key)``) instead of guessing from timings.

A request may also ask its batch to fail (``fail``: ``ValueError`` with a text that must
never reach a client) or tag itself (``tag``) to be told apart in the records."""

from __future__ import annotations

import threading

import numpy as np

_BATCHES: dict[str, list[list[str]]] = {}
_GATES: dict[str, threading.Event] = {}
HOLD_S = 30.0
"""The most a held request waits for its gate (a failed test never hangs the suite)."""


def batches(key: str) -> list[list[str]]:
    """The tags of each batch the model ``key`` ran, in order."""
    return _BATCHES.setdefault(key, [])


def gate(key: str) -> threading.Event:
    return _GATES.setdefault(key, threading.Event())


class Recorder:
    def setup(self, options: dict) -> None:
        self.key = str(options["key"])
        self.batches = batches(self.key)
        self.gate = gate(self.key)

    def predict(self, inputs: list[dict]) -> list[dict]:
        tags = [str(i.get("tag", "")) for i in inputs]
        self.batches.append(tags)
        if any(i.get("hold") for i in inputs):
            self.gate.wait(HOLD_S)
        if any(i.get("fail") for i in inputs):
            raise ValueError("secret of another tenant")
        return [{"tag": np.array([t], dtype=object), "batch": np.array([len(inputs)], np.int64)}
                for t in tags]
