"""Open-loop arrival schedules: intended send times, fixed in advance by a seed.

``constant`` sends every 1/rate seconds; ``poisson`` draws exponential gaps; ``gamma`` draws
gamma gaps with shape ``burstiness`` and the same mean 1/rate (burstiness 1 is Poisson, below 1
is burstier, above 1 smoother; the convention of vLLM's and GenAI-Perf's benchmarks).
"""

from __future__ import annotations

import enum

import numpy as np


class Arrivals(enum.StrEnum):
    CONSTANT = "constant"
    POISSON = "poisson"
    GAMMA = "gamma"


def intended_times(rate: float, arrivals: Arrivals, seed: int, *, duration_s: float | None = None,
                   count: int | None = None, burstiness: float = 1.0) -> np.ndarray:
    """Send offsets in seconds from the start, ascending; bounded by ``duration_s`` or
    ``count`` (at least one of them)."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if duration_s is None and count is None:
        raise ValueError("give duration_s or count")
    n = count if count is not None else int(np.ceil(rate * duration_s * 1.5)) + 16  # type: ignore[operator]
    rng = np.random.default_rng(seed)
    if arrivals is Arrivals.CONSTANT:
        gaps = np.full(n, 1.0 / rate)
    elif arrivals is Arrivals.POISSON:
        gaps = rng.exponential(1.0 / rate, n)
    else:
        if burstiness <= 0:
            raise ValueError(f"burstiness must be > 0, got {burstiness}")
        gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), n)
    times = np.concatenate(([0.0], np.cumsum(gaps[:-1])))
    if duration_s is not None:
        times = times[times < duration_s]
    return times[:count] if count is not None else times
