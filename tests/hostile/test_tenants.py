"""Cross-tenant probes beyond the caches (those: ``test_tenant_isolation.py``, one test over
every cache and pass-through): tenant ``t2`` (and ``t1:corp``, whose name starts like
``t1``'s keys would if they were joined strings) finds no job of ``t1``'s, and no keyed
tenant reads a feature row stored for another."""

from __future__ import annotations

import time
from typing import Any

import orjson
import pytest
import requests

from tests.hostile import declared
from tests.hostile.conftest import KEYS, Server, auth, post

pytestmark = pytest.mark.integration

OTHERS = ("t2", "t1:corp")
"""The tenants that probe ``t1``'s entries."""


def test_a_job_is_its_tenants_only(server: Server) -> None:
    request = declared.v2_texts("synth", ["a job of t1's"])
    submitted = post(server, request, "t1", prefer="respond-async")
    assert submitted.status_code == 202, submitted.text
    location = submitted.headers["location"]
    for tenant in OTHERS:
        for tail in ("", "/result"):
            probe = requests.get(server.url + location + tail, headers=auth(tenant), timeout=10)
            assert probe.status_code == 404, (tenant, probe.text)
            assert "no job" in probe.json()["error"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        own = requests.get(server.url + location + "/result", headers=auth("t1"), timeout=10)
        if own.status_code != 202:
            break
        time.sleep(0.05)  # polling the job's own progress
    assert own.status_code == 200, own.text


@pytest.mark.parametrize("job_id", ["t1:corp", "..%2F..%2Fjobs", "%00", "a" * 300,
                                    "t2%3Ajob", "x/../../v2/health/ready"])
def test_job_ids_with_separators_find_nothing(server: Server, job_id: str) -> None:
    r = requests.get(f"{server.url}/v2/jobs/{job_id}", headers=auth("t1"), timeout=10)
    assert r.status_code == 404, r.text
    assert r.json()["error"]


def _plan(server: Server, tenant: str, user: str) -> Any:
    r = post(server, declared.v2_texts("profile", [user], name="user"), tenant,
             **{"cache-control": "no-cache"})
    assert r.status_code == 200, r.text
    return orjson.loads(r.json()["outputs"][0]["data"][0])["plan"]


def test_a_keyed_tenant_reads_only_its_own_feature_rows(server: Server) -> None:
    # The built-in store's rows are unprefixed ('user-0001': plan 'pro'): no keyed tenant's.
    for tenant in ("t1", "t2", "t1:corp"):
        assert _plan(server, tenant, "user-0001") is None, tenant
        assert _plan(server, tenant, "corp:user-0001") is None, tenant


def test_a_tenant_named_anonymous_reads_no_one_elses_feature_rows(server: Server) -> None:
    assert "anonymous" in KEYS
    assert _plan(server, "anonymous", "user-0001") is None
