"""Asynchronous inference in-process: 202 + Location, polling, results, tenants, quotas, expiry
and retries of transient answers (callbacks: test_callbacks.py)."""

from __future__ import annotations

import asyncio
import json
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from sokuji import config as cfg
from sokuji.core.job import JobStatus
from sokuji.server import jobs as server_jobs
from sokuji.server.auth import Authenticator
from sokuji.server.http import Reply
from sokuji.stores.jobs_sqlite import JobStore
from tests.conftest import client_for

INFER = "/v2/models/synth/infer"
ASYNC = {"prefer": "respond-async"}


def body(text: str) -> dict[str, Any]:
    return {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [text]}]}


def server_config(**extra: Any) -> cfg.ServerConfig:
    model = cfg.ModelConfig(name="synth", runtime="synthetic", options={"base_ms": 1.0})
    other = cfg.ModelConfig(name="other", runtime="synthetic", options={"base_ms": 1.0})
    extra.setdefault("cache_dir", tempfile.mkdtemp())
    return cfg.validate(cfg.ServerConfig(models=(model, other), **extra))


@pytest.fixture
def client() -> Iterator[TestClient]:
    with client_for(server_config()) as c:
        yield c


def finished(client: TestClient, location: str, headers: dict[str, str] | None = None,
             timeout_s: float = 5.0) -> dict[str, Any]:
    """Poll a job until it ends (the server runs it on its own loop meanwhile)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        doc = client.get(location, headers=headers).json()
        if doc["status"] in ("done", "failed"):
            return doc
    raise TimeoutError(location)


def test_respond_async_gives_202_and_the_same_result_later(client: TestClient) -> None:
    sync = client.post(INFER, json=body("hello"))
    r = client.post(INFER, json=body("hello"), headers=ASYNC)
    assert r.status_code == 202
    assert r.headers["location"] == r.json()["location"] == f"/v2/jobs/{r.json()['id']}"
    assert r.headers["preference-applied"] == "respond-async"
    doc = finished(client, r.headers["location"])
    assert doc["status"] == "done" and doc["attempts"] == 1
    result = client.get(doc["result"])
    assert result.status_code == 200 and result.json() == sync.json()


def test_openai_embeddings_can_be_async_too(client: TestClient) -> None:
    r = client.post("/v1/embeddings", json={"model": "synth", "input": ["a", "bb"]},
                    headers=ASYNC)
    assert r.status_code == 202
    doc = finished(client, r.headers["location"])
    assert [d["embedding"] for d in client.get(doc["result"]).json()["data"]] == [[1.0], [2.0]]


def test_a_job_that_fails_records_its_error_as_its_result(client: TestClient) -> None:
    r = client.post(INFER, json={"inputs": []}, headers=ASYNC)
    doc = finished(client, r.headers["location"])
    assert doc["status"] == "failed"
    result = client.get(doc["result"])
    assert result.status_code == 400 and "'inputs' must be a non-empty list" in \
        result.json()["error"]


def test_what_can_be_checked_at_once_is(client: TestClient) -> None:
    assert client.post("/v2/models/nope/infer", json=body("x"), headers=ASYNC).status_code \
        == 404
    r = client.post("/v1/embeddings", json={"input": "x"}, headers=ASYNC)
    assert r.status_code == 400 and "'model' is required" in r.json()["error"]["message"]
    r = client.post(INFER, json=body("x"), headers={**ASYNC, "x-sokuji-callback-url": "ftp://x"})
    assert r.status_code == 400
    assert client.get("/v2/jobs/0123456789abcdef").status_code == 404
    assert client.get("/v2/jobs/").status_code == 404
    assert client.post("/v2/jobs/anything").status_code == 405


KEYS = (cfg.ApiKey(key="key-of-acme-0001", tenant="acme"),
        cfg.ApiKey(key="key-of-bolt-0002", tenant="bolt", models=("synth",)))


def test_jobs_belong_to_their_tenant() -> None:
    acme = {"authorization": "Bearer key-of-acme-0001"}
    bolt = {"authorization": "Bearer key-of-bolt-0002"}
    with client_for(server_config(api_keys=KEYS)) as client:
        assert client.post(INFER, json=body("x"), headers=ASYNC).status_code == 401
        r = client.post("/v2/models/other/infer", json=body("x"), headers={**ASYNC, **bolt})
        assert r.status_code == 403
        r = client.post(INFER, json=body("x"), headers={**ASYNC, **acme})
        location = r.headers["location"]
        finished(client, location, acme)
        assert client.get(location, headers=bolt).status_code == 404  # not bolt's job
        assert client.get(location).status_code == 401


def test_a_job_without_callback_says_so_and_bad_ids_are_404(client: TestClient) -> None:
    r = client.post(INFER, json=body("x"), headers=ASYNC)
    doc = finished(client, r.headers["location"])
    assert doc["callback"] is None
    assert doc["expires_at"] == pytest.approx(doc["finished_at"] + 86400.0)
    for bad in ("../etc", "X" * 32, r.json()["id"].upper(), r.json()["id"] + "/other"):
        assert client.get(f"/v2/jobs/{bad}").status_code == 404


def gate_jobs(client: TestClient) -> threading.Event:
    """Hold every job's run until the returned event is set (a gate on the job runner)."""
    jobs = client.app.jobs  # type: ignore[attr-defined]
    original, gate = jobs._respond, threading.Event()

    async def gated(*args: Any, **kwargs: Any) -> Any:
        await asyncio.to_thread(gate.wait, 30)
        return await original(*args, **kwargs)

    jobs._respond = gated
    return gate


