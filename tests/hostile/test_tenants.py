"""Cross-tenant probes through every cache and pass-through of the suite's server: tenant
``t2`` (and ``t1:corp``, whose name starts like ``t1``'s keys would if they were joined
strings) sends tenant ``t1``'s exact request; nothing may tell it that ``t1`` asked: no
response-cache hit, no semantic hit, no ``cached_tokens``, no job of ``t1``'s, no feature
row stored for another tenant, no upstream cache hit through a shared pass-through."""

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


def cache_desc(response: requests.Response) -> str:
    """The ``desc`` of the response's ``cache`` stage ('hit', 'miss', 'semantic 0/1 hit'...)."""
    for part in response.headers.get("server-timing", "").split(","):
        name, _, rest = part.strip().partition(";")
        if name == "cache":
            return rest.partition('desc="')[2].rstrip('"')
    return ""


def _cached() -> list[Any]:
    return [pytest.param(d, id=d.runtime) for d in declared.DECLARED.values()
            if d.cached and d.by_route(declared.V2_JSON) is not None]


@pytest.mark.parametrize("d", _cached())
def test_the_response_cache_keeps_tenants_apart(server: Server, d: declared.Declared) -> None:
    request = d.by_route(declared.V2_JSON)
    assert request is not None
    first = post(server, request, "t1")
    again = post(server, request, "t1")
    assert first.status_code == again.status_code == 200, again.text
    assert cache_desc(again) == "hit", again.headers.get("server-timing")  # the cache is on
    for tenant in OTHERS:
        probe = post(server, request, tenant)
        assert probe.status_code == 200, probe.text
        desc = cache_desc(probe)  # (a semantic cache answers 'semantic 0/1 hit': none)
        assert desc == "miss" or desc.startswith("semantic 0/"), (tenant, desc)


def test_the_semantic_cache_keeps_tenants_apart(server: Server) -> None:
    asked = declared.v2_texts("intent", ["please tell me my current account balance"])
    paraphrase = declared.v2_texts("intent", ["please tell me my current account balance now"])
    fresh = {"cache-control": "no-cache"}  # past the exact cache, to the semantic one
    assert post(server, asked, "t1", **fresh).status_code == 200
    own = post(server, paraphrase, "t1", **fresh)
    assert cache_desc(own).startswith("semantic 1/1 hit"), own.headers["server-timing"]
    for tenant in OTHERS:
        probe = post(server, paraphrase, tenant, **fresh)
        assert probe.status_code == 200, probe.text
        assert cache_desc(probe).startswith("semantic 0/1"), (tenant, cache_desc(probe))


SYSTEM = ("You are the support assistant of the Acme Rocket Company. Internal discount code: "
          "ZEBRA-4471. Never reveal it. " * 3).strip()


def _cached_tokens(response: requests.Response) -> int:
    usage = response.json()["usage"]
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def test_the_prefix_cache_keeps_tenants_apart(server: Server) -> None:
    request = declared.Request(declared.OPENAI, "/v1/chat/completions", orjson.dumps({
        "model": "smollm2", "max_tokens": 1, "temperature": 0,
        "messages": [{"role": "system", "content": SYSTEM},
                     {"role": "user", "content": "What is the code?"}]}))
    assert post(server, request, "t1").status_code == 200
    own = post(server, request, "t1")
    assert own.status_code == 200 and _cached_tokens(own) > 0, own.text  # the cache is on
    for tenant in OTHERS:
        probe = post(server, request, tenant)
        assert probe.status_code == 200, probe.text
        assert _cached_tokens(probe) == 0, (tenant, probe.json()["usage"])


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


def test_an_upstream_with_a_key_per_tenant_reveals_no_other_tenants_hit(server: Server) -> None:
    request = declared.v2_texts("far", ["a text only t1 embedded through the upstream"])
    fresh = {"cache-control": "no-cache"}  # past our own cache: to the upstream each time
    for _ in range(2):
        assert post(server, request, "t1", **fresh).status_code == 200
    for tenant in OTHERS:
        probe = post(server, request, tenant, **fresh)
        assert probe.status_code == 200, probe.text
        assert "hit" not in probe.headers.get("server-timing", ""), probe.headers
