"""Overload against a real server: fast 429 with Retry-After, fast 504, nothing lost."""

from __future__ import annotations

import concurrent.futures
import json
import time
import urllib.error
import urllib.request

import pytest

from tests.integration.serving import sokuji_server

pytestmark = pytest.mark.integration

SERVICE_S = 0.3
SLOW = f"""
[[models]]
name = "slow"
runtime = "synthetic"
cache = false
max_batch_size = 1
max_queue_depth = 2
options = {{base_ms = {SERVICE_S * 1e3}}}
"""


def post(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], float]:
    body = json.dumps({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1],
                                   "data": ["x"]}]}).encode()
    req = urllib.request.Request(f"{url}/v2/models/slow/infer", data=body, headers={
        "content-type": "application/json", **(headers or {})})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            r.read()
            return r.status, dict(r.headers), time.perf_counter() - t0
    except urllib.error.HTTPError as e:
        e.read()
        return e.code, dict(e.headers), time.perf_counter() - t0


def wait_for_queue_depth(url: str, depth: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{url}/metrics") as r:
            for line in r.read().decode().splitlines():
                if line.startswith('sokuji_queue_depth{model="slow"}') and \
                        float(line.split()[-1]) >= depth:
                    return
    raise TimeoutError(f"queue depth never reached {depth}")


def test_beyond_the_queue_depth_requests_get_a_fast_429_and_the_rest_complete() -> None:
    with sokuji_server(SLOW) as url, concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: post(url), range(8)))
    ok = [r for r in results if r[0] == 200]
    rejected = [r for r in results if r[0] == 429]
    assert len(ok) + len(rejected) == 8  # nothing else: no 5xx, nothing lost
    assert 3 <= len(ok) <= 5 and rejected  # one running + two queued (+ late arrivals)
    for _, headers, elapsed in rejected:
        assert int(headers["retry-after"]) >= 1
        # Rejected at once: sooner than any request could be served (one service time),
        # let alone after waiting for a turn in the queue.
        assert elapsed < SERVICE_S
    # The queued ones waited their turn: the last of three waited for two before it.
    assert max(elapsed for _, _, elapsed in ok) >= 2.5 * SERVICE_S


def test_a_request_that_cannot_start_in_time_gets_a_fast_504() -> None:
    with sokuji_server(SLOW) as url:
        post(url)  # the drain rate is measured from real batches
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            busy = [pool.submit(post, url) for _ in range(2)]
            wait_for_queue_depth(url, 1)  # one running, one queued
            status, _, elapsed = post(url, {"x-sokuji-timeout-ms": "100"})
            assert [f.result()[0] for f in busy] == [200, 200]
    # At once (the queue ahead is known to take longer than 100 ms), and certainly without
    # waiting for the running request to finish, let alone its own turn.
    assert status == 504 and elapsed < SERVICE_S
