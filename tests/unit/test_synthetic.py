"""The synthetic runtime's failure and degradation options (sokuji/runtimes/synthetic.py):
validated like the others, seeded, and the bad phase starts when configured (a fake clock
for ``degrade_after_s``). Without them, the runtime behaves as before."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import msgspec
import pytest

from sokuji import config as cfg
from sokuji.errors import ConfigError, RuntimeFailed
from sokuji.runtimes.synthetic import SyntheticOptions, SyntheticRuntime


class Clock:
    def __init__(self) -> None:
        self.t = 500.0

    def __call__(self) -> float:
        return self.t


def synthetic(options: dict[str, Any],
              clock: Callable[[], float] = time.monotonic) -> SyntheticRuntime:
    return SyntheticRuntime(msgspec.convert(options, SyntheticOptions), clock=clock)


def validate(options: dict[str, Any]) -> None:
    model = cfg.ModelConfig(name="s", runtime="synthetic", options=options)
    cfg.validate(cfg.ServerConfig(models=(model,)))


def outcomes(rt: SyntheticRuntime, batches: int) -> list[bool]:
    """True for each batch that succeeded."""
    out = []
    for i in range(batches):
        try:
            rt.run_batch([rt.preprocess([f"text {i}"])])
            out.append(True)
        except RuntimeFailed:
            out.append(False)
    return out


@pytest.mark.parametrize(("key", "value"), [
    ("error_rate", 1.5), ("error_rate", -0.1), ("error_rate", "often"), ("error_rate", True),
    ("degrade_error_rate", 2), ("degrade_extra_ms", -1.0), ("degrade_after_s", "soon"),
    ("degrade_after_batches", 2.5), ("degrade_after_batches", -1),
])
def test_bad_values_are_refused_naming_the_key(key: str, value: Any) -> None:
    opts = {key: value}
    if key.startswith("degrade_after"):
        opts["degrade_error_rate"] = 1.0
    with pytest.raises(ConfigError) as info:  # when the config loads, before any build
        validate(opts)
    assert info.value.param == f"models[0].options.{key}"
    assert repr(value) in str(info.value)


@pytest.mark.parametrize("key", ["degrade_after_s", "degrade_after_batches"])
def test_a_start_without_anything_to_degrade_is_refused(key: str) -> None:
    with pytest.raises(ConfigError, match="needs degrade_error_rate or degrade_extra_ms"):
        validate({key: 3})


def test_without_the_new_options_nothing_changes() -> None:
    rt = synthetic({"base_ms": 2.0, "distribution": "exponential", "seed": 5})
    reference = random.Random(5)
    assert [rt.service_time_ms(1) for _ in range(50)] == \
        [reference.expovariate(1 / 2.0) for _ in range(50)]
    assert all(outcomes(synthetic({"base_ms": 0.0}), 50))
    assert not SyntheticRuntime().degraded()


def test_error_rate_fails_batches_with_that_probability_seeded() -> None:
    first = outcomes(synthetic({"base_ms": 0.0, "error_rate": 0.2, "seed": 1}), 1000)
    again = outcomes(synthetic({"base_ms": 0.0, "error_rate": 0.2, "seed": 1}), 1000)
    other = outcomes(synthetic({"base_ms": 0.0, "error_rate": 0.2, "seed": 2}), 1000)
    assert first == again and first != other
    assert 0.15 < first.count(False) / 1000 < 0.25
    assert all(outcomes(synthetic({"base_ms": 0.0, "error_rate": 0}), 100))
    assert not any(outcomes(synthetic({"base_ms": 0.0, "error_rate": 1}), 100))


def test_failures_do_not_change_the_service_time_draws() -> None:
    opts: dict[str, Any] = {"base_ms": 3.0, "distribution": "lognormal", "seed": 9}
    plain = synthetic(opts)
    failing = synthetic({**opts, "error_rate": 0.5})
    assert [plain.service_time_ms(2) for _ in range(100)] == \
        [failing.service_time_ms(2) for _ in range(100)]


def test_a_failing_batch_raises_what_fail_on_raises() -> None:
    rt = synthetic({"base_ms": 0.0, "error_rate": 1.0, "fail_on": "poison"})
    with pytest.raises(RuntimeFailed, match="error rate"):
        rt.run_batch([rt.preprocess(["fine"])])
    with pytest.raises(RuntimeFailed, match="poison"):
        rt.run_batch([rt.preprocess(["poison"])])


def test_degrade_after_batches() -> None:
    rt = synthetic({"base_ms": 1.0, "degrade_after_batches": 5,
                           "degrade_error_rate": 1.0, "degrade_extra_ms": 40.0})
    times = []
    for _ in range(5):
        assert not rt.degraded()
        times.append(rt.service_time_ms(1))
    assert rt.degraded()
    times += [rt.service_time_ms(1) for _ in range(3)]
    assert times == [1.0] * 5 + [41.0] * 3
    rt = synthetic({"base_ms": 0.0, "degrade_after_batches": 4,
                           "degrade_error_rate": 1.0})
    assert outcomes(rt, 8) == [True] * 4 + [False] * 4


def test_degrade_after_s_counts_from_load() -> None:
    clock = Clock()
    rt = synthetic({"base_ms": 0.0, "error_rate": 0.0, "degrade_after_s": 3,
                           "degrade_error_rate": 1.0}, clock=clock)
    clock.t += 100.0  # the time before load() does not count
    rt.load()
    assert outcomes(rt, 5) == [True] * 5
    clock.t += 2.9
    assert not rt.degraded() and outcomes(rt, 1) == [True]
    clock.t += 0.1
    assert rt.degraded() and outcomes(rt, 3) == [False] * 3


def test_the_earlier_start_wins_and_no_start_means_from_the_beginning() -> None:
    clock = Clock()
    rt = synthetic({"base_ms": 0.0, "degrade_after_s": 60, "degrade_after_batches": 2,
                           "degrade_error_rate": 1.0}, clock=clock)
    rt.load()
    assert outcomes(rt, 3) == [True, True, False]
    always = synthetic({"base_ms": 2.0, "degrade_extra_ms": 5.0})
    assert always.degraded() and always.service_time_ms(1) == 7.0


def test_degrade_error_rate_replaces_error_rate_in_the_bad_phase() -> None:
    rt = synthetic({"base_ms": 0.0, "error_rate": 1.0, "degrade_after_batches": 3,
                           "degrade_error_rate": 0.0})
    assert outcomes(rt, 6) == [False] * 3 + [True] * 3
    slow_only = synthetic({"base_ms": 0.0, "error_rate": 1.0,
                                  "degrade_after_batches": 1, "degrade_extra_ms": 1.0})
    assert not any(outcomes(slow_only, 3))  # only latency degrades: error_rate stands
