"""Does ``sokuji bench`` measure what the server really does? Against servers whose behaviour
is known: the synthetic runtime served by Sokuji, and a streaming endpoint with known timing."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web

from sokuji.bench import dataset, stats
from sokuji.bench.engine import Engine, RunResult, _until
from sokuji.bench.schedule import Arrivals, intended_times
from sokuji.bench.targets import Target, TargetKind
from tests.integration.serving import sokuji_server

pytestmark = pytest.mark.integration

MEAN_MS, SIGMA = 20.0, 0.25
# Two models served side by side: the lognormal one under test, and a constant one with the
# same mean, measured at the same time as the baseline. Eight instances each: at the open
# loop's 50 req/s nothing ever queues, so the true latency is service time plus overhead.
LOGNORMAL = f"""
[[models]]
name = "synth"
runtime = "synthetic"
cache = false
max_batch_size = 1
instances = 8
options = {{base_ms = {MEAN_MS}, distribution = "lognormal", sigma = {SIGMA}, seed = 3}}

[[models]]
name = "constant"
runtime = "synthetic"
cache = false
max_batch_size = 1
instances = 8
options = {{base_ms = {MEAN_MS}}}
"""


MODELS = ("synth", "constant")

STALL = """
[[models]]
name = "{name}"
runtime = "synthetic"
cache = false
max_batch_size = 16
# Every batch in a worker: a lone request run on the event loop (core/inline.py) would hold
# the loop through the stall, and what arrived meanwhile would wait in the socket, before
# its Server-Timing starts; the tail attribution below reads the server's stages.
inline_max_ms = 0
options = {{base_ms = 2.0, stall_ms = 1000.0, stall_after_batches = {after}}}
"""
SERVICE_MS = 10.0
KNEE = f"""
# One instance, {SERVICE_MS} ms per request, no batching: capacity {1e3 / SERVICE_MS:.0f} req/s.
[[models]]
name = "knee"
runtime = "synthetic"
cache = false
max_batch_size = 1
options = {{base_ms = {SERVICE_MS}}}
"""
CLI = LOGNORMAL.split("[[models]]")[1].replace('name = "synth"', 'name = "cli"')
SERVER = (LOGNORMAL + "\n[[models]]" + CLI + STALL.format(name="stall_open", after=150)
          + STALL.format(name="stall_closed", after=400) + KNEE)
"""Every model the tests below measure, in one server started once for the module: each
model has its own instances, its own seeded draws and its own batch count (the stalls), and
each test loads only its own models, one test at a time."""


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with sokuji_server(SERVER) as base:
        yield base


def service_times_ms(n: int) -> np.ndarray:
    """The service times the server's synthetic model draws, in order: same code, same seed."""
    from sokuji.runtimes.synthetic import SyntheticOptions, SyntheticRuntime

    rt = SyntheticRuntime(SyntheticOptions(base_ms=MEAN_MS, distribution="lognormal",
                                           sigma=SIGMA, seed=3))
    return np.asarray([rt.service_time_ms(1) for _ in range(n)])


def engine(url: str, seed: int = 0, model: str = "synth") -> Engine:
    return Engine(Target(TargetKind.V2, url, model=model),
                  dataset.Sampler(dataset.load("short"), seed), timeout_s=30)


def measured_ms(run: RunResult) -> np.ndarray:
    return np.asarray([r.latency_s * 1e3 for r in run.records
                       if not r.warmup and r.error is None])


async def timer_lag_ms(times_s: np.ndarray) -> np.ndarray:
    """How late this event loop, now, starts a task at each of ``times_s`` (seconds from the
    call) when woken the way the open-loop engine wakes: the engine's send path without the
    request. Run beside an engine, it measures the lateness any client would have here."""
    t0 = time.perf_counter()
    lags_ms: list[float] = []

    async def mark(intended_s: float) -> None:
        lags_ms.append((time.perf_counter() - t0 - intended_s) * 1e3)

    tasks = []
    for intended_s in times_s.tolist():
        await _until(t0 + intended_s)
        tasks.append(asyncio.create_task(mark(intended_s)))
    await asyncio.gather(*tasks)
    return np.asarray(lags_ms)


