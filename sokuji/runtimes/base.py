"""The small interface every runtime implements, and the plain data it exchanges.

The batcher and the server see only this interface. A runtime is loaded once, warmed up once,
then called from worker threads: ``preprocess`` per request, on the event loop for short
inputs and in a worker thread for long ones (so it must be thread-safe, and bound its own cost
however long a text is), ``run_batch`` in a worker thread (heavy; the runtime must release
the GIL while it computes). ``close`` may be called while a ``preprocess`` still runs in its
thread (a cancelled request does not stop it): it must not free what ``preprocess`` uses, or
must wait for it first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str
    """KServe V2 datatype: BYTES, FP32, INT64, ..."""
    shape: tuple[int, ...]
    """-1 marks a variable dimension."""


@dataclass(frozen=True)
class ModelMetadata:
    platform: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]


@dataclass(frozen=True)
class Prepared:
    """A request's inputs after preprocessing, ready to be batched.

    ``num_items`` rows, each needing ``length`` positions once padded; ``num_tokens`` is the
    unpadded count (reported as usage).
    """

    data: Any
    num_items: int
    length: int
    num_tokens: int


class Runtime(Protocol):
    def load(self) -> None:
        """Load weights and build sessions. Raises ``ConfigError`` on a bad model option."""

    def warmup(self) -> None:
        """Run representative batches so the first real request pays no one-off cost."""

    def describe(self) -> ModelMetadata: ...

    def preprocess(self, texts: Sequence[str]) -> Prepared:
        """Tokenise or otherwise prepare one request's items. Cheap for short inputs (it runs
        on the event loop); bounded for long ones (it reads a text only as far as the model
        does, or refuses it with ``InvalidInput``)."""

    def run_batch(self, batch: Sequence[Prepared]) -> list[np.ndarray]:
        """Run several requests' items together.

        Returns one array per element of ``batch``, in the same order, each with that element's
        ``num_items`` rows. Raises ``RuntimeFailed`` (translated from the engine's own error).
        """

    def close(self) -> None: ...
