"""The small interface every encoder runtime implements (the plain data it exchanges lives in
``core``: ``Prepared``, ``ModelMetadata``, ``TensorSpec``).

``kinds/encoder/model.py`` wraps a runtime and its batcher into a served model. A runtime is
loaded once, warmed up once, then called: ``preprocess`` per request, on the event loop for
short inputs and in a worker thread for long ones (so it must be thread-safe, and bound its
own cost however long a text is), ``run_batch`` in a worker thread (heavy; the runtime must
release the GIL while it computes). ``close`` may be called while a ``preprocess`` still runs
in its thread (a cancelled request does not stop it): it must not free what ``preprocess``
uses, or must wait for it first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from sokuji.core.model import ModelMetadata, TensorSpec
from sokuji.core.request import Prepared

__all__ = ["ModelMetadata", "Prepared", "Runtime", "TensorSpec"]


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