def test_a_tenant_has_a_quota_of_unfinished_jobs() -> None:
    keys = (cfg.ApiKey(key="key-of-acme-0001", tenant="acme"),
            cfg.ApiKey(key="key-of-bolt-0002", tenant="bolt", max_pending_jobs=1))
    acme = {**ASYNC, "authorization": "Bearer key-of-acme-0001"}
    bolt = {**ASYNC, "authorization": "Bearer key-of-bolt-0002"}
    jobs = cfg.JobsConfig(max_pending_per_tenant=2, concurrency=1)
    with client_for(server_config(api_keys=keys, jobs=jobs)) as client:
        gate = gate_jobs(client)
        first = [client.post(INFER, json=body("x"), headers=acme) for _ in range(2)]
        assert [r.status_code for r in first] == [202, 202]  # one running, one queued
        r = client.post(INFER, json=body("x"), headers=acme)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert "tenant 'acme' already has 2 unfinished jobs" in r.json()["error"]
        assert client.post(INFER, json=body("x"), headers=bolt).status_code == 202
        r = client.post(INFER, json=body("x"), headers=bolt)  # its key's own quota: 1
        assert r.status_code == 429 and "already has 1 unfinished" in r.json()["error"]
        gate.set()
        for job in first:
            finished(client, job.headers["location"], acme)
        assert client.post(INFER, json=body("x"), headers=acme).status_code == 202


def test_a_finished_job_expires_after_its_ttl() -> None:
    jobs = cfg.JobsConfig(result_ttl_s=1.0)
    with client_for(server_config(jobs=jobs)) as client:
        r = client.post(INFER, json=body("x"), headers=ASYNC)
        location, states = r.headers["location"], []
        deadline = time.monotonic() + 20
        while (status := client.get(location)).status_code == 200:  # polls across the TTL
            states.append(status.json()["status"])
            assert time.monotonic() < deadline
        assert status.status_code == 404 and states[-1] == "done"
        assert client.get(f"{location}/result").status_code == 404


