"""Callbacks are delivered from the store: after a restart too, a tenant's backlog cannot take
every delivery slot, each tenant signs with its own key (``sokuji callback-secret`` prints
it), and a key's allowlist serves that key's jobs only. Real listeners on loopback."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from sokuji import cli
from sokuji import config as cfg
from sokuji.server import callback_delivery as delivery
from sokuji.stores.jobs_redis import RedisJobStore
from sokuji.stores.jobs_sqlite import JobStore
from tests.conftest import client_for
from tests.unit.test_callbacks import (
    ASYNC,
    BODY,
    INFER,
    REFUSED,
    app_config,
    callback_outcome,
    listening,
)

REDIS_URL = os.environ.get("SOKUJI_TEST_REDIS_URL")
needs_redis = pytest.mark.skipif(REDIS_URL is None, reason="SOKUJI_TEST_REDIS_URL not set")


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def test_each_tenant_signs_with_its_own_key_and_the_cli_prints_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two tenants without their own secret get different derived keys (tenant A cannot aim
    a validly signed callback at tenant B's receiver); a key's own secret wins."""
    path = tmp_path / "sokuji.toml"
    path.write_text(f"""
cache_dir = "{tmp_path / 'cache'}"
[jobs]
callback_allow = ["127.0.0.1"]
[[models]]
name = "synth"
runtime = "synthetic"
options = {{base_ms = 1.0}}
[[api_keys]]
key = "key-of-acme-0001"
tenant = "acme"
[[api_keys]]
key = "key-of-bolt-0002"
tenant = "bolt"
[[api_keys]]
key = "key-of-carl-0003"
tenant = "carl"
callback_secret = "carl-own-secret-0123456789"
""")
    config = cfg.load(path)
    with listening() as hook, client_for(config) as client:
        for key in ("key-of-acme-0001", "key-of-bolt-0002", "key-of-carl-0003"):
            r = client.post(INFER, json=BODY, headers={**ASYNC, **bearer(key),
                                                       "x-sokuji-callback-url": hook.url})
            assert callback_outcome(client, r.headers["location"], bearer(key)) == "delivered"
    by_tenant = {h["x-sokuji-tenant"]: (h, data) for _, h, data in hook.requests}
    assert sorted(by_tenant) == ["acme", "bolt", "carl"]

    def printed(tenant: str) -> str:
        assert cli.main(["callback-secret", tenant, "--config", str(path)]) == 0
        return capsys.readouterr().out.strip()

    def verifies(secret: str, tenant: str) -> bool:
        headers, data = by_tenant[tenant]
        return delivery.verify(secret, headers["x-sokuji-timestamp"],
                               headers["x-sokuji-signature"], data)

    acme, bolt = printed("acme"), printed("bolt")
    assert acme != bolt
    assert verifies(acme, "acme") and verifies(bolt, "bolt")
    assert not verifies(acme, "bolt") and not verifies(bolt, "acme")
    assert verifies("carl-own-secret-0123456789", "carl")
    assert cli.main(["callback-secret", "carl", "--config", str(path)]) == 0
    assert "sign with their own callback_secret" in capsys.readouterr().err


