"""benchmarks/goodput.py's own logic: the limit from raw call times, a rate's verdict, and the
search for the highest rate meeting the SLO, against synthetic servers whose answer is known."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from _goodput_model import CallTimes, analyse, latencies_s, meets, raw_ms_per_item
from _goodput_raw import derive_limit
from _goodput_search import Search, judge

from sokuji.bench.engine import Record, RunResult

SLO_MS = 100.0


def fake_run(rate: float, slow_ms: float | None, *, seconds: float = 10.0,
             errors: int = 0, lag_ms: float = 0.0) -> tuple[RunResult, dict[str, Any]]:
    """``rate`` requests a second, evenly spaced, 20 ms each; with ``slow_ms``, every 20th
    takes that long instead (5% > p99); the first ``errors`` answers are 503s; with
    ``lag_ms``, every 10th is sent that late."""
    n = int(rate * seconds)
    records = []
    for i in range(n):
        t = i / rate
        latency_ms = slow_ms if slow_ms is not None and i % 20 == 0 else 20.0
        sent = t + (lag_ms / 1e3 if i % 10 == 0 else 0.0)
        rec = Record(intended_s=t, sent_s=sent, done_s=t + latency_ms / 1e3, status=200)
        if i < errors:
            rec.status, rec.error = 503, "http_503"
        records.append(rec)
    probe = {"cpu_s": seconds / 2, "wall_s": seconds, "requests": n}
    return RunResult(records, 0.0, seconds, 0.1, "open"), probe


def search_args(**over: Any) -> argparse.Namespace:
    base = {"max_steps": 12, "factor": 1.25, "tolerance": 0.04, "min_rate": 1.0,
            "max_reruns": 2}
    return argparse.Namespace(**{**base, **over})


def drive(search: Search, slow_at: Any) -> None:
    while (nxt := search.next_rate()) is not None:
        rate, confirm = nxt
        search.record(rate, fake_run(rate, slow_at(rate, confirm)), confirm, SLO_MS)


def test_judge_counts_goodput_within_the_slo_and_fails_on_any_error() -> None:
    ok = judge([fake_run(50, None)], 50, SLO_MS)
    assert ok["ok"] and ok["good"] == 500 and ok["goodput_rps"] == pytest.approx(50, rel=0.01)
    assert ok["server_busy"] == pytest.approx(0.5)
    slow = judge([fake_run(50, 300.0)], 50, SLO_MS)
    assert not slow["ok"] and slow["reason"] == "p99" and slow["good"] == 475
    failed = judge([fake_run(50, None, errors=1)], 50, SLO_MS)
    assert not failed["ok"] and failed["reason"] == "errors" and failed["good"] == 499


def test_the_search_brackets_the_capacity_within_the_tolerance() -> None:
    capacity = 123.0
    search = Search("s", 50.0, search_args())
    drive(search, lambda rate, _: None if rate <= capacity else 400.0)
    out = search.result(SLO_MS)
    best = out["max_rate_meeting_slo"]
    assert capacity / 1.04 <= best <= capacity
    assert out["best"]["confirmed"] and out["best"]["runs"] == 2
    assert search.steps[-1]["confirmation"]


def test_the_search_goes_down_when_the_start_fails() -> None:
    search = Search("s", 200.0, search_args())
    drive(search, lambda rate, _: None if rate <= 90 else 400.0)
    assert 90 / 1.04 <= search.result(SLO_MS)["max_rate_meeting_slo"] <= 90


def test_a_failed_confirmation_sends_the_search_below_that_rate() -> None:
    lucky: list[float] = []

    def slow_at(rate: float, confirm: bool) -> float | None:
        if rate <= 100:
            return None
        if rate <= 120 and not confirm:  # passes once by luck, fails when run again
            lucky.append(rate)
            return None
        return 400.0

    search = Search("s", 80.0, search_args(max_steps=40))
    drive(search, slow_at)
    out = search.result(SLO_MS)
    assert lucky and out["max_rate_meeting_slo"] <= 100 < min(lucky)
    assert out["best"]["confirmed"]


def test_a_failure_the_client_lag_explains_is_run_again_a_bounded_number_of_times() -> None:
    search = Search("s", 100.0, search_args(max_steps=1, max_reruns=2))
    # every 10th request sent 30 ms late, every 20th 110 ms slow: over the SLO by less than the lag
    for expected_discarded in (True, True, False):
        rate, confirm = search.next_rate() or (0.0, True)
        assert rate == 100.0 and not confirm
        step = search.record(rate, fake_run(rate, 110.0, lag_ms=30.0), confirm, SLO_MS)
        assert step["client_lagged"] and not step["ok"]
        assert bool(step.get("discarded")) is expected_discarded
    assert search.next_rate() is None and search.hi == 100.0  # the third run's verdict stands
    # a miss far beyond the lag, or a pass, is not run again
    far = Search("s", 100.0, search_args(max_steps=1))
    far.record(100.0, fake_run(100.0, 400.0, lag_ms=30.0), False, SLO_MS)
    passed = Search("s", 100.0, search_args(max_steps=1))
    passed.record(100.0, fake_run(100.0, None, lag_ms=30.0), False, SLO_MS)
    assert far.reruns == passed.reruns == 0 and far.hi == passed.lo == 100.0
    assert not judge([fake_run(100.0, None, lag_ms=1.0)], 100.0, SLO_MS)["client_lagged"]


def test_a_failure_while_another_process_took_the_server_core_is_run_again() -> None:
    search = Search("s", 100.0, search_args(max_steps=2))
    run, probe = fake_run(100.0, 400.0)
    step = search.record(100.0, (run, {**probe, "other_cpu_s": 3.0}), False, SLO_MS)
    assert step["disturbed"] and step["discarded"] and search.hi is None
    assert search.next_rate() == (100.0, False)
    step = search.record(100.0, (run, {**probe, "other_cpu_s": 0.2}), False, SLO_MS)
    assert not step["disturbed"] and not step.get("discarded") and search.hi == 100.0


def test_out_of_steps_the_best_pass_is_reported_unconfirmed() -> None:
    search = Search("s", 10.0, search_args(max_steps=3))
    drive(search, lambda rate, _: None)
    out = search.result(SLO_MS)
    assert len(search.steps) == 3 and out["best"]["confirmed"] is False


def test_the_limit_is_the_best_batch_whose_doubled_p99_fits() -> None:
    # t_B = 2 + 1.5 B ms, 50 calls per size, one of them 1.2 x slower (it is the p99): B = 24
    # gives p99 45.6 ms (fits: 2 x 45.6 <= 100), B = 28 gives 52.8 ms (does not), although
    # its mean (44 ms) alone would fit.
    samples = {bs: [2 + 1.5 * bs] * 49 + [1.2 * (2 + 1.5 * bs)] for bs in (1, 8, 24, 28, 32)}
    limit = derive_limit(samples, SLO_MS)
    assert limit["batch_size"] == 24
    assert limit["by_batch_size"]["24"]["p99_ms"] == pytest.approx(45.6)
    assert limit["items_per_s"] == pytest.approx(24 / (38 * 1.004) * 1e3)
    assert raw_ms_per_item(limit, 1.0) == pytest.approx(3.5 * 1.004)
    assert raw_ms_per_item(limit, 16.0) == pytest.approx((2 + 1.5 * 16) * 1.004 / 16)
    with pytest.raises(RuntimeError, match="no batch size fits"):
        derive_limit({1: [60.0] * 10}, SLO_MS)


def test_the_ideal_server_batches_what_waits_when_the_core_frees() -> None:
    calls = CallTimes({1: [10.0], 2: [20.0], 4: [40.0]}, seed=0)  # 10 ms an item, no jitter
    lat = latencies_s(np.array([0.0, 0.001, 0.002, 0.1]), calls, max_batch=8, overhead_ms=1.0)
    # alone at 0 (11 ms); the next two wait, then go together (2 x 11 ms); alone at 0.1
    np.testing.assert_allclose(lat, [0.011, 0.032, 0.031, 0.011])
    capped = latencies_s(np.array([0.0, 0.001, 0.002, 0.003]), calls, max_batch=2,
                         overhead_ms=0.0)
    # at most two at once: the third waiter goes after the pair
    np.testing.assert_allclose(capped, [0.010, 0.029, 0.028, 0.037])


def test_a_cost_per_request_lowers_the_ideal_rate_and_the_budget_reaches_the_share() -> None:
    samples = {bs: [2.0 + 1.25 * bs] for bs in (1, 2, 4, 8, 16, 32)}
    limit_rps = 32 / 42 * 1e3  # 2 x 42 ms fits a 100 ms SLO
    out = analyse(samples, limit_rps, 32, SLO_MS, {"a": 0.1, "b": 0.3}, 0.9,
                  seconds=10.0, seeds=1)
    rates = [out["ideal_rps"], out["with_overhead"]["a"]["rps"],
             out["with_overhead"]["b"]["rps"]]
    assert rates == sorted(rates, reverse=True) and rates[0] < 1e3 / 1.25
    budget = out["overhead_budget_ms"]
    assert budget is not None and 0 < budget < 0.3
    run = {"seconds": 10.0, "warmup_s": 2.0, "seeds": 1}
    calls = CallTimes(samples, seed=0)
    assert meets(0.9 * limit_rps, calls, 32, budget, SLO_MS, **run)
    assert not meets(0.9 * limit_rps, calls, 32, budget + 0.02, SLO_MS, **run)
