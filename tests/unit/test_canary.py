"""The canary controller (sokuji/routing/canary.py) on a fake clock with scripted or seeded
traffic: too few samples hold; a broken canary rolls back after ``min_failures`` errors,
before ``min_samples``; a slower one on the latency test; A/A traffic almost never rolls
back; healthy traffic is promoted through the steps; the ``on_no_traffic`` paths; after a
rollback the weight is 0 and every request goes to stable."""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable

import pytest

from sokuji.routing import canary as canary_mod
from sokuji.routing.canary import CanaryController, CanaryEvent
from sokuji.routing.config import CanaryOptions


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def opts(**kw: object) -> CanaryOptions:
    base: dict[str, object] = {"stable": "m@1", "canary": "m@2", "window_s": 10.0,
                               "min_samples": 50, "alpha": 0.001, "min_failures": 3,
                               "error_tolerance": 0.01, "p99_slack": 1.2, "seed": 7}
    base.update(kw)
    return CanaryOptions(**base)  # type: ignore[arg-type]


def make(**kw: object) -> tuple[CanaryController, Clock, list[CanaryEvent]]:
    clock = Clock()
    events: list[CanaryEvent] = []
    ctl = CanaryController("rollout", opts(**kw), clock=clock, on_event=events.append)
    return ctl, clock, events


def lognormal(median_s: float, sigma: float = 0.25) -> Callable[[random.Random], float]:
    return lambda rng: rng.lognormvariate(math.log(median_s), sigma)


LATENCY = lognormal(0.02)


def simulate(ctl: CanaryController, clock: Clock, rng: random.Random, *, rate: float,
             seconds: float, canary_err: float = 0.01, stable_err: float = 0.01,
             canary_lat: Callable[[random.Random], float] = LATENCY,
             stable_lat: Callable[[random.Random], float] = LATENCY) -> None:
    """Open-loop traffic at ``rate`` requests/s, each recorded and evaluated as the router
    does, until ``seconds`` have passed or the canary is promoted or rolled back."""
    end = clock.t + seconds
    while clock.t < end and ctl.state == "running":
        clock.t += 1.0 / rate
        arm = ctl.choose()
        err, lat = (canary_err, canary_lat) if arm == "canary" else (stable_err, stable_lat)
        ctl.record(arm, rng.random() >= err, lat(rng))
        ctl.evaluate()


def fill_stable(ctl: CanaryController, clock: Clock, n: int, errors: int = 0,
                latency_s: float = 0.02) -> None:
    for i in range(n):
        clock.t += 0.001
        ctl.record("stable", i >= errors, latency_s * (1 + (i % 10) / 100))


def test_few_samples_hold_and_never_fail() -> None:
    ctl, clock, events = make()
    fill_stable(ctl, clock, 300, errors=3)
    for _ in range(20):
        clock.t += 0.01
        ctl.record("canary", True, 0.02)
    clock.t += 20.0 - 1.0  # long enough for a step, not enough samples
    ctl.record("canary", True, 0.02)
    check = ctl.evaluate()
    assert check is not None and check.result == "hold"
    assert "needed" in check.reason and check.canary_n < 50
    assert ctl.state == "running" and ctl.weight == 5.0 and events == []


def test_a_broken_canary_rolls_back_after_min_failures_before_min_samples(
        caplog: pytest.LogCaptureFixture) -> None:
    ctl, clock, events = make()
    fill_stable(ctl, clock, 400, errors=4)
    results = []
    with caplog.at_level(logging.WARNING, logger="sokuji.routing.canary"):
        for _ in range(5):
            clock.t += 0.01
            ctl.record("canary", False, 0.001)
            check = ctl.evaluate()
            assert check is not None
            results.append(check.result)
            if ctl.state != "running":
                break
    assert results == ["hold", "hold", "fail"]  # 3 = min_failures, far below min_samples
    assert ctl.state == "rolled_back" and ctl.weight == 0.0
    assert ctl.reason.startswith("errors: canary 3/3 failed vs stable 4/400, Fisher p=")
    (event,) = events
    assert (event.kind, event.reason, event.weight) == ("rolled_back", "errors", 0.0)
    assert event.detail["check"]["error_p"] < 0.001
    (line,) = [r.getMessage() for r in caplog.records]
    assert "rolled back at 5%" in line and "3/3" in line and "p=" in line


