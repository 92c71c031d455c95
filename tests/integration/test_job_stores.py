"""Both job stores keep the same contract: claim in order, complete exactly once, recover
what a crash left running, retry after a delay, count each tenant's unfinished jobs against a
quota, forget finished jobs after their TTL. Redis is a real server (make test starts one)."""

from __future__ import annotations

import json
import os
import sqlite3
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sokuji.core.jobs import JobStatus, JobStore
from sokuji.core.jobs_redis import RedisJobStore
from tests.integration.serving import sokuji_server

REDIS_URL = os.environ.get("SOKUJI_TEST_REDIS_URL")
needs_redis = pytest.mark.skipif(REDIS_URL is None, reason="SOKUJI_TEST_REDIS_URL not set "
                                 "(make test starts redis-server and sets it)")


Factory = Callable[..., Any]


@pytest.fixture(params=["sqlite", pytest.param("redis", marks=needs_redis)])
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Factory]:
    """Builds stores of one kind (keyword arguments: ``result_ttl_s``); closes them after."""
    made: list[Any] = []
    if request.param == "redis":
        import redis

        redis.Redis.from_url(REDIS_URL).flushdb()

    def make(**kwargs: Any) -> Any:
        if request.param == "sqlite":
            s: Any = JobStore(tmp_path / f"jobs{len(made)}.sqlite", **kwargs)
        else:
            s = RedisJobStore(str(REDIS_URL), prefix=f"t{len(made)}:", timeout_s=2.0, **kwargs)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


@pytest.fixture
def store(make_store: Factory) -> Any:
    return make_store()


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
    assert store.retry(a, 0.0) is False  # a finished job is not retried either
    done = store.get(a)
    assert done.status is JobStatus.DONE and done.completions == 1
    assert done.result_body == b"result" and done.result_headers == {"content-type": "x"}
    assert store.claim().id == b
    assert store.complete(b, 400, {}, b"bad") is True
    assert store.get(b).status is JobStatus.FAILED
    assert store.claim() is None
    store.set_callback_status(a, "delivered")
    assert store.get(a).callback_status == "delivered"


def test_a_transient_answer_puts_the_job_back_after_a_delay(store: Any) -> None:
    a = store.submit("t", "/p", {}, b"a")
    b = store.submit("t", "/p", {}, b"b")
    assert store.claim().id == a
    assert store.retry(a, 3600.0) is True  # waits an hour: b goes first
    assert store.retry(a, 3600.0) is False  # only a running job can be put back
    job = store.get(a)
    assert job.status is JobStatus.QUEUED and job.attempts == 1 and job.completions == 0
    assert store.count(JobStatus.QUEUED) == 2 and store.pending("t") == 2
    assert store.claim().id == b
    assert store.claim() is None  # a is not due yet
    assert store.retry(b, 0.0) is True  # due at once
    again = store.claim()
    assert again.id == b and again.attempts == 2
    assert store.recover() == 1 and store.get(b).status is JobStatus.QUEUED


def test_a_tenant_cannot_have_more_unfinished_jobs_than_its_quota(store: Any) -> None:
    ids = [store.submit("acme", "/p", {}, b"x", None, 2) for _ in range(3)]
    assert ids[0] and ids[1] and ids[2] is None
    assert store.submit("bolt", "/p", {}, b"x", None, 2) is not None  # its own count
    assert store.submit("acme", "/p", {}, b"x") is not None  # no quota given: no limit
    assert store.pending("acme") == 3 and store.pending("bolt") == 1
    job = store.claim()
    assert job.id == ids[0] and store.pending("acme") == 3  # running still counts
    assert store.submit("acme", "/p", {}, b"x", None, 3) is None
    store.complete(job.id, 200, {}, b"")
    assert store.pending("acme") == 2
    assert store.submit("acme", "/p", {}, b"x", None, 3) is not None


def test_finished_jobs_are_gone_after_their_ttl(make_store: Factory) -> None:
    store = make_store(result_ttl_s=0.2)
    a = store.submit("t", "/p", {}, b"a", "http://cb")
    b = store.submit("t", "/p", {}, b"b")
    store.claim()
    store.complete(a, 200, {}, b"result")
    assert store.get(a).status is JobStatus.DONE
    deadline = time.monotonic() + 10
    while store.get(a) is not None:  # polls across the TTL
        assert time.monotonic() < deadline
    store.set_callback_status(a, "delivered")  # a late callback outcome revives nothing
    assert store.get(a) is None
    assert store.get(b).status is JobStatus.QUEUED  # unfinished jobs never expire
    store.purge()
    assert store.get(b) is not None and store.count(JobStatus.QUEUED) == 1


def test_purge_deletes_expired_rows_in_batches(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from sokuji.core import jobs

    monkeypatch.setattr(jobs, "PURGE_BATCH", 3)
    store = JobStore(tmp_path / "jobs.sqlite", result_ttl_s=0.001)
    ids = [store.submit("t", "/p", {}, b"x") for _ in range(8)]
    for _ in range(7):
        job = store.claim()
        store.complete(job.id, 200, {}, b"")
    deadline = time.monotonic() + 10
    while store.get(ids[6]) is not None:  # the last one finished: all have expired
        assert time.monotonic() < deadline
    assert store.purge() == 7
    assert store.count(JobStatus.QUEUED) == 1 and store.purge() == 0
    store.close()


def test_an_older_sqlite_store_is_upgraded_in_place(tmp_path: Path) -> None:
    path = tmp_path / "jobs.sqlite"
    db = sqlite3.connect(path)
    db.executescript("""CREATE TABLE jobs (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, path TEXT NOT NULL, headers TEXT NOT NULL,
    body BLOB NOT NULL, status TEXT NOT NULL, attempts INTEGER NOT NULL DEFAULT 0,
    completions INTEGER NOT NULL DEFAULT 0, created_at REAL NOT NULL, finished_at REAL,
    result_status INTEGER, result_headers TEXT, result_body BLOB, callback_url TEXT,
    callback_status TEXT, seq INTEGER NOT NULL);
    INSERT INTO jobs (id, tenant, path, headers, body, status, created_at, seq)
    VALUES ('old', 't', '/p', '{}', x'00', 'queued', 0, 1);""")
    db.close()
    store = JobStore(path)
    assert store.claim().id == "old"
    store.close()


def test_a_redis_store_that_cannot_be_reached_is_unavailable_not_broken() -> None:
    """Start-up says why without the password; calls after an outage are 503s."""
    import socket

    from sokuji import config as cfg
    from sokuji.errors import ConfigError
    from sokuji.server.backends import job_store

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"redis://user:hunter2-pw@127.0.0.1:{port}/0"
    config = cfg.ServerConfig(jobs=cfg.JobsConfig(backend="redis", redis_url=url,
                                                  redis_timeout_s=1.0))
    with pytest.raises(ConfigError) as err:
        job_store(config)
    assert "hunter2" not in str(err.value) and "user:***@127.0.0.1" in str(err.value)
    assert "cannot reach Redis" in str(err.value)


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
