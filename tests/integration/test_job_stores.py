"""Both job stores keep the same contract: claim in order, complete exactly once, recover
what a crash left running. Redis is a real server (make test starts one)."""

from __future__ import annotations

import json
import os
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sokuji.core.jobs import JobStatus, JobStore, RedisJobStore
from tests.integration.serving import sokuji_server

REDIS_URL = os.environ.get("SOKUJI_TEST_REDIS_URL")
needs_redis = pytest.mark.skipif(REDIS_URL is None, reason="SOKUJI_TEST_REDIS_URL not set "
                                 "(make test starts redis-server and sets it)")


@pytest.fixture(params=["sqlite", pytest.param("redis", marks=needs_redis)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    if request.param == "sqlite":
        s: Any = JobStore(tmp_path / "jobs.sqlite")
    else:
        import redis

        redis.Redis.from_url(REDIS_URL).flushdb()
        s = RedisJobStore(str(REDIS_URL))
    yield s
    s.close()


def test_the_job_store_contract(store: Any) -> None:
    a = store.submit("t", "/v1/embeddings", {"h": "1"}, b"first", "http://cb")
    b = store.submit("t", "/v1/embeddings", {}, b"second")
    assert store.get(a).status is JobStatus.QUEUED and store.get("nope") is None
    first = store.claim()
    assert first.id == a and first.status is JobStatus.RUNNING and first.attempts == 1
    assert first.body == b"first" and first.headers == {"h": "1"}
    assert first.callback_url == "http://cb"
    assert store.recover() == 1  # a crash left it running: back to the queue
    again = store.claim()
    assert again.id == a and again.attempts == 2
    assert store.complete(a, 200, {"content-type": "x"}, b"result") is True
    assert store.complete(a, 200, {}, b"twice") is False  # exactly once
    done = store.get(a)
    assert done.status is JobStatus.DONE and done.completions == 1
    assert done.result_body == b"result" and done.result_headers == {"content-type": "x"}
    assert store.claim().id == b
    assert store.complete(b, 400, {}, b"bad") is True
    assert store.get(b).status is JobStatus.FAILED
    assert store.claim() is None
    store.set_callback_status(a, "delivered (200)")
    assert store.get(a).callback_status == "delivered (200)"


@needs_redis
def test_replicas_share_jobs_through_redis() -> None:
    import redis

    redis.Redis.from_url(REDIS_URL).flushdb()
    config = f"""
[jobs]
backend = "redis"
redis_url = "{REDIS_URL}"
[[models]]
name = "synth"
runtime = "synthetic"
options = {{base_ms = 1.0}}
"""
    body = json.dumps({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1],
                                   "data": ["abc"]}]}).encode()
    with sokuji_server(config) as one, sokuji_server(config) as two:
        req = urllib.request.Request(f"{one}/v2/models/synth/infer", data=body, headers={
            "content-type": "application/json", "prefer": "respond-async"})
        with urllib.request.urlopen(req) as r:
            location = r.headers["location"]
        for _ in range(2000):  # polls the other replica until the job has run
            with urllib.request.urlopen(f"{two}{location}") as r:
                if json.loads(r.read())["status"] == "done":
                    break
        with urllib.request.urlopen(f"{two}{location}/result") as r:
            assert json.loads(r.read())["outputs"][0]["data"] == [3.0]
