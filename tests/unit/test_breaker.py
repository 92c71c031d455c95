"""The per-target circuit breaker (sokuji/routing/breaker.py) on a fake clock: closed -> open
after N failures in a row, open skips with Retry-After, exactly one half-open probe, success
closes, a failed probe doubles the cool-down up to the cap, a target's Retry-After opens at
once, release frees the probe. (The Retry-After header: test_retry_after.py.)"""

from __future__ import annotations

import logging

import pytest

from sokuji.routing.breaker import Breaker, BreakerState
from sokuji.routing.config import BreakerOptions


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(failures: int = 3, cooldown_s: float = 5.0, max_cooldown_s: float = 60.0
         ) -> tuple[Breaker, Clock, list[tuple[str, BreakerState]]]:
    clock = Clock()
    moves: list[tuple[str, BreakerState]] = []
    breaker = Breaker("far", BreakerOptions(failures=failures, cooldown_s=cooldown_s,
                                            max_cooldown_s=max_cooldown_s),
                      clock=clock, on_transition=lambda n, s: moves.append((n, s)))
    return breaker, clock, moves


def test_opens_after_n_failures_in_a_row_and_a_success_resets_the_count() -> None:
    b, _, moves = make(failures=3)
    assert b.state is BreakerState.CLOSED and b.retry_after_s() == 0
    b.failure()
    b.failure()
    b.success()  # not in a row any more
    b.failure()
    b.failure()
    assert b.state is BreakerState.CLOSED and b.acquire()
    b.failure()
    assert b.state is BreakerState.OPEN
    assert moves == [("far", BreakerState.OPEN)]


def test_open_skips_with_retry_after_until_the_cooldown_is_over() -> None:
    b, clock, _ = make(failures=1, cooldown_s=5.0)
    b.failure()
    assert not b.acquire()
    assert b.retry_after_s() == 5
    clock.t += 0.2
    assert b.retry_after_s() == 5  # ceil(4.8)
    clock.t += 4.0
    assert b.retry_after_s() == 1 and not b.acquire()  # ceil(0.8), never 0 while open
    clock.t += 0.8
    assert b.state is BreakerState.HALF_OPEN and b.retry_after_s() == 0


def test_half_open_lets_exactly_one_probe_through_and_its_success_closes() -> None:
    b, clock, moves = make(failures=1, cooldown_s=5.0)
    b.failure()
    clock.t += 5.0
    assert b.acquire()  # the probe
    assert [b.acquire() for _ in range(5)] == [False] * 5
    assert b.retry_after_s() == 1  # the probe is out
    b.success()
    assert b.state is BreakerState.CLOSED and all(b.acquire() for _ in range(3))
    assert [s for _, s in moves] == [BreakerState.OPEN, BreakerState.HALF_OPEN,
                                     BreakerState.CLOSED]


def test_a_failed_probe_doubles_the_cooldown_up_to_the_cap_and_success_resets_it() -> None:
    b, clock, _ = make(failures=2, cooldown_s=5.0, max_cooldown_s=30.0)
    b.failure()
    b.failure()
    seen = []
    for _ in range(5):
        seen.append(b.retry_after_s())
        clock.t += seen[-1]
        assert b.acquire()
        b.failure()  # the probe fails
    assert seen == [5, 10, 20, 30, 30]
    clock.t += 30
    assert b.acquire()
    b.success()
    assert b.cooldown_s == 5.0
    b.failure()
    b.failure()
    assert b.retry_after_s() == 5  # back to the configured cool-down


def test_the_targets_retry_after_opens_at_once_for_that_long_capped() -> None:
    b, clock, moves = make(failures=3, cooldown_s=5.0, max_cooldown_s=60.0)
    b.failure(retry_after_s=12.0)  # one 429 with Retry-After: 12
    assert b.state is BreakerState.OPEN and b.retry_after_s() == 12
    clock.t += 12
    assert b.acquire()
    b.success()
    b.failure(retry_after_s=3600.0)
    assert b.retry_after_s() == 60  # capped
    # A straggler's longer Retry-After while open extends it; a shorter one does not.
    clock.t += 50
    b.failure(retry_after_s=1.0)
    assert b.retry_after_s() == 10
    b.failure(retry_after_s=30.0)
    assert b.retry_after_s() == 30
    assert [s for _, s in moves].count(BreakerState.OPEN) == 2


@pytest.mark.parametrize("value", [None, 0.0, -3.0, float("nan"), float("inf")])
def test_a_useless_retry_after_counts_as_an_ordinary_failure(value: float | None) -> None:
    b, _, _ = make(failures=2)
    b.failure(retry_after_s=value)
    assert b.state is BreakerState.CLOSED
    b.failure(retry_after_s=value)
    assert b.state is BreakerState.OPEN and b.retry_after_s() == 5


def test_release_frees_the_probe_and_counts_nothing() -> None:
    b, clock, _ = make(failures=1)
    b.failure()
    clock.t += 5
    assert b.acquire() and not b.acquire()
    b.release()  # the probe's client went away
    assert b.state is BreakerState.HALF_OPEN
    assert b.acquire() and not b.acquire()
    b.success()
    assert b.state is BreakerState.CLOSED
    b.release()  # harmless when closed
    assert b.state is BreakerState.CLOSED and b.failures == 0


def test_a_probe_that_never_reports_is_replaced_after_max_cooldown() -> None:
    b, clock, _ = make(failures=1, cooldown_s=5.0, max_cooldown_s=60.0)
    b.failure()
    clock.t += 5
    assert b.acquire()  # this probe's report is lost
    clock.t += 59
    assert not b.acquire()
    clock.t += 1
    assert b.acquire() and not b.acquire()


def test_a_straggler_success_while_open_does_not_close_it() -> None:
    b, clock, _ = make(failures=1, cooldown_s=5.0)
    b.failure(retry_after_s=20.0)
    b.success()  # an attempt that started before the target asked to wait
    assert b.state is BreakerState.OPEN and b.retry_after_s() == 20
    clock.t += 20
    assert b.state is BreakerState.HALF_OPEN
    b.success()  # a success while half-open closes, probe or not
    assert b.state is BreakerState.CLOSED


def test_each_transition_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    b, clock, moves = make(failures=1)
    with caplog.at_level(logging.INFO, logger="sokuji.routing.breaker"):
        b.failure()
        b.failure()  # a straggler while open: no new line
        for _ in range(3):
            assert b.state is BreakerState.OPEN
        clock.t += 5
        for _ in range(3):
            assert b.state is BreakerState.HALF_OPEN
        b.acquire()
        b.success()
    levels = [(r.levelno, r.getMessage().split(":")[0]) for r in caplog.records]
    assert levels == [(logging.WARNING, "breaker far open"),
                      (logging.INFO, "breaker far half-open"),
                      (logging.INFO, "breaker far closed")]
    assert len(moves) == 3
    assert b.snapshot()["state"] == "closed"
