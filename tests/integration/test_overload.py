"""Overload against a real server: fast 429 with Retry-After, fast 504, nothing lost.

"Fast" is judged against a baseline measured in the same test, at the same moment: a request
to a model of zero service time on the same server (the whole HTTP and inference path, no
work). A busy machine slows both alike; a refusal that waited for the queue does not."""

from __future__ import annotations

import concurrent.futures
import json
import math
import statistics
import time
import urllib.error
import urllib.request

import pytest

from tests.integration.serving import sokuji_server

pytestmark = pytest.mark.integration

SERVICE_S = 0.3
MODELS = """
[[models]]
name = "slow"
runtime = "synthetic"
cache = false
max_batch_size = 1
max_queue_depth = {depth}
options = {{base_ms = {service_ms}}}

[[models]]
name = "instant"
runtime = "synthetic"
cache = false
max_batch_size = 1
options = {{base_ms = 0.0}}
"""
SLOW = MODELS.format(depth=2, service_ms=SERVICE_S * 1e3)
PER_ITEM_S = 0.03
PER_ITEM = f"""
[[models]]
name = "items"
runtime = "synthetic"
cache = false
max_batch_size = 64
max_queue_depth = 1
options = {{base_ms = 0.0, per_item_ms = {PER_ITEM_S * 1e3}}}
"""


def send(url: str, model: str = "slow", headers: dict[str, str] | None = None,
         items: int = 1) -> tuple[int, dict[str, str], float, bytes]:
    """POST one V2 inference of ``items`` texts to ``model``: status, headers, seconds
    taken, body."""
    body = json.dumps({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [items],
                                   "data": ["x"] * items}]}).encode()
    req = urllib.request.Request(f"{url}/v2/models/{model}/infer", data=body, headers={
        "content-type": "application/json", **(headers or {})})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            data = r.read()
            return r.status, dict(r.headers), time.perf_counter() - t0, data
    except urllib.error.HTTPError as e:
        data = e.read()
        return e.code, dict(e.headers), time.perf_counter() - t0, data


def post(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], float]:
    """One inference on the slow model: status, headers, seconds taken."""
    status, out_headers, elapsed, _ = send(url, "slow", headers)
    return status, out_headers, elapsed


def instant_s(url: str) -> float:
    """Seconds one request takes right now when the model does no work: the baseline."""
    status, _, elapsed, _ = send(url, "instant")
    assert status == 200
    return elapsed


def wait_for_queue_depth(url: str, depth: int, timeout_s: float = 10.0, model: str = "slow",
                         metric: str = "sokuji_queue_depth") -> None:
    """Poll until the server's gauge ``metric`` of ``model`` is at least ``depth``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{url}/metrics") as r:
            for line in r.read().decode().splitlines():
                if line.startswith(f'{metric}{{model="{model}"}}') and \
                        float(line.split()[-1]) >= depth:
                    return
        time.sleep(0.01)  # polling the server's own gauge (not spinning a core)
    raise TimeoutError(f"{metric} never reached {depth}")


def test_beyond_the_queue_depth_requests_get_a_fast_429_and_the_rest_complete() -> None:
    with sokuji_server(SLOW) as url, concurrent.futures.ThreadPoolExecutor(12) as pool:
        # Eight at once on the slow model and, sent among them, four baseline requests that
        # see the same burst on the same machine.
        burst, baseline = [], []
        for i in range(8):
            burst.append(pool.submit(send, url))
            if i % 2:
                baseline.append(pool.submit(instant_s, url))
        results = [f.result() for f in burst]
        baseline_s = statistics.median(f.result() for f in baseline)
    ok = [r for r in results if r[0] == 200]
    rejected = [r for r in results if r[0] == 429]
    assert len(ok) + len(rejected) == 8  # nothing else: no 5xx, nothing lost
    assert 3 <= len(ok) <= 5 and rejected  # one running + two queued (+ late arrivals)
    for _, headers, _, body in rejected:
        assert int(headers["retry-after"]) >= 1
        assert "max_queue_depth 2" in json.loads(body)["error"]  # refused at admission
    # Rejected at once: as fast as a request that does no work, give or take less than one
    # service time -- not after waiting for a turn in the queue (at least one service time).
    rejected_s = statistics.median(elapsed for _, _, elapsed, _ in rejected)
    assert rejected_s < baseline_s + SERVICE_S, (rejected_s, baseline_s)
    # The queued ones waited their turn: the last of three waited for two before it (a
    # lower bound: a sleep never ends early, a busy machine only adds to it).
    assert max(elapsed for _, _, elapsed, _ in ok) >= 2.5 * SERVICE_S


def test_a_request_that_cannot_start_in_time_gets_a_fast_504() -> None:
    # Room for three queued behind the running one: once two are seen queued, one is still
    # queued a full service time later, however slowly this test gets to send its request.
    with sokuji_server(MODELS.format(depth=4, service_ms=SERVICE_S * 1e3)) as url:
        post(url)  # the drain rate is measured from real batches
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            busy = [pool.submit(post, url) for _ in range(4)]
            wait_for_queue_depth(url, 2)
            before_s = instant_s(url)
            status, _, elapsed, body = send(url, "slow", {"x-sokuji-timeout-ms": "100"})
            after_s = instant_s(url)
            assert [f.result()[0] for f in busy] == [200] * 4
    # Refused at admission (the queue ahead is known to take longer than 100 ms), not failed
    # when its deadline passed in the queue ("waited ... in the queue").
    assert status == 504, body
    assert "cannot start before its deadline" in json.loads(body)["error"], body
    # At once: within a service time of a request that does no work, measured around it --
    # certainly without waiting for the running request to finish, let alone its own turn.
    assert elapsed < max(before_s, after_s) + SERVICE_S, (elapsed, before_s, after_s)


def test_retry_after_is_the_queued_work_over_the_measured_drain_rate() -> None:
    """Kills the mutant: deleting ``self._drain.observe(...)`` in ``core/batcher.py`` (every
    Retry-After is then 1, the value before anything was measured).

    A model costing ``PER_ITEM_S`` an item (a sleep: never shorter). One request of 10
    items measures its rate: at most 10 items per ``10 * PER_ITEM_S`` (the server's own
    service time), at least 10 per ``measured_s`` (the whole round trip seen here). Then 40
    items running, 40 queued (with a deadline, so they never run), and one more refused:
    its Retry-After is the 40 queued items over that rate."""
    with sokuji_server(PER_ITEM) as url, concurrent.futures.ThreadPoolExecutor(2) as pool:
        status, _, measured_s, _ = send(url, "items", items=10)
        assert status == 200
        running = pool.submit(send, url, "items", None, 40)  # 1.2 s at least
        wait_for_queue_depth(url, 2, model="items", metric="sokuji_batch_size_count")
        queued = pool.submit(send, url, "items", {"x-sokuji-timeout-ms": "1000"}, 40)
        wait_for_queue_depth(url, 1, model="items")
        status, headers, _, body = send(url, "items")
        assert running.result()[0] == 200
        assert queued.result()[0] == 504  # expired in the queue: its work never ran
    assert status == 429, body
    retry_after = int(headers["retry-after"])
    low = math.ceil(40 * PER_ITEM_S)  # 2: 1.2 s of queued work at the fastest rate possible
    high = math.ceil(40 * measured_s / 10)
    assert low <= retry_after <= high, (retry_after, low, high, measured_s)