def test_after_a_rollback_weight_is_zero_and_every_request_goes_to_stable() -> None:
    ctl, clock, _ = make()
    fill_stable(ctl, clock, 200)
    for _ in range(3):
        ctl.record("canary", False, 0.01)
    ctl.evaluate()
    assert ctl.state == "rolled_back"
    assert {ctl.choose() for _ in range(2000)} == {"stable"}
    ctl.record("canary", True, 0.01)  # ignored from now on
    clock.t += 100
    assert ctl.evaluate() is None and ctl.weight == 0.0
    snap = ctl.snapshot()
    assert (snap["state"], snap["weight"], snap["canary"]["n"]) == ("rolled_back", 0.0, 0)
    assert snap["reason"] == ctl.reason


def test_choose_follows_the_weight_with_a_seeded_rng() -> None:
    draws = [CanaryController("r", opts(seed=3)).choose() for _ in range(1)]
    ctl = CanaryController("r", opts(seed=3))
    first = [ctl.choose() for _ in range(10_000)]
    assert draws[0] == first[0]
    again = CanaryController("r", opts(seed=3))
    assert [again.choose() for _ in range(10_000)] == first  # reproducible
    assert 0.04 < first.count("canary") / len(first) < 0.06


def test_a_slower_canary_rolls_back_on_the_latency_test() -> None:
    ctl, clock, events = make()
    rng = random.Random(11)
    simulate(ctl, clock, rng, rate=200, seconds=60, canary_err=0.0, stable_err=0.0,
             canary_lat=lambda r: lognormal(0.02)(r) + 0.2)
    assert ctl.state == "rolled_back"
    assert ctl.reason.startswith("latency: ")
    (event,) = events
    check = event.detail["check"]
    assert event.reason == "latency" and check["latency_p"] < 0.001
    assert check["slow"] >= 3 and check["canary_n"] < 50  # decided before min_samples
    assert check["threshold_s"] == pytest.approx(1.2 * check["threshold_s"] / 1.2)


def test_the_latency_test_waits_for_100_stable_samples() -> None:
    ctl, clock, _ = make()
    fill_stable(ctl, clock, 99)
    for _ in range(10):
        ctl.record("canary", True, 5.0)  # very slow, but nothing to compare with yet
    check = ctl.evaluate()
    assert check is not None and check.threshold_s is None and check.slow is None
    assert check.result == "hold"
    fill_stable(ctl, clock, 1)
    check = ctl.evaluate()
    assert check is not None and check.result == "fail" and check.reason == "latency"


def test_error_rate_within_tolerance_does_not_roll_back() -> None:
    ctl, clock, _ = make(error_tolerance=0.05)
    fill_stable(ctl, clock, 2000, errors=20)  # 1%
    for i in range(100):  # 4%: worse, but within 1% + 5%
        ctl.record("canary", i % 25 != 0, 0.02)
        ctl.evaluate()
    assert ctl.state == "running"
    check = ctl.last_check
    assert check is not None and check.error_p is None  # the tolerance gate was not met


def test_healthy_traffic_is_promoted_through_every_step() -> None:
    ctl, clock, events = make(steps=(5.0, 25.0, 50.0, 100.0))
    simulate(ctl, clock, random.Random(5), rate=200, seconds=300)
    assert ctl.state == "promoted" and ctl.weight == 100.0
    assert [(e.kind, e.weight, e.reason) for e in events] == [
        ("step", 25.0, "passed"), ("step", 50.0, "passed"), ("step", 100.0, "passed"),
        ("promoted", 100.0, "passed")]
    assert all(ctl.choose() == "canary" for _ in range(100))
    # The 100% step has no live stable traffic: it is judged against the previous step's.
    assert events[-1].detail["check"]["baseline"] is True
    assert ctl.evaluate() is None


def test_each_step_lasts_at_least_a_window() -> None:
    clock = Clock()
    times: list[float] = []
    ctl = CanaryController("rollout", opts(), clock=clock,
                           on_event=lambda _: times.append(clock.t))
    simulate(ctl, clock, random.Random(9), rate=400, seconds=300)
    assert ctl.state == "promoted"
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    assert all(g >= 10.0 for g in gaps), gaps


def test_a_canary_broken_at_the_last_step_still_rolls_back() -> None:
    ctl, clock, events = make(steps=(50.0, 100.0))
    rng = random.Random(2)
    simulate(ctl, clock, rng, rate=100, seconds=12, canary_err=0.0, stable_err=0.0)
    assert ctl.weight == 100.0 and ctl.state == "running"
    simulate(ctl, clock, rng, rate=100, seconds=60, canary_err=1.0)
    assert ctl.state == "rolled_back"
    check = events[-1].detail["check"]
    assert check["baseline"] is True and 3 <= check["canary_errors"] <= 10


