"""Both job stores keep the same contract: claim in order under a lease, complete exactly once
(and idempotently for the runner that holds the job), requeue only expired leases, retry after
a delay, count each tenant's unfinished jobs and stored bytes against quotas, keep callbacks
due until an outcome is recorded, forget finished jobs after their TTL. Time is an injected
clock; Redis is a real server (make test starts one)."""

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

from sokuji.core.job import JobStatus, QuotaHit, Usage
from sokuji.stores.jobs_redis import RedisJobStore
from sokuji.stores.jobs_sqlite import JobStore
from tests.integration.serving import sokuji_server

REDIS_URL = os.environ.get("SOKUJI_TEST_REDIS_URL")
needs_redis = pytest.mark.skipif(REDIS_URL is None, reason="SOKUJI_TEST_REDIS_URL not set "
                                 "(make test starts redis-server and sets it)")


class Clock:
    """Time that moves only when told to (from the real time, which Redis expiry uses)."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


Factory = Callable[..., Any]


@pytest.fixture(params=["sqlite", pytest.param("redis", marks=needs_redis)])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def make_store(kind: str, tmp_path: Path, clock: Clock) -> Iterator[Factory]:
    """Builds stores of one kind on the clock (keywords: ``result_ttl_s``, ``lease_s``,
    ``shared``: another runner on the same data as the first store); closes them after."""
    made: list[Any] = []
    if kind == "redis":
        import redis

        redis.Redis.from_url(REDIS_URL).flushdb()

    def make(shared: bool = False, **kwargs: Any) -> Any:
        n = 0 if shared else len(made)
        if kind == "sqlite":
            s: Any = JobStore(tmp_path / f"jobs{n}.sqlite", clock=clock, **kwargs)
        else:
            s = RedisJobStore(str(REDIS_URL), prefix=f"t{n}:", timeout_s=2.0, clock=clock,
                              **kwargs)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


@pytest.fixture
def store(make_store: Factory) -> Any:
    return make_store()


def test_the_job_store_contract(store: Any) -> None:
    a = store.submit("t", "/v1/embeddings", {"h": "1"}, b"first", "http://cb", key_id="k1")
    b = store.submit("t", "/v1/embeddings", {}, b"second")
    assert store.get(a).status is JobStatus.QUEUED and store.get("nope") is None
    assert store.get(a).key_id == "k1" and store.get(b).key_id is None
    first = store.claim()
    assert first.id == a and first.status is JobStatus.RUNNING and first.attempts == 1
    assert first.body == b"first" and first.headers == {"h": "1"}
    assert first.callback_url == "http://cb" and first.runner == store.runner
    assert store.recover() == 0  # its lease is live: nobody else may take it
    assert store.complete(a, 200, {"content-type": "x"}, b"result") is True
    assert store.complete(a, 200, {}, b"twice") is True  # the same runner asking again
    assert store.retry(a, 0.0) is False  # a finished job is not retried either
    done = store.get(a)
    assert done.status is JobStatus.DONE and done.completions == 1
    assert done.result_body == b"result" and done.result_headers == {"content-type": "x"}
    assert done.body == b""  # the request is deleted once answered
    assert done.callback_status == "pending"
    assert store.claim().id == b
    assert store.complete(b, 400, {}, b"bad") is True
    assert store.get(b).status is JobStatus.FAILED and store.get(b).callback_status is None
    assert store.claim() is None
    store.set_callback_status(a, "delivered")
    assert store.get(a).callback_status == "delivered"


def test_a_lease_keeps_a_job_from_other_runners_until_it_passes(
        make_store: Factory, clock: Clock) -> None:
    """Two runners (replicas) on the same data: a live lease is never taken over; an expired
    one is, and then only the new holder can complete the job."""
    one = make_store(lease_s=10.0)
    two = make_store(shared=True, lease_s=10.0)
    job_id = one.submit("t", "/p", {}, b"x", "http://cb")
    assert one.claim().id == job_id
    clock.advance(8)
    assert two.recover() == 0 and two.claim() is None
    assert one.renew([job_id]) == 1  # renewed: another 10 s from now
    clock.advance(8)
    assert two.recover() == 0
    clock.advance(3)  # 11 s after the renewal: the runner is presumed dead
    assert two.recover() == 1
    again = two.claim()
    assert again.id == job_id and again.attempts == 2 and again.runner == two.runner
    assert one.renew([job_id]) == 0  # not its job any more
    assert one.retry(job_id, 0.0) is False
    assert one.complete(job_id, 200, {}, b"late") is False  # its answer is dropped
    assert two.complete(job_id, 200, {}, b"on time") is True
    assert one.complete(job_id, 200, {}, b"late") is False
    done = two.get(job_id)
    assert done.completions == 1 and done.result_body == b"on time"


def test_release_hands_a_runners_jobs_back_at_once(make_store: Factory) -> None:
    one = make_store()
    two = make_store(shared=True)
    a = one.submit("t", "/p", {}, b"a")
    b = one.submit("t", "/p", {}, b"b")
    assert one.claim().id == a and two.claim().id == b
    assert one.release([a, b]) == 1  # only what it holds
    assert one.get(a).status is JobStatus.QUEUED and one.get(b).status is JobStatus.RUNNING
    assert two.claim().id == a


def test_a_transient_answer_puts_the_job_back_after_a_delay(store: Any, clock: Clock) -> None:
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
    clock.advance(3601)
    assert store.claim().id == a


def test_a_tenant_cannot_have_more_unfinished_jobs_than_its_quota(store: Any) -> None:
    ids = [store.submit("acme", "/p", {}, b"x", None, 2) for _ in range(3)]
    assert ids[0] and ids[1] and ids[2] is QuotaHit.PENDING
    assert isinstance(store.submit("bolt", "/p", {}, b"x", None, 2), str)  # its own count
    assert isinstance(store.submit("acme", "/p", {}, b"x"), str)  # no quota given: no limit
    assert store.pending("acme") == 3 and store.pending("bolt") == 1
    job = store.claim()
    assert job.id == ids[0] and store.pending("acme") == 3  # running still counts
    assert store.submit("acme", "/p", {}, b"x", None, 3) is QuotaHit.PENDING
    store.complete(job.id, 200, {}, b"")
    assert store.pending("acme") == 2
    assert isinstance(store.submit("acme", "/p", {}, b"x", None, 3), str)


def test_stored_bytes_count_bodies_then_results_until_they_expire(
        make_store: Factory, kind: str, clock: Clock) -> None:
    store = make_store(result_ttl_s=60.0)
    a = store.submit("acme", "/p", {}, b"x" * 100, max_bytes=250)
    b = store.submit("acme", "/p", {}, b"y" * 100, max_bytes=250)
    assert store.usage("acme") == Usage(pending=2, stored_bytes=200)
    assert store.submit("acme", "/p", {}, b"z" * 51, max_bytes=250) is QuotaHit.BYTES
    assert isinstance(store.submit("bolt", "/p", {}, b"z" * 51, max_bytes=250), str)
    assert store.claim().id == a
    store.complete(a, 200, {}, b"r" * 30)  # the body (100) gives way to the result (30)
    assert store.usage("acme") == Usage(pending=1, stored_bytes=130)
    assert store.get(a).body == b""
    c = store.submit("acme", "/p", {}, b"z" * 120, max_bytes=250)
    assert isinstance(c, str) and store.usage("acme").stored_bytes == 250
    clock.advance(61)  # a's result expires: its bytes stop counting
    store.purge()
    assert store.usage("acme") == Usage(pending=2, stored_bytes=220)
    assert store.get(b).body == b"y" * 100


def test_finished_jobs_are_gone_after_their_ttl(make_store: Factory, kind: str,
                                                clock: Clock) -> None:
    store = make_store(result_ttl_s=0.2)
    a = store.submit("t", "/p", {}, b"a", "http://cb")
    b = store.submit("t", "/p", {}, b"b")
    store.claim()
    store.complete(a, 200, {}, b"result")
    assert store.get(a).status is JobStatus.DONE
    clock.advance(0.3)
    if kind == "redis":  # its hash expires in Redis's own time
        deadline = time.monotonic() + 10
        while store.get(a) is not None:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    assert store.get(a) is None
    store.set_callback_status(a, "delivered")  # a late callback outcome revives nothing
    assert store.get(a) is None and store.due_callbacks(4) == []
    assert store.get(b).status is JobStatus.QUEUED  # unfinished jobs never expire
    store.purge()
    assert store.get(b) is not None and store.count(JobStatus.QUEUED) == 1


def test_callbacks_are_due_in_the_store_until_an_outcome(
        make_store: Factory, clock: Clock) -> None:
    """Completion makes the callback due; an attempt leases it; a lost attempt (its runner
    died) is due again when the lease passes, for any runner; a retry waits; an outcome
    ends it."""
    one = make_store()
    job_id = one.submit("t", "/p", {}, b"x", "http://cb")
    assert one.claim().id == job_id and one.due_callbacks(4) == []
    one.complete(job_id, 200, {"content-type": "x"}, b"result")
    assert one.due_callbacks(4) == [(job_id, "t")]
    taken = one.take_callback(job_id, 30.0)
    assert taken.result_body == b"result" and taken.callback_attempts == 1
    assert one.take_callback(job_id, 30.0) is None and one.due_callbacks(4) == []
    two = make_store(shared=True)  # a restart: a new runner on the same store
    clock.advance(31)
    assert two.due_callbacks(4) == [(job_id, "t")]
    assert two.take_callback(job_id, 30.0).callback_attempts == 2
    two.set_callback_status(job_id, "pending", 5.0)
    assert two.due_callbacks(4) == [] and two.get(job_id).callback_status == "pending"
    clock.advance(6)
    assert two.take_callback(job_id, 30.0).callback_attempts == 3
    two.set_callback_status(job_id, "delivered")
    clock.advance(60)
    assert two.due_callbacks(4) == [] and two.get(job_id).callback_status == "delivered"


def test_due_callbacks_are_listed_per_tenant(store: Any) -> None:
    """One tenant's backlog never hides another tenant's due callback."""
    ids = {}
    for tenant, n in (("flood", 6), ("quiet", 1)):
        ids[tenant] = [store.submit(tenant, "/p", {}, b"x", "http://cb") for _ in range(n)]
    for _ in range(7):
        store.complete(store.claim().id, 200, {}, b"r")
    due = store.due_callbacks(2)
    assert sorted(t for _, t in due) == ["flood", "flood", "quiet"]
    assert {i for i, t in due if t == "flood"} <= set(ids["flood"])


def test_purge_deletes_expired_rows_in_batches(tmp_path: Path, clock: Clock,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from sokuji.stores import jobs_sqlite

    monkeypatch.setattr(jobs_sqlite, "PURGE_BATCH", 3)
    store = JobStore(tmp_path / "jobs.sqlite", result_ttl_s=1.0, clock=clock)
    ids = [store.submit("t", "/p", {}, b"x") for _ in range(8)]
    for _ in range(7):
        job = store.claim()
        store.complete(job.id, 200, {}, b"rr")
    assert store.usage("t").stored_bytes == 7 * 2 + 1
    clock.advance(2)
    assert store.get(ids[6]) is None
    assert store.purge() == 7
    assert store.count(JobStatus.QUEUED) == 1 and store.purge() == 0
    assert store.usage("t") == Usage(pending=1, stored_bytes=1)
    store.close()


def test_an_older_sqlite_store_is_upgraded_in_place(tmp_path: Path) -> None:
    """Its rows gain the new columns; a job it left running has no lease (free at once) and
    no key identity (None: the server refuses to guess its rights)."""
    path = tmp_path / "jobs.sqlite"
    db = sqlite3.connect(path)
    db.executescript("""CREATE TABLE jobs (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, path TEXT NOT NULL, headers TEXT NOT NULL,
    body BLOB NOT NULL, status TEXT NOT NULL, attempts INTEGER NOT NULL DEFAULT 0,
    completions INTEGER NOT NULL DEFAULT 0, created_at REAL NOT NULL, finished_at REAL,
    result_status INTEGER, result_headers TEXT, result_body BLOB, callback_url TEXT,
    callback_status TEXT, seq INTEGER NOT NULL);
    INSERT INTO jobs (id, tenant, path, headers, body, status, created_at, seq)
    VALUES ('old', 't', '/p', '{}', x'00', 'running', 0, 1);""")
    db.close()
    store = JobStore(path)
    assert store.recover() == 1
    job = store.claim()
    assert job.id == "old" and job.key_id is None
    assert store.complete("old", 200, {}, b"ok") is True
    store.close()


@needs_redis
def test_a_redis_store_of_an_older_version_gives_back_its_running_jobs() -> None:
    import redis

    client = redis.Redis.from_url(str(REDIS_URL))
    client.flushdb()
    client.hset("old:job:j1", mapping={"tenant": "t", "path": "/p", "headers": "{}",
                                       "body": "x", "status": "running", "attempts": 1})
    client.rpush("old:jobs:running", "j1")
    store = RedisJobStore(str(REDIS_URL), prefix="old:")
    try:
        assert store.recover() == 1
        job = store.claim()
        assert job.id == "j1" and job.key_id is None and job.attempts == 2
    finally:
        store.close()
        client.close()


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
