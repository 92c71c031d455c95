"""SLOs: the config, the status book (windows, p99, budget, burn), and admission by time."""

from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from sokuji import config as cfg
from sokuji.config_ops import SloConfig, budgets_for
from sokuji.core.request import InferenceRequest, Timeline
from sokuji.core.slo_admission import TimeAdmission
from sokuji.core.slo_budgets import SloBudgets
from sokuji.errors import ConfigError, Overloaded
from sokuji.observability import slo as slo_mod
from sokuji.runtimes.base import Prepared


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


# --- config ---------------------------------------------------------------------------------

def _load(text: str, tmp_path) -> cfg.ServerConfig:  # type: ignore[no-untyped-def]
    path = tmp_path / "c.toml"
    path.write_text(text)
    return cfg.load(path, env={})


MODEL = '[[models]]\nname = "s"\nruntime = "synthetic"\n'


def test_a_model_slo_and_tenant_slos_load(tmp_path) -> None:  # type: ignore[no-untyped-def]
    c = _load(MODEL + 'slo = {p99_ms = 200, error_rate = 0.01, window_s = 60}\n'
              '[[api_keys]]\nkey = "k-aaaaaaaa"\ntenant = "a"\n'
              '[[slos]]\ntenant = "a"\np99_ms = 50\nmodel = "s"\n', tmp_path)
    assert c.models[0].slo == SloConfig(p99_ms=200, error_rate=0.01, window_s=60)
    assert c.slos[0].tenant == "a" and c.slos[0].p99_ms == 50


@pytest.mark.parametrize(("text", "key", "reason"), [
    (MODEL + 'slo = {p99_ms = 0}\n', "models[0].slo.p99_ms", ""),
    (MODEL + 'slo = {p99_ms = 10, error_rate = 1.0}\n', "models[0].slo.error_rate",
     "must be between 0 and 1 (exclusive)"),
    (MODEL + 'slo = {p99_ms = 10, tenant = "a"}\n', "models[0].slo", "use [[slos]]"),
    (MODEL + '[[slos]]\np99_ms = 10\n', "slos[0].tenant", "is required"),
    (MODEL + '[[slos]]\ntenant = "a"\np99_ms = 10\nmodel = "nope"\n', "slos[0].model",
     "no such model"),
    (MODEL + '[[api_keys]]\nkey = "k-aaaaaaaa"\ntenant = "a"\n'
     '[[slos]]\ntenant = "b"\np99_ms = 10\n', "slos[0].tenant", "no API key"),
    (MODEL + 'slo = {p99_ms = 10, colour = "red"}\n', "models[0].slo", "colour"),
])
def test_bad_slos_are_refused_naming_the_key(tmp_path, text: str, key: str,  # type: ignore[no-untyped-def]
                                              reason: str) -> None:
    with pytest.raises(ConfigError) as err:
        _load(text, tmp_path)
    assert key in str(err.value)
    assert reason in str(err.value)


def test_budgets_take_the_tightest_target_that_applies() -> None:
    tenants = [SloConfig(p99_ms=80, tenant="a"), SloConfig(p99_ms=30, tenant="a", model="m"),
               SloConfig(p99_ms=10, tenant="b", model="other"),
               SloConfig(p99_ms=5, tenant="c", admission=False)]
    b = budgets_for("m", SloConfig(p99_ms=50), tenants)
    assert b.budget_ms("a") == 30  # its model-specific one, under the model's 50
    assert b.budget_ms("b") == 50  # its SLO is for another model
    assert b.budget_ms("c") == 50  # reported only, not used for admission
    assert budgets_for("m", SloConfig(p99_ms=50, admission=False), []).budget_ms("x") is None
    assert not budgets_for("m", None, [])


# --- the status book ------------------------------------------------------------------------

