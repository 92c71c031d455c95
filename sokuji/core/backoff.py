"""How long to wait before trying again: exponential backoff, capped, with jitter.

The wait after the n-th failure in a row (n from 1) is ``base_s * factor ** (n - 1)``, at
least ``floor_s`` where the other side said how long (its Retry-After), at most ``cap_s``;
then times a factor drawn uniformly from ``[1, 1 + jitter]``, so that clients refused
together do not come back together. The randomness comes from the injected ``rng``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Backoff:
    base_s: float
    cap_s: float
    factor: float = 2.0
    jitter: float = 0.0
    """The most added at random, as a fraction of the wait (0: none); a capped wait can
    exceed ``cap_s`` by it."""
    rng: random.Random = field(default_factory=random.Random, compare=False, repr=False)

    def delay_s(self, failures: int, floor_s: float = 0.0) -> float:
        """The wait after ``failures`` failures in a row (fewer than 1 counts as 1)."""
        try:
            grown = self.base_s * self.factor ** (max(1, failures) - 1)
        except OverflowError:
            grown = math.inf
        delay = min(self.cap_s, max(floor_s, grown))
        return delay * self.rng.uniform(1.0, 1.0 + self.jitter) if self.jitter else delay

    def delays(self) -> Iterator[float]:
        """The waits after the first failure, the second, and so on, without end."""
        failures = 0
        while True:
            failures += 1
            yield self.delay_s(failures)
