"""The one backoff policy (sokuji/core/backoff.py): doubling from the base, a floor the other
side set, the cap, jitter from the injected RNG."""

from __future__ import annotations

import itertools
import random

from sokuji.core.backoff import Backoff


def test_doubles_from_the_base_up_to_the_cap() -> None:
    b = Backoff(base_s=0.5, cap_s=8.0)
    assert [b.delay_s(n) for n in range(1, 8)] == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert b.delay_s(0) == b.delay_s(-3) == 0.5  # fewer than one failure counts as one
    assert list(itertools.islice(Backoff(0.1, 5.0).delays(), 8)) == \
        [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]
    assert Backoff(1.0, 100.0, factor=3.0).delay_s(3) == 9.0


def test_a_floor_is_kept_within_the_cap() -> None:
    b = Backoff(base_s=0.5, cap_s=60.0)
    assert b.delay_s(1, floor_s=30) == 30.0
    assert b.delay_s(1, floor_s=3600) == 60.0
    assert b.delay_s(5, floor_s=1) == 8.0


def test_a_long_outage_does_not_overflow() -> None:
    assert Backoff(0.1, 5.0).delay_s(10_000) == 5.0


def test_jitter_comes_from_the_injected_rng() -> None:
    def waits(seed: int) -> list[float]:
        b = Backoff(base_s=1.0, cap_s=4.0, jitter=0.25, rng=random.Random(seed))
        return [b.delay_s(n) for n in range(1, 6)]

    assert waits(7) == waits(7) != waits(8)
    for n, wait in enumerate(waits(7), 1):
        low = min(4.0, 2.0 ** (n - 1))
        assert low <= wait <= low * 1.25