def predicted_percentile(service_ms: np.ndarray, overhead_ms: np.ndarray, q: float,
                         rng: np.random.Generator) -> tuple[float, float]:
    """The q-th percentile of service time + overhead (independent), and how far a run of
    ``len(service_ms)`` requests can land from it by chance: the 99% half-width over random
    pairings of the measured overhead samples with the service times."""
    want = float(np.percentile((service_ms[:, None] + overhead_ms[None, :]).ravel(), q))
    draws = [np.percentile(service_ms + rng.choice(overhead_ms, len(service_ms)), q)
             for _ in range(400)]
    lo, hi = np.percentile(draws, [0.5, 99.5])
    return want, float(max(hi - want, want - lo))


def test_measured_percentiles_match_the_configured_distribution(url: str) -> None:
    # What the client measures is service time plus overhead (network, both processes'
    # scheduling, the sleep's wake-up). The overhead is not assumed: it is measured, at the
    # same moment and under the same load, on a model of constant service time, so a busy
    # machine moves prediction and measurement alike.
    rate = 50.0
    times = intended_times(rate, Arrivals.POISSON, seed=1, duration_s=10.5)
    warm_open = int(np.sum(times < 0.5))

    async def side_by_side(run: Callable[[Engine], Awaitable[RunResult]]
                           ) -> dict[str, RunResult]:
        results = await asyncio.gather(*(run(engine(url, model=m)) for m in MODELS))
        return dict(zip(MODELS, results, strict=True))

    async def open_with_probe() -> tuple[dict[str, RunResult], np.ndarray]:
        probe = asyncio.create_task(timer_lag_ms(times))
        results = await side_by_side(lambda e: e.open(times, warmup_s=0.5))
        return results, await probe

    runs = {"closed": asyncio.run(side_by_side(lambda e: e.closed(
                4, count=800, warmup_count=40)))}
    runs["open"], timer_lags_ms = asyncio.run(open_with_probe())
    # The synth model drew 840 service times for the closed run, then len(times) for the open
    # one; the measured requests are those after each warm-up.
    drawn = service_times_ms(840 + len(times))
    expected = {"closed": drawn[40:840], "open": drawn[840 + warm_open:]}
    assert 19.0 < drawn.mean() < 21.0 and 30.0 < np.percentile(drawn, 99) < 40.0
    rng = np.random.default_rng(0)
    for mode in ("closed", "open"):
        for model in MODELS:
            assert stats.summarize(runs[mode][model])["requests"]["errors"] == {}, (mode, model)
        overhead_ms = measured_ms(runs[mode]["constant"]) - MEAN_MS
        # A sleep never ends early and the client's clock spans the server's: a latency below
        # the service time would be a measuring error.
        assert overhead_ms.min() >= 0, mode
        lat = stats.summarize(runs[mode]["synth"])["latency_ms"]
        assert lat["count"] == len(expected[mode])
        for q, rel in ((50, 0.04), (99, 0.06)):
            # rel: HDR rounding, the warm-up boundary, synth and constant not sharing every
            # moment; chance: what the measured overhead's spread alone can move the result.
            want, chance = predicted_percentile(expected[mode], overhead_ms, q, rng)
            tol = rel * want + chance
            assert abs(lat[f"p{q}"] - want) <= tol, (mode, q, lat[f"p{q}"], want, tol)
    lag = stats.summarize(runs["open"]["synth"])["client"]["lag_ms"]
    lags_ms = [r.lag_s * 1e3 for r in runs["open"]["synth"].records]
    assert min(lags_ms) >= 0  # never sent before its time
    # It kept to its schedule: a typical request went out within a quarter of the mean gap
    # between arrivals of when a bare timer in the same loop fired, at the same moments (a
    # busy machine delays both alike; a client that waited for replies would lag by whole
    # service times, and more and more).
    timer_p50_ms = float(np.percentile(timer_lags_ms[warm_open:], 50))
    assert lag["p50"] < timer_p50_ms + 0.25 * 1e3 / rate, (lag["p50"], timer_p50_ms)