def test_a_keys_allowlist_serves_that_keys_jobs_only() -> None:
    keys = (cfg.ApiKey(key="key-of-acme-inside", tenant="acme", callback_allow=("127.0.0.1",)),
            cfg.ApiKey(key="key-of-acme-public", tenant="acme"),
            cfg.ApiKey(key="key-of-bolt-public", tenant="bolt"))
    with listening() as hook, client_for(app_config(keys=keys)) as client:
        inside = bearer("key-of-acme-inside")
        r = client.post(INFER, json=BODY, headers={**ASYNC, **inside,
                                                   "x-sokuji-callback-url": hook.url})
        assert r.status_code == 202
        assert callback_outcome(client, r.headers["location"], inside) == "delivered"
        for key in ("key-of-acme-public", "key-of-bolt-public"):  # same tenant or not
            r = client.post(INFER, json=BODY, headers={**ASYNC, **bearer(key),
                                                       "x-sokuji-callback-url": hook.url})
            assert r.status_code == 400 and r.json()["error"] == REFUSED
    assert len(hook.requests) == 1


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("redis", marks=needs_redis)])
def test_due_callbacks_are_delivered_after_a_restart(tmp_path: Path, backend: str) -> None:
    """A job that finished just before the server died: its callback is due in the store,
    and the next server delivers it."""
    with listening() as hook:
        if backend == "redis":
            import redis

            redis.Redis.from_url(str(REDIS_URL)).flushdb()
            store: Any = RedisJobStore(str(REDIS_URL))
            jobs = {"backend": "redis", "redis_url": str(REDIS_URL)}
        else:
            store, jobs = JobStore(tmp_path / "jobs.sqlite"), {}
        job_id = store.submit("anonymous", INFER, {}, b"{}", hook.url, key_id="")
        assert isinstance(job_id, str) and store.claim() is not None
        assert store.complete(job_id, 200, {"content-type": "application/json"}, b'{"a": 1}')
        store.close()
        config = app_config(("127.0.0.1",), cache_dir=str(tmp_path), **jobs)
        with client_for(config) as client:
            assert callback_outcome(client, f"/v2/jobs/{job_id}") == "delivered"
    (_, headers, data), = hook.requests
    secret = delivery.tenant_secret((tmp_path / "callback_secret").read_text().strip(),
                                    "anonymous")
    assert delivery.verify(secret, headers["x-sokuji-timestamp"],
                           headers["x-sokuji-signature"], data)
    assert json.loads(data) == {"id": job_id, "status": 200,
                                "content_type": "application/json", "body": '{"a": 1}'}


def test_a_delivery_cut_short_by_a_stop_is_made_again_after_the_restart(
        tmp_path: Path) -> None:
    """The attempt in flight at shutdown holds a lease in the store; when it passes, the next
    server delivers again (at least once: the receiver sees the same job id twice)."""
    hold = threading.Event()
    config = app_config(("127.0.0.1",), cache_dir=str(tmp_path), timeout_s=30.0)
    with listening(hold=hold) as hook:
        with client_for(config) as client:
            client.app.jobs.deliveries.lease_s = 0.5  # type: ignore[attr-defined]
            r = client.post(INFER, json=BODY, headers={**ASYNC,
                                                       "x-sokuji-callback-url": hook.url})
            deadline = time.monotonic() + 30
            while hook.busy == 0:  # the attempt has reached the receiver
                assert time.monotonic() < deadline
                time.sleep(0.01)
        hold.set()  # the receiver answers the first attempt now: too late
        with client_for(config) as client:
            assert callback_outcome(client, r.headers["location"]) == "delivered"
    ids = [headers["x-sokuji-job-id"] for _, headers, _ in hook.requests]
    assert ids == [r.json()["id"]] * 2


def test_one_tenants_backlog_cannot_take_every_delivery_slot() -> None:
    """A tenant whose receiver never answers has at most MAX_DELIVERIES_PER_TENANT attempts
    in flight; another tenant's callback is delivered meanwhile; nothing else is held in
    memory for the ones that wait."""
    keys = (cfg.ApiKey(key="key-of-flood-0001", tenant="flood"),
            cfg.ApiKey(key="key-of-quiet-0002", tenant="quiet"))
    cap = delivery.MAX_DELIVERIES_PER_TENANT
    hold = threading.Event()
    config = app_config(("127.0.0.1",), keys=keys, timeout_s=60.0)
    with listening(hold=hold) as hole, listening() as hook, client_for(config) as client:
        flood = [client.post(INFER, json=BODY, headers={
            **ASYNC, **bearer("key-of-flood-0001"), "x-sokuji-callback-url": hole.url})
            for _ in range(2 * cap)]
        quiet = bearer("key-of-quiet-0002")
        r = client.post(INFER, json=BODY, headers={**ASYNC, **quiet,
                                                   "x-sokuji-callback-url": hook.url})
        assert callback_outcome(client, r.headers["location"], quiet) == "delivered"
        deadline = time.monotonic() + 30
        while hole.busy < cap:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert len(client.app.jobs.deliveries._tasks) == cap  # type: ignore[attr-defined]
        hold.set()
        for job in flood:
            assert callback_outcome(client, job.headers["location"],
                                    bearer("key-of-flood-0001")) == "delivered"
    assert hole.most_busy == cap and len(hole.requests) == 2 * cap