def test_a_transient_answer_is_retried_until_max_attempts(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """A deadline that cannot be met answers 504 each time: the job runs max_attempts times
    (waiting between runs), then the 504 is its result."""
    monkeypatch.setattr(server_jobs, "RETRY_BACKOFF", replace(server_jobs.RETRY_BACKOFF,
                                                                base_s=0.01))
    late = {**body("x"), "parameters": {"timeout": 1}}  # 1 us: never met
    with client_for(server_config(jobs=cfg.JobsConfig(max_attempts=3))) as client:
        assert client.post(INFER, json=late).status_code == 504
        r = client.post(INFER, json=late, headers=ASYNC)
        doc = finished(client, r.headers["location"], timeout_s=30)
        assert doc["status"] == "failed" and doc["attempts"] == 3
        result = client.get(doc["result"])
        assert result.status_code == 504 and "deadline" in result.text.lower()


def test_a_failure_that_is_not_transient_is_final_at_once(client: TestClient) -> None:
    r = client.post("/v2/models/other/infer", json={"inputs": [{"name": "nope"}]},
                    headers=ASYNC)
    doc = finished(client, r.headers["location"])
    assert doc["status"] == "failed" and doc["attempts"] == 1


async def test_the_runner_retries_transient_answers_with_backoff(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """JobService over a real SQLite store and a scripted inference path: 503, 429 (with
    Retry-After: 0), then 200. The job ends done, after three runs, with one completion."""
    monkeypatch.setattr(server_jobs, "RETRY_BACKOFF", replace(server_jobs.RETRY_BACKOFF,
                                                                base_s=0.01))
    answers = [Reply(503, b"busy", {}), Reply(429, b"full", {"retry-after": "0"}),
               Reply(200, b"{}", {"content-type": "application/json"})]
    seen: list[int] = []

    async def respond(*args: Any) -> Reply:
        seen.append(len(seen))
        return answers[len(seen) - 1]

    config = server_config(cache_dir=str(tmp_path), jobs=cfg.JobsConfig(max_attempts=5))
    store = JobStore(tmp_path / "jobs.sqlite")
    service = server_jobs.JobService(store, Authenticator(()), config)
    job_id = store.submit("anonymous", INFER, {}, b"{}")
    service.start(respond, lambda *_: None)
    try:
        deadline = time.monotonic() + 30
        while (job := store.get(str(job_id))) is not None and job.status is not JobStatus.DONE:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)  # the runner works on this loop meanwhile
        assert job is not None and job.attempts == 3 and job.completions == 1
        assert job.result_status == 200 and len(seen) == 3
    finally:
        await service.stop()


def test_backoff_doubles_and_honours_retry_after() -> None:
    base = server_jobs.RETRY_BACKOFF.base_s
    assert base <= server_jobs.backoff_s(1, None) <= base * 1.25
    assert base * 4 <= server_jobs.backoff_s(3, None) <= base * 5
    assert 30 <= server_jobs.backoff_s(1, "30") <= 37.5
    assert server_jobs.backoff_s(40, None) <= server_jobs.RETRY_BACKOFF.cap_s * 1.25
    assert base <= server_jobs.backoff_s(1, "soon") <= base * 1.25


# --- a job runs with exactly the rights of the key that submitted it -------------------------
WIDE = cfg.ApiKey(key="key-of-acme-wide", tenant="acme")
NARROW = cfg.ApiKey(key="key-of-acme-narrow", tenant="acme", models=("synth",),
                    max_priority="batch")


def record_runs(client: TestClient) -> list[tuple[dict[str, str], Any]]:
    """What the runner hands the inference path for each job: (headers, tenant)."""
    jobs = client.app.jobs  # type: ignore[attr-defined]
    original, seen = jobs._respond, []

    async def recording(method: str, path: str, headers: dict[str, str], *args: Any) -> Any:
        seen.append((headers, args[-1]))
        return await original(method, path, headers, *args)

    jobs._respond = recording
    return seen


@pytest.mark.parametrize("keys", [(WIDE, NARROW), (NARROW, WIDE)], ids=["wide-first",
                                                                       "narrow-first"])
def test_a_job_runs_with_its_own_keys_rights_and_priority(keys: tuple[cfg.ApiKey, ...]
                                                          ) -> None:
    """Two keys of one tenant: each job runs with its own key's models and ceiling, whatever
    the order of the keys in the config, and its priority is the one the sync call gets."""
    interactive = {**ASYNC, "x-sokuji-priority": "interactive"}
    with client_for(server_config(api_keys=keys)) as client:
        seen = record_runs(client)
        wide = {"authorization": f"Bearer {WIDE.key}"}
        narrow = {"authorization": f"Bearer {NARROW.key}"}
        r = client.post("/v2/models/other/infer", json=body("x"), headers={**interactive,
                                                                            **wide})
        assert finished(client, r.headers["location"], wide)["status"] == "done"
        assert client.post("/v2/models/other/infer", json=body("x"),
                           headers={**interactive, **narrow}).status_code == 403
        r = client.post(INFER, json=body("x"), headers={**interactive, **narrow})
        assert finished(client, r.headers["location"], narrow)["status"] == "done"
        r = client.post(INFER, json=body("x"), headers={**ASYNC, **wide})
        assert finished(client, r.headers["location"], wide)["status"] == "done"
        r = client.post(INFER, json=body("x"), headers={**ASYNC, **wide,
                                                        "x-sokuji-priority": "urgent"})
        assert r.status_code == 400  # a bad priority is refused at submit, not stored
    (wide_h, wide_t), (narrow_h, narrow_t), (default_h, _) = seen
    assert wide_h["x-sokuji-priority"] == "interactive" and wide_t.models is None
    assert narrow_h["x-sokuji-priority"] == "batch"  # the ceiling, settled at submit
    assert narrow_t.max_priority == "batch" and narrow_t.models == frozenset({"synth"})
    assert default_h["x-sokuji-priority"] == "batch"  # jobs default to batch


def test_a_job_whose_key_is_gone_is_not_run_and_says_why(tmp_path: Path) -> None:
    """Jobs stored earlier: by a key removed since (401), by a key now given to another
    tenant (403), by an older version that did not record the key (401), while the server
    needed no key (401, and a 404 to every keyed tenant, whatever its name). None runs with
    wider rights; each has a stored answer naming why, never a 500."""
    from sokuji.server.auth import key_id

    store = JobStore(tmp_path / "jobs.sqlite")
    gone = store.submit("acme", INFER, {}, b"{}", key_id=key_id("key-of-acme-removed"))
    moved = store.submit("acme", INFER, {}, b"{}", key_id=key_id("key-of-bolt-0002"))
    old = store.submit("acme", INFER, {}, b"{}")
    keyless = store.submit("acme", INFER, {}, b"{}", key_id="")  # the server was open then
    store.close()
    config = server_config(api_keys=KEYS, cache_dir=str(tmp_path))
    acme = {"authorization": "Bearer key-of-acme-0001"}
    with client_for(config) as client:
        for job_id, status, words in ((gone, 401, "no longer configured"),
                                      (moved, 403, "another tenant"),
                                      (old, 401, "older version")):
            doc = finished(client, f"/v2/jobs/{job_id}", acme)
            assert doc["status"] == "failed" and doc["attempts"] == 1
            result = client.get(doc["result"], headers=acme)
            assert result.status_code == status and words in result.text
        assert client.get(f"/v2/jobs/{keyless}", headers=acme).status_code == 404
    store = JobStore(tmp_path / "jobs.sqlite")
    job = store.get(keyless)
    store.close()
    assert job is not None and job.status is JobStatus.FAILED and job.result_status == 401
    assert b"needed no API key" in (job.result_body or b"")


def test_a_keyed_tenant_named_anonymous_does_not_read_the_open_servers_jobs(
        tmp_path: Path) -> None:
    """An open server's jobs are the tenant ``anonymous``'s, with no key. Restarted with keys,
    a tenant named ``anonymous`` read them by name (their status, and the result of one that
    finished while open); now a job stored without a key is nobody's once keys exist."""
    open_config = server_config(cache_dir=str(tmp_path))
    with client_for(open_config) as client:
        location = client.post(INFER, json=body("secret"), headers=ASYNC).headers["location"]
        assert finished(client, location)["status"] == "done"
    keyed = server_config(cache_dir=str(tmp_path), api_keys=(
        cfg.ApiKey(key="key-of-anonymous-01", tenant="anonymous"),))
    with client_for(keyed) as client:
        named = {"authorization": "Bearer key-of-anonymous-01"}
        assert client.get(location, headers=named).status_code == 404
        assert client.get(f"{location}/result", headers=named).status_code == 404


def test_quotas_are_checked_before_the_callback_host_is_looked_up(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from sokuji.server import callbacks

    looked_up: list[str] = []

    def lookup(host: str, port: int) -> list[str]:
        looked_up.append(host)
        return ["93.184.215.14"]

    monkeypatch.setattr(callbacks, "lookup", lookup)
    keys = (cfg.ApiKey(key="key-of-acme-0001", tenant="acme", max_pending_jobs=1),
            cfg.ApiKey(key="key-of-bolt-0002", tenant="bolt"))
    hook = {**ASYNC, "x-sokuji-callback-url": "http://hook.test/"}
    acme = {**hook, "authorization": "Bearer key-of-acme-0001"}
    bolt = {**hook, "authorization": "Bearer key-of-bolt-0002"}
    with client_for(server_config(api_keys=keys, jobs=cfg.JobsConfig(concurrency=1))) as client:
        gate = gate_jobs(client)
        assert client.post(INFER, json=body("x"), headers=acme).status_code == 202
        assert looked_up == ["hook.test"]
        r = client.post(INFER, json=body("x"), headers=acme)
        assert r.status_code == 429 and "already has 1 unfinished" in r.json()["error"]
        client.app.jobs.max_stored_bytes = 10  # type: ignore[attr-defined]
        r = client.post(INFER, json=body("x"), headers=bolt)
        assert r.status_code == 429 and "more than 10 bytes" in r.json()["error"]
        assert looked_up == ["hook.test"]  # neither refusal cost a lookup
        gate.set()


def test_a_tenant_has_a_bound_on_stored_bytes_and_bodies_are_freed() -> None:
    """Bodies of unfinished jobs count against the tenant's stored bytes; once a job is done
    its body is deleted and only its result counts."""
    payload = body("x" * 1000)
    size = len(json.dumps(payload))
    with client_for(server_config(jobs=cfg.JobsConfig(concurrency=1))) as client:
        jobs = client.app.jobs  # type: ignore[attr-defined]
        jobs.max_stored_bytes = 2 * size + size // 2
        gate = gate_jobs(client)
        first = [client.post(INFER, json=payload, headers=ASYNC) for _ in range(2)]
        assert [r.status_code for r in first] == [202, 202]
        r = client.post(INFER, json=payload, headers=ASYNC)
        assert r.status_code == 429 and r.headers["retry-after"] == "60"
        assert f"more than {jobs.max_stored_bytes} bytes" in r.json()["error"]
        gate.set()
        for job in first:
            finished(client, job.headers["location"])
            assert jobs.store.get(job.json()["id"]).body == b""
        assert client.post(INFER, json=payload, headers=ASYNC).status_code == 202