def test_a_stall_shows_in_open_loop_p99_and_hides_in_closed_loop(url: str) -> None:
    rate, measured_s, stall_s = 100.0, 4.0, 1.0
    # Two models of the module's server, each stalling once: at its batch 150 (~1.5 s into
    # the open run) and at its batch 400 (in the closed run).
    times = intended_times(rate, Arrivals.CONSTANT, seed=0, duration_s=0.5 + measured_s)
    opened_run = asyncio.run(engine(url, model="stall_open").open(times, warmup_s=0.5))
    opened = stats.summarize(opened_run)
    closed_run = asyncio.run(engine(url, model="stall_closed").closed(
        1, duration_s=measured_s, warmup_count=20))
    closed = stats.summarize(closed_run)
    # Open loop: the requests due during the stall (stall_s/measured_s of them) wait out the
    # rest of it, so their latencies spread uniformly over [0, stall_s]; p99 is the top 1% of
    # all requests, i.e. stall_s * (1 - 0.01 * measured_s / stall_s) -- on top of what every
    # request costs here, now: the run's own median (service time, network, both processes'
    # scheduling), measured, not assumed.
    # The replies held by the stall then come out in one burst that both processes work
    # through one by one (200+ ms once on a busy 2-core CI machine): the last of them waits
    # that much more. Measured in this run: from the first stalled reply to the last.
    overhead_ms = opened["latency_ms"]["p50"]
    predicted_ms = 1e3 * stall_s * (1 - 0.01 * measured_s / stall_s) + overhead_ms
    held = [r.done_s for r in opened_run.records
            if not r.warmup and r.error is None and r.latency_s > 0.5 * stall_s]
    burst_ms = 1e3 * (max(held) - min(held))
    p99 = opened["latency_ms"]["p99"]
    assert 0.9 * predicted_ms <= p99 <= 1.1 * predicted_ms + burst_ms, (
        p99, predicted_ms, burst_ms)
    # The tail says why: the stalled batch itself (infer), and the requests queued behind it.
    tail = opened["stages"]["tail_share"]
    assert max(tail, key=tail.__getitem__) == "queue"
    # Most of it: the rest is what every request costs plus, on a busy machine, the client
    # and server working through the burst of replies that ends the stall (0.948 seen with
    # one core kept busy; a tail not made of the stall would be nowhere near).
    assert tail["queue"] + tail["infer"] > 0.8, tail
    # Closed loop: one request saw the stall and the client simply sent less meanwhile: the
    # stall is in the maximum only (one request of hundreds), and p99 stays far below the
    # open loop's, measured against the same stall.
    stalled = [r for r in measured_ms(closed_run) if r >= 0.9 * stall_s * 1e3]
    assert len(stalled) == 1, stalled
    assert closed["latency_ms"]["p99"] < 0.5 * opened["latency_ms"]["p99"]


def test_cli_writes_json_and_an_html_report_with_plots(url: str, tmp_path: Path) -> None:
    out, page = tmp_path / "r.json", tmp_path / "r.html"
    # "cli": the lognormal model's twin (the first test's "synth" keeps its own draws)
    proc = subprocess.run(
        [sys.executable, "-m", "sokuji", "bench", url, "--model", "cli", "--rate", "60",
         "--duration", "2", "--warmup", "0.5s", "--dataset", "mixed", "--slo",
         "p99=200ms", "--price-per-hour", "1.0", "--out", str(out), "--html", str(page),
         "--quiet"], capture_output=True, text=True, timeout=120)
    doc = json.loads(out.read_text())
    assert doc["schema"] == "sokuji.bench/1"
    # The verdict follows from the measured p99, whatever this machine's speed: the exit
    # status says whether the SLO was met.
    slo = doc["slo"][0]
    p99 = doc["summary"]["latency_ms"]["p99"]
    assert (slo["limit"], slo["measured"]) == (200.0, p99)
    assert slo["ok"] is (p99 <= 200.0)
    assert proc.returncode == (0 if slo["ok"] else 3), proc.stderr
    assert doc["cost"]["per_1k_requests"] > 0
    assert doc["summary"]["stages"]["mean_ms"]["infer"] > 10
    html = page.read_text()
    assert html.count("<img") == 3  # CDF, over time, stage breakdown
    for title in ("Latency CDF", "Latency over time", "Stage breakdown"):
        assert title in html


