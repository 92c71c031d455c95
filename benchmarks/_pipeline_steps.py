"""Steps the pipeline benchmark's server imports (``benchmarks/pipelines.py``, Part C)."""

from __future__ import annotations

import asyncio
from typing import Any

REMOTE_WAIT_S = 0.005
"""A feature store across a network: a 5 ms round trip, spent waiting (no CPU)."""


async def remote_profile(entity_id: str | None = None) -> dict[str, Any]:
    """A user profile from a store that answers after ``REMOTE_WAIT_S`` (simulated: the
    wait is what a remote lookup costs the caller; the values are fixed)."""
    await asyncio.sleep(REMOTE_WAIT_S)
    return {"expertise": "beginner", "preferred_length": "short"}