def test_window_p99_budget_and_burn() -> None:
    clock = Clock()
    w = slo_mod.SloWindow("m", "", SloConfig(p99_ms=100, error_rate=0.01, window_s=60), clock)
    for i in range(1000):
        w.observe(float(i % 100) + 1.0, 200)  # 1..100 ms, evenly
    for _ in range(5):
        w.observe(None, 503)
    w.observe(None, 429)
    snap = w.snapshot()
    assert snap["requests"] == 1005 and snap["errors"] == 5 and snap["shed"] == 1
    assert snap["p99_ms"] == pytest.approx(99.0, rel=0.025)  # 2% buckets
    assert snap["latency_ok"] and snap["slow_fraction"] == 0.0
    assert snap["error_rate"] == pytest.approx(5 / 1005)
    assert snap["budget_remaining"] == pytest.approx(1 - 5 / (0.01 * 1005))
    assert snap["burn_rate"] == pytest.approx((5 / 1005) / 0.01)
    # The short window (the last twelfth) holds everything so far: the same burn.
    assert snap["burn_rate_short"] == pytest.approx(snap["burn_rate"])
    # Later errors alone burn fast in the short window, slowly over the whole one.
    clock.t += 30
    for _ in range(10):
        w.observe(None, 500)
    later = w.snapshot()
    assert later["burn_rate_short"] == pytest.approx(100.0)
    assert later["burn_rate"] < 10
    # A whole window later, nothing is left.
    clock.t += 61
    empty = w.snapshot()
    assert (empty["requests"], empty["p99_ms"], empty["budget_remaining"]) == (0, None, 1.0)


def test_slow_answers_show_and_the_book_routes_tenants() -> None:
    reg = CollectorRegistry()
    book = slo_mod.build({"m": SloConfig(p99_ms=10)},
                         [SloConfig(p99_ms=5, tenant="t"),
                          SloConfig(p99_ms=2, tenant="t", model="x")], reg)
    assert book is not None
    for _ in range(98):
        book.observe("m", "t", 1.0, 200)
    book.observe("m", "t", 50.0, 200)
    book.observe("m", "t", 60.0, 200)
    book.observe("x", "t", 3.0, 200)  # only the tenant's SLO for x
    book.observe("x", "u", 3.0, 200)  # nobody's
    snaps = {(s["model"], s["tenant"]): s for s in book.snapshot()}
    assert set(snaps) == {("m", ""), ("m", "t"), ("x", "t")}
    assert snaps[("m", "")]["slow_fraction"] == pytest.approx(0.02)
    assert not snaps[("m", "")]["latency_ok"]  # p99 of 100 answers is the 99th: 50 ms
    assert snaps[("x", "t")]["target_p99_ms"] == 2 and snaps[("x", "t")]["requests"] == 1
    book.refusals["m"] = lambda: 7
    text = generate_latest(reg).decode()
    assert 'sokuji_slo_target_p99_seconds{model="m",tenant=""} 0.01' in text
    assert 'sokuji_slo_burn_rate{model="m",tenant="t",window="short"}' in text
    assert 'sokuji_slo_refused_total{model="m"} 7.0' in text
    assert slo_mod.build({}, [], CollectorRegistry()) is None


# --- admission by time ----------------------------------------------------------------------

def _request(items: int, length: int, tenant: str = "", start_ns: int | None = None
             ) -> InferenceRequest:
    prepared = Prepared(data=["x"] * items, num_items=items, length=length,
                        num_tokens=items * length)
    return InferenceRequest(model="m", payload=prepared, num_items=items, length=length,
                            timeline=Timeline(start_ns), tenant=tenant)


def test_nothing_is_refused_before_a_rate_is_measured() -> None:
    adm = TimeAdmission("m", SloBudgets(model_ms=1.0), instances=1)
    now = time.perf_counter_ns()
    queue = [_request(32, 100) for _ in range(100)]
    r = _request(1, 10, start_ns=now)
    adm.admit(r, queue, now)
    assert r.due_ns == now + 1_000_000 and r.predicted_s == 0.0