def test_sweep_finds_the_capacity_knee(url: str, tmp_path: Path) -> None:
    service_ms, start_rate = SERVICE_MS, 30.0  # the "knee" model: capacity 100 req/s
    out = tmp_path / "sweep.json"
    # The SLO is set from this machine's latency at the starting rate, measured now: a
    # busy machine adds its delays to every step, and the sweep must still find the knee
    # of the server, not of the machine. Five service times above it: queueing at half
    # the capacity stays well under; past the capacity the queue grows without bound.
    times = intended_times(start_rate, Arrivals.POISSON, seed=2, duration_s=1.3)
    base = stats.summarize(asyncio.run(engine(url, model="knee").open(times, warmup_s=0.3)))
    slo_ms = math.ceil(base["latency_ms"]["p99"] + 5 * service_ms)
    proc = subprocess.run(
        [sys.executable, "-m", "sokuji", "bench", url, "--model", "knee", "--rate",
         str(start_rate), "--sweep", "--sweep-factor", "1.6", "--duration", "2",
         "--warmup", "0.3s", "--slo", f"p99={slo_ms}ms", "--out", str(out), "--html",
         str(tmp_path / "s.html"), "--quiet"], capture_output=True, text=True, timeout=180)
    sweep = json.loads(out.read_text())["sweep"]
    assert "Latency against throughput" in (tmp_path / "s.html").read_text()
    steps = [(round(s["rate"], 1), s["slo_ok"], s["summary"]["latency_ms"]["p99"])
             for s in sweep["steps"]]
    assert proc.returncode == 3, (slo_ms, steps)  # the last step failed its SLO, as it must
    assert not sweep["steps"][-1]["slo_ok"]
    capacity_rps = 1e3 / service_ms
    assert 0.4 * capacity_rps < sweep["goodput_rps"] <= capacity_rps, (slo_ms, steps)
    assert sweep["max_rate_meeting_slo"] < capacity_rps  # no rate above capacity meets it
    assert sweep["knee_rate"] is not None and sweep["knee_rate"] < capacity_rps


EMITTED = web.AppKey("emitted", list)
"""Per request, the seconds from the handler's start to each chunk's write: what the server
really did, for the client's measurement to be judged against."""


async def _stream(request: web.Request) -> web.StreamResponse:
    t0 = time.perf_counter()
    written_s: list[float] = []
    resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(6):
        await asyncio.sleep(0.03)
        chunk = {"choices": [{"index": 0, "text": f"t{i}"}]}
        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        written_s.append(time.perf_counter() - t0)
    await resp.write(b"data: [DONE]\n\n")
    request.app[EMITTED].append(written_s)
    return resp


@pytest.fixture
async def streaming_server() -> AsyncIterator[tuple[str, list[list[float]]]]:
    app = web.Application()
    emitted: list[list[float]] = []
    app[EMITTED] = emitted
    app.router.add_post("/v1/completions", _stream)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}", emitted
    await runner.cleanup()


async def test_streaming_targets_measure_ttft_and_itl(
        streaming_server: tuple[str, list[list[float]]]) -> None:
    url, emitted = streaming_server
    eng = Engine(Target(TargetKind.OPENAI_COMPLETIONS, url, model="m"),
                 dataset.Sampler(dataset.load("short"), 0))
    run = await eng.closed(2, count=10)
    s = stats.summarize(run, streaming=True)
    # Judged against when the server really wrote each chunk (its sleeps run late on a busy
    # machine; the client must see exactly that): the gap left is the request's and the
    # chunk's way over loopback.
    assert len(emitted) == 10
    ttft_ms = 1e3 * float(np.median([w[0] for w in emitted]))
    itl_ms = 1e3 * float(np.median(np.concatenate([np.diff(w) for w in emitted])))
    assert ttft_ms >= 25 and itl_ms >= 25  # the server's 30 ms sleeps (asyncio's timer
    # may wake up to a clock tick early)
    assert s["ttft_ms"]["p50"] == pytest.approx(ttft_ms, abs=12)
    assert s["itl_ms"]["p50"] == pytest.approx(itl_ms, abs=12)
    assert s["output_tokens"] == 60 and s["output_tokens_per_s"] > 0
    assert np.isfinite(s["tpot_ms"]["mean"])
