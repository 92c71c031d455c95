"""Stages a Python model reports: ``with sokuji.stage("features"): ...`` inside ``predict``
times that part of the batch, and each of the batch's requests shows it in its
``Server-Timing`` (``model.features;dur=1.234``) after its own stages.

A stage outside a batch (in ``setup``, in a test) is timed for nobody and costs two clock
reads. What one batch may report is bounded: at most ``MAX_STAGES`` stages, each name cut to
``MAX_NAME`` characters of ``[A-Za-z0-9_.-]`` (a header is no place for the model's text).
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from contextvars import ContextVar

MAX_STAGES = 16
MAX_NAME = 32
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")

Stages = list[tuple[str, float]]
"""(name, milliseconds), in the order they ended."""

_current: ContextVar[Stages | None] = ContextVar("sokuji_stages", default=None)


@contextlib.contextmanager
def stage(name: str) -> Iterator[None]:
    """Time the block as the stage ``name`` of the batch being run."""
    start = time.perf_counter_ns()
    try:
        yield
    finally:
        stages = _current.get()
        if stages is not None and len(stages) < MAX_STAGES:
            clean = _UNSAFE.sub("_", str(name))[:MAX_NAME] or "stage"
            stages.append((clean, (time.perf_counter_ns() - start) / 1e6))


@contextlib.contextmanager
def collecting() -> Iterator[Stages]:
    """Collect the stages reported inside the block (one batch's run)."""
    stages: Stages = []
    token = _current.set(stages)
    try:
        yield stages
    finally:
        _current.reset(token)