def test_a_request_that_cannot_make_its_slo_is_refused_with_the_reason() -> None:
    adm = TimeAdmission("m", SloBudgets(model_ms=100.0, tenants_ms={"gold": 20.0}), 1)
    adm.rate.observe(10_000, 1.0)  # 10,000 positions a second
    now = time.perf_counter_ns()
    queue = [_request(1, 100) for _ in range(5)]  # 500 positions: 50 ms
    ok = _request(1, 100, start_ns=now)
    adm.admit(ok, queue, now)  # 60 ms of 100
    assert ok.predicted_s == pytest.approx(0.06)
    with pytest.raises(Overloaded) as err:  # the gold tenant's 20 ms cannot be met
        adm.admit(_request(1, 100, tenant="gold", start_ns=now), queue, now)
    assert "SLO leaves 20 ms" in str(err.value) and err.value.status == 429
    # Time already spent before admission counts: arrived 50 ms ago, 50 ms left.
    with pytest.raises(Overloaded):
        adm.admit(_request(1, 100, start_ns=now - 50_000_000), queue, now)
    # A deadline sooner than the SLO is the due time.
    late = _request(1, 100, start_ns=now)
    late.deadline_ns = now + 30_000_000
    with pytest.raises(Overloaded):
        adm.admit(late, queue, now)
    # A running batch's remaining time is counted.
    adm.dispatched(1, [_request(1, 500)], now)  # 50 ms, just started: 110 ms of 100
    with pytest.raises(Overloaded):
        adm.admit(_request(1, 100, start_ns=now), queue, now)
    assert adm.refused == 4


def test_calibration_scales_predictions_by_their_observed_error() -> None:
    adm = TimeAdmission("m", SloBudgets(model_ms=1000.0), 1)
    adm.rate.observe(10_000, 1.0)
    for _ in range(200):  # predicted 100 ms, took 200 ms
        adm.observe(0, 200_000_000, 0.1, 1.0)
    assert adm.scale == pytest.approx(2.0)
    now = time.perf_counter_ns()
    queue = [_request(1, 100) for _ in range(40)]  # 400 ms unscaled: 800 ms scaled
    adm.admit(_request(1, 100, start_ns=now), queue, now)
    with pytest.raises(Overloaded):  # 510 ms unscaled: 1.02 s scaled
        adm.admit(_request(1, 100, start_ns=now), [*queue, *queue[:10]], now)
    # Tiny predictions (under a tenth of the budget) do not move the scale.
    for _ in range(600):
        adm.observe(0, 50_000_000, 0.001, 1.0)
    assert adm.scale == pytest.approx(2.0)


def test_the_batch_forms_around_the_request_due_first() -> None:
    from sokuji.core import forming
    from sokuji.core.forming import BatchPolicy

    now = time.perf_counter_ns()
    relaxed, urgent, plain = _request(4, 10), _request(4, 10), _request(4, 10)
    relaxed.enqueued_ns, relaxed.due_ns = now - 50_000_000, now + 900_000_000
    urgent.enqueued_ns, urgent.due_ns = now, now + 20_000_000
    plain.enqueued_ns = now - 10_000_000  # no SLO: due an aging time after it was queued
    choice = forming.choose([relaxed, plain, urgent], BatchPolicy.FIFO, 4, 8192,
                            1_000_000_000, now)
    assert choice.indices == [2]  # the oldest has slack; the newest has none
    choice = forming.choose([relaxed, plain], BatchPolicy.FIFO, 4, 8192, 1_000_000_000, now)
    assert choice.indices == [0]  # due at +900 ms; the one without an SLO at +990 ms
    plain.enqueued_ns = now - 200_000_000  # now due at +800 ms: it has waited long enough
    choice = forming.choose([relaxed, plain], BatchPolicy.FIFO, 4, 8192, 1_000_000_000, now)
    assert choice.indices == [1]


