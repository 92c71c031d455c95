"""SIGTERM: readiness false first, in-flight requests finish, then a clean exit."""

from __future__ import annotations

import concurrent.futures
import signal
import time
import urllib.error
import urllib.request

import pytest

from tests.integration.serving import sokuji_process
from tests.integration.test_overload import post, wait_for_queue_depth

pytestmark = pytest.mark.integration

CONFIG = """
shutdown_drain_s = 0.6
shutdown_grace_s = 10
[[models]]
name = "slow"
runtime = "synthetic"
cache = false
max_batch_size = 1
options = {base_ms = 400.0}
"""


def ready_status(url: str) -> int:
    """The readiness probe's status; 0 once nothing listens any more."""
    try:
        with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except urllib.error.URLError:
        return 0


def test_sigterm_drains_then_finishes_in_flight_requests_and_exits_cleanly() -> None:
    with sokuji_process(CONFIG) as (proc, url), \
            concurrent.futures.ThreadPoolExecutor(2) as pool:
        in_flight = [pool.submit(post, url) for _ in range(2)]
        wait_for_queue_depth(url, 1)  # one running, one queued
        proc.send_signal(signal.SIGTERM)
        # Poll until readiness turns false or the server stops listening (the drain keeps it
        # listening for shutdown_drain_s); bounded, but not by how soon a busy machine
        # delivers the signal.
        deadline = time.monotonic() + 30
        statuses = set()
        while not statuses & {503, 0}:
            assert time.monotonic() < deadline, statuses
            statuses.add(ready_status(url))
            time.sleep(0.01)  # polling another process's state
        assert 503 in statuses  # readiness turned false while still listening
        assert [f.result(timeout=10)[0] for f in in_flight] == [200, 200]
        # uvicorn shuts down cleanly, then re-raises the signal it caught, so a supervisor
        # sees the process end by SIGTERM, as it asked.
        assert proc.wait(timeout=15) in (0, -signal.SIGTERM)
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(f"{url}/v2/health/live", timeout=1)