def test_aa_traffic_rarely_rolls_back() -> None:
    """The same error rate (1%) and latency on both arms, evaluated after every request
    through all four steps: 50 seeded runs, at most one false rollback (alpha 0.001)."""
    rolled_back = promoted = 0
    for seed in range(50):
        clock = Clock()
        ctl = CanaryController("aa", opts(seed=seed), clock=clock)
        simulate(ctl, clock, random.Random(10_000 + seed), rate=200, seconds=200)
        rolled_back += ctl.state == "rolled_back"
        promoted += ctl.state == "promoted"
    assert rolled_back <= 1
    assert rolled_back + promoted == 50


def test_on_no_traffic_hold_keeps_holding_and_reports_it(
        caplog: pytest.LogCaptureFixture) -> None:
    ctl, clock, events = make(max_hold_windows=3)
    with caplog.at_level(logging.WARNING, logger="sokuji.routing.canary"):
        for _ in range(95):  # the 1 s timer, no traffic at all
            clock.t += 1.0
            check = ctl.evaluate()
            assert check is not None and check.result == "hold"
    assert ctl.state == "running" and ctl.weight == 5.0
    assert [(e.kind, e.reason) for e in events] == [("hold", "no_traffic")] * 3  # 30 s each
    assert len(caplog.records) == 3 and "holds at 5%" in caplog.records[0].getMessage()


def test_on_no_traffic_promote_passes_the_held_steps() -> None:
    ctl, clock, events = make(max_hold_windows=2, on_no_traffic="promote")
    for _ in range(200):
        clock.t += 1.0
        ctl.evaluate()
    assert ctl.state == "promoted"
    assert [(e.kind, e.reason) for e in events] == [
        ("step", "no_traffic"), ("step", "no_traffic"), ("step", "no_traffic"),
        ("promoted", "no_traffic")]
    assert ctl.reason.startswith("no_traffic")


def test_on_no_traffic_rollback() -> None:
    ctl, clock, events = make(max_hold_windows=2, on_no_traffic="rollback")
    rng = random.Random(4)
    simulate(ctl, clock, rng, rate=5, seconds=100)  # 0.25 canary requests a second
    assert ctl.state == "rolled_back" and ctl.weight == 0.0
    (event,) = events
    assert (event.kind, event.reason) == ("rolled_back", "no_traffic")
    assert 20.0 <= clock.t <= 22.0  # two windows of holding after the first check


def test_a_pass_breaks_a_hold_streak() -> None:
    ctl, clock, events = make(max_hold_windows=2, on_no_traffic="rollback")
    fill_stable(ctl, clock, 200)
    clock.t = 15.0
    ctl.evaluate()  # hold starts
    fill_stable(ctl, clock, 200)  # live stable: a step passes only when judged on latency too
    for _ in range(60):
        ctl.record("canary", True, 0.02)
    clock.t = 16.0
    check = ctl.evaluate()
    assert check is not None and check.result == "pass"
    assert [e.kind for e in events] == ["step"]


def test_evaluate_returns_none_when_nothing_is_new_within_a_second() -> None:
    ctl, clock, _ = make()
    assert ctl.evaluate() is not None
    assert ctl.evaluate() is None
    clock.t += 0.5
    assert ctl.evaluate() is None
    ctl.record("stable", True, 0.01)
    assert ctl.evaluate() is not None
    clock.t += 1.0
    assert ctl.evaluate() is not None
    assert ctl.checks == {"pass": 0, "hold": 3, "fail": 0}


def test_windows_forget_what_is_older_than_window_s_and_are_capped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    ctl, clock, _ = make()
    for _ in range(3):
        ctl.record("canary", False, 0.01)
    clock.t += 10.5
    ctl.record("stable", True, 0.01)
    assert ctl.snapshot()["canary"] == {"n": 0, "errors": 0}  # the errors aged out
    check = ctl.evaluate()
    assert check is not None and check.result == "hold" and ctl.state == "running"
    monkeypatch.setattr(canary_mod, "MAX_WINDOW", 100)
    for i in range(250):
        ctl.record("stable", i % 2 == 0, 0.01)
    assert ctl.snapshot()["stable"] == {"n": 100, "errors": 50}


def test_record_refuses_a_bad_arm_or_latency() -> None:
    ctl, _, _ = make()
    with pytest.raises(ValueError, match="arm"):
        ctl.record("blue", True, 0.1)
    with pytest.raises(ValueError, match="latency"):
        ctl.record("canary", True, float("nan"))
