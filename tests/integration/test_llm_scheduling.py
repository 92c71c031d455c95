"""The generation engine's queue, on a one-slot server: deadlines (504), overload (429 at
once), and priorities (interactive before batch-class).

Times are judged against what this machine does in the same test: the occupying stream's
generation step, and a request refused for a bad field (the same path, no generation)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from sokuji.bench.engine import parse_server_timing
from tests.conftest import CACHE_DIR
from tests.integration.serving import sokuji_server

pytestmark = pytest.mark.integration

CONFIG = f"""cache_dir = "{CACHE_DIR}"
[[models]]
name = "smollm2"
runtime = "llama"
cache = false
max_queue_depth = 2
priority_aging_ms = 60000
[models.options]
slots = 1
context_size = 512
prefix_cache_mb = 0
"""
LONG = {"model": "smollm2", "prompt": "Count from 1 to 1000, separated by commas: 1, 2, 3,",
        "max_tokens": 400, "temperature": 0, "stream": True}


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with sokuji_server(CONFIG) as base:
        yield base


def queue_depth(url: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith('sokuji_queue_depth{model="smollm2"}'):
            return float(line.split()[-1])
    return -1.0


def wait_for_depth(url: str, depth: int) -> None:
    deadline = time.monotonic() + 10
    while queue_depth(url) != depth:
        assert time.monotonic() < deadline, f"queue depth never reached {depth}"
        time.sleep(0.02)  # polling the server's own gauge


class Occupier:
    """Holds the only slot with a long stream until ``release()`` disconnects it."""

    def __init__(self, url: str) -> None:
        self.streaming, self.stop = threading.Event(), threading.Event()
        self.token_times_s: list[float] = []
        self.thread = threading.Thread(target=self._run, args=(url,))
        self.thread.start()
        assert self.streaming.wait(30)

    def _run(self, url: str) -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json=LONG, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.token_times_s.append(time.perf_counter())
                    self.streaming.set()
                if self.stop.is_set():
                    return

    def release(self) -> None:
        self.stop.set()
        self.thread.join(30)

    def step_s(self) -> float:
        """This machine's generation step while the slot was held: the mean time between
        the stream's tokens (a mean over the span: lines read in one go would make a median
        of the gaps zero). Call after ``release()``."""
        times = self.token_times_s
        assert len(times) >= 3, "the occupier streamed too few tokens to time a step"
        return (times[-1] - times[0]) / (len(times) - 1)


def post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None,
         client: httpx.Client | None = None) -> httpx.Response:
    """One completion; on ``client``'s kept-alive connection when given (timed requests: a
    new client's set-up alone costs tens of milliseconds of CPU)."""
    if client is None:
        return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)
    return client.post(f"{url}/v1/completions", json=body, headers=headers)


def refused_s(url: str, client: httpx.Client) -> float:
    """Seconds a completion takes right now when refused for an unknown field: the same
    route, body reading and decoding as any request, and no generation. The baseline (the
    slower of two: the first also opens ``client``'s connection)."""
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        r = post(url, {"model": "smollm2", "prompt": "Hi", "max_tokens": 3, "bogus": 1},
                 client=client)
        times.append(time.perf_counter() - t0)
        assert r.status_code == 400
    return max(times)


def count_504(url: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith('sokuji_requests_total{model="smollm2",status="504"}'):
            return float(line.split()[-1])
    return 0.0


def test_deadline_passing_in_the_queue_answers_504(url: str) -> None:
    before = count_504(url)
    deadline_s = 0.3
    hold = Occupier(url)
    try:
        with httpx.Client(timeout=60) as client:
            baseline_s = refused_s(url, client)
            t0 = time.perf_counter()
            r = post(url, {"model": "smollm2", "prompt": "Hi", "max_tokens": 3},
                     {"X-Sokuji-Timeout-Ms": str(int(deadline_s * 1e3))}, client)
            waited = time.perf_counter() - t0
    finally:
        hold.release()
    step_s = hold.step_s()
    assert r.status_code == 504 and "deadline" in r.json()["error"]["message"]
    # Not before its deadline (which starts when the server reads the request, after t0) ...
    assert waited >= deadline_s
    # ... and at it: the engine fails a queued request whose deadline has passed at its next
    # step, so within a few steps -- not when the slot frees (the occupier, released only
    # after this answer, had hundreds of tokens to go).
    assert waited < deadline_s + baseline_s + 10 * step_s, (waited, baseline_s, step_s)
    assert count_504(url) == before + 1  # counted once


def test_full_queue_rejects_at_once_and_loses_nothing_accepted(url: str) -> None:
    hold = Occupier(url)
    results: list[httpx.Response] = []
    waiters = [threading.Thread(target=lambda: results.append(
        post(url, {"model": "smollm2", "prompt": "Hi", "max_tokens": 3}))) for _ in range(2)]
    try:
        for w in waiters:
            w.start()
        wait_for_depth(url, 2)
        with httpx.Client(timeout=60) as client:
            baseline_s = refused_s(url, client)
            t0 = time.perf_counter()
            r = post(url, {"model": "smollm2", "prompt": "Hi", "max_tokens": 3}, client=client)
            rejected_in = time.perf_counter() - t0
    finally:
        hold.release()
    for w in waiters:
        w.join(30)
    step_s = hold.step_s()
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert "max_queue_depth 2" in r.json()["error"]["message"]  # refused at admission
    # At once: about as fast as a request refused for a bad field, within a few generation
    # steps of it -- a request that waited for the slot would wait out the occupier's
    # hundreds of tokens.
    assert rejected_in < baseline_s + 5 * step_s, (rejected_in, baseline_s, step_s)
    assert [x.status_code for x in results] == [200, 200]


def test_interactive_requests_take_the_slot_before_batch_class(url: str) -> None:
    hold = Occupier(url)
    done: list[str] = []

    def run(name: str, priority: str) -> None:
        r = post(url, {"model": "smollm2", "prompt": "Hello there", "max_tokens": 8},
                 {"X-Sokuji-Priority": priority})
        assert r.status_code == 200
        done.append(name)

    batch = threading.Thread(target=run, args=("batch", "batch"))
    interactive = threading.Thread(target=run, args=("interactive", "interactive"))
    try:
        batch.start()
        wait_for_depth(url, 1)
        interactive.start()
        wait_for_depth(url, 2)
    finally:
        hold.release()
    batch.join(30)
    interactive.join(30)
    assert done == ["interactive", "batch"]


def test_a_deadline_bounds_the_start_not_a_running_generation(url: str) -> None:
    """With the slot free, a generation starts at once; given a deadline a quarter of the time
    its decoding takes (measured first, without a deadline), it still runs to max_tokens: a
    deadline bounds the start only (core/policy.py)."""
    body = {"model": "smollm2", "prompt": "Hi", "max_tokens": 64, "ignore_eos": True,
            "temperature": 0}
    first = post(url, body)
    assert first.status_code == 200, first.text
    decode_ms = parse_server_timing(first.headers["server-timing"])["decode"]
    deadline_ms = decode_ms / 4
    r = post(url, body, {"X-Sokuji-Timeout-Ms": f"{deadline_ms:.3f}"})
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["choices"][0]["finish_reason"] == "length"
    assert doc["usage"]["completion_tokens"] == 64
    timing = parse_server_timing(r.headers["server-timing"])
    assert timing["total"] > deadline_ms  # it did outlive its deadline, and was not cut