def test_a_generation_is_refused_when_its_wait_for_a_slot_exceeds_its_ttft_target() -> None:
    import asyncio

    from sokuji.llm.request import GenerationRequest, SamplingParams
    from sokuji.llm.waiting import WaitingRoom

    loop = asyncio.new_event_loop()
    try:
        room = WaitingRoom("g", slots=2, max_queue_depth=100, max_concurrency=0,
                           priority_aging_ms=1000)
        room.slo = SloBudgets(model_ms=500.0)

        def gen() -> GenerationRequest:
            return GenerationRequest("g", [1, 2], SamplingParams(max_tokens=4), loop,
                                     arrival_ns=time.perf_counter_ns())
        for _ in range(20):  # nothing measured yet: admitted by count only
            room.put(gen(), running=2)
        room.drain.observe(1, 0.25)  # a slot frees every 0.25 s: 8 a second with both
        with pytest.raises(Overloaded) as err:  # 21 ahead: ~2.6 s for a slot, 500 ms left
            room.put(gen(), running=2)
        assert "SLO leaves" in str(err.value) and room.refused == 1
        room.intake.clear()
        room.put(gen(), running=2)  # 1 ahead: ~125 ms
        room.put(gen(), running=1)  # a free slot: not predicted, admitted
    finally:
        loop.close()


def test_the_early_check_refuses_before_the_body_only_what_no_tenant_could_make() -> None:
    adm = TimeAdmission("m", SloBudgets(model_ms=None, tenants_ms={"a": 50.0, "b": 200.0}), 1)
    now = time.perf_counter_ns()
    queue = [_request(1, 100) for _ in range(10)]  # 1,000 positions
    adm.check_early(queue, now)  # nothing measured
    adm.rate.observe(10_000, 1.0)
    adm.check_early(queue, now)  # 100 ms: tenant b could still make it
    with pytest.raises(Overloaded):
        adm.check_early(queue * 3, now)  # 300 ms: nobody can
    assert SloBudgets().loosest_ms is None
    assert SloBudgets(model_ms=100.0, tenants_ms={"a": 20.0}).loosest_ms == 100.0


def test_an_idle_model_always_admits_so_a_bad_rate_cannot_lock_it_out() -> None:
    adm = TimeAdmission("m", SloBudgets(model_ms=100.0), 1)
    adm.rate.observe(100, 10.0)  # measured in a bad moment: 10 positions a second
    adm.batch_work = 8192.0  # and the usual batch was large
    now = time.perf_counter_ns()
    r = _request(1, 100, start_ns=now)
    adm.admit(r, [], now)  # nothing queued, nothing running: admitted, predicted honestly
    assert r.predicted_s == pytest.approx(10.0)
    with pytest.raises(Overloaded):  # behind queued work, the rate counts
        adm.admit(_request(1, 100, start_ns=now), [_request(1, 100)], now)
    # It ran: the rate recovers from what it measured.
    adm.dispatched(1, [r], now)
    adm.completed(1, [r], now + 10_000_000, ok=True)
    assert adm.rate.per_server_s > 1000


def test_a_batch_may_take_at_most_its_share_of_the_target() -> None:
    adm = TimeAdmission("m", SloBudgets(model_ms=2000.0, batch_share=0.25), 1)
    assert adm.batch_cap() is None  # nothing measured
    for positions in (100, 400, 1600, 800):  # 40 ms a batch + 0.1 ms a position
        adm.cost.observe(positions, 0.040 + positions * 1e-4)
    assert adm.batch_cap() == pytest.approx(4600, abs=1)  # (500 - 40) ms / 0.1 ms
    one = TimeAdmission("m", SloBudgets(model_ms=2000.0, batch_share=0.25), 1)
    for _ in range(3):  # one size only: by the rate
        one.cost.observe(1000, 0.2)
    assert one.batch_cap() == pytest.approx(2500, abs=1)
    assert TimeAdmission("m", SloBudgets(model_ms=2000.0), 1).batch_cap() is None  # share 0
    assert budgets_for("m", SloConfig(p99_ms=10, batch_share=0.5),
                       [SloConfig(p99_ms=10, tenant="t", batch_share=0.1)]).batch_share == 0.1

