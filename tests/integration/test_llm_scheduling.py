"""The generation engine's queue, on a one-slot server: deadlines (504), overload (429 at
once), and priorities (interactive before batch-class)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

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
        self.thread = threading.Thread(target=self._run, args=(url,))
        self.thread.start()
        assert self.streaming.wait(30)

    def _run(self, url: str) -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json=LONG, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.streaming.set()
                if self.stop.is_set():
                    return

    def release(self) -> None:
        self.stop.set()
        self.thread.join(30)


def post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None
         ) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)


def count_504(url: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith('sokuji_requests_total{model="smollm2",status="504"}'):
            return float(line.split()[-1])
    return 0.0


def test_deadline_passing_in_the_queue_answers_504(url: str) -> None:
    before = count_504(url)
    hold = Occupier(url)
    try:
        t0 = time.perf_counter()
        r = post(url, {"model": "smollm2", "prompt": "Hi", "max_tokens": 3},
                 {"X-Sokuji-Timeout-Ms": "300"})
        waited = time.perf_counter() - t0
    finally:
        hold.release()
    assert r.status_code == 504 and "deadline" in r.json()["error"]["message"]
    assert 0.25 < waited < 5
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
        t0 = time.perf_counter()
        r = post(url, {"model": "smollm2", "prompt": "Hi", "max_tokens": 3})
        rejected_in = time.perf_counter() - t0
    finally:
        hold.release()
    for w in waiters:
        w.join(30)
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert rejected_in < 0.5
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
    """The slot is free, so the generation starts well within its 100 ms; it then runs to
    max_tokens although that takes longer than the deadline (core/policy.py)."""
    t0 = time.perf_counter()
    r = post(url, {"model": "smollm2", "prompt": "Hi", "max_tokens": 200, "ignore_eos": True,
                   "temperature": 0}, {"X-Sokuji-Timeout-Ms": "100"})
    took = time.perf_counter() - t0
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 200
    assert took > 0.1  # it did outlive its deadline (200 tokens take far longer on a CPU)
