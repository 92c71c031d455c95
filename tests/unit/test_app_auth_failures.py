"""Failures are counted after authorisation, against the caller's own tenant: a request
refused for its key (401, or 403 for a model outside the tenant's list) counts in
``sokuji_auth_failures_total`` only, never in the model's statistics, requests or SLOs
(anyone can send one); a failure after authorisation counts for the model and the tenant."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from sokuji import config as cfg
from tests.conftest import client_for

BODY = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["hi"]}]}
INFER = "/v2/models/synth/infer"
OPS = {"authorization": "Bearer key-of-ops-00000001"}
ACME = {"authorization": "Bearer key-of-acme-0000001"}
BOLT = {"authorization": "Bearer key-of-bolt-0000001"}  # may use "other" only


@pytest.fixture(scope="module")
def keyed() -> Iterator[TestClient]:
    models = tuple(cfg.ModelConfig(name=n, runtime="synthetic", options={"base_ms": 0.0})
                   for n in ("synth", "other"))
    config = cfg.validate(cfg.ServerConfig(
        models=models,
        api_keys=(cfg.ApiKey(key=OPS["authorization"][7:], tenant="ops", admin=True),
                  cfg.ApiKey(key=ACME["authorization"][7:], tenant="acme"),
                  cfg.ApiKey(key=BOLT["authorization"][7:], tenant="bolt",
                             models=("other",))),
        slos=(cfg.SloConfig(tenant="acme", p99_ms=100.0), cfg.SloConfig(tenant="bolt",
                                                                        p99_ms=100.0)),
        cache_dir=tempfile.mkdtemp(prefix="sokuji-test-")))
    with client_for(config) as client:
        yield client


def figures(client: TestClient) -> dict[str, Any]:
    """synth's statistics, its request counters and the auth failures, as an admin sees them."""
    r = client.get("/v2/models/synth/stats", headers=OPS)
    assert r.status_code == 200, r.text
    (stats,) = r.json()["model_stats"]
    lines = client.get("/metrics", headers=OPS).text.splitlines()

    def counter(prefix: str) -> dict[str, float]:
        return {line.split(" ")[0]: float(line.rsplit(" ", 1)[1]) for line in lines
                if line.startswith(prefix)}

    slo = client.app.metrics.slo.snapshot()  # type: ignore[attr-defined]
    return {"fail": stats["inference_stats"]["fail"]["count"],
            "success": stats["inference_stats"]["success"]["count"],
            "requests": counter('sokuji_requests_total{model="synth"'),
            "auth": counter("sokuji_auth_failures_total"),
            "slo": {(w["model"], w["tenant"]): w["requests"] for w in slo}}


def test_refusals_for_the_key_count_for_no_model(keyed: TestClient) -> None:
    """The attack: 50 requests with a wrong key (and 10 with none, 20 from a tenant that may
    not use the model) to a model; before, each counted as a failure of ``synth`` and in
    ``sokuji_requests_total{model="synth",status="401"|"403"}``."""
    before = figures(keyed)
    for i in range(50):
        r = keyed.post(INFER, json=BODY, headers={"authorization": f"Bearer wrong-key-{i:04}"})
        assert r.status_code == 401
    for _ in range(10):
        assert keyed.post(INFER, json=BODY).status_code == 401
        assert keyed.get(INFER).status_code == 401  # the key first, then the method
    for _ in range(20):
        assert keyed.post(INFER, json=BODY, headers=BOLT).status_code == 403
        assert keyed.get(INFER, headers=BOLT).status_code == 405  # (not bolt's model: no count)
    r = keyed.post("/v1/chat/completions", headers=BOLT, json={
        "model": "synth", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 403
    after = figures(keyed)
    assert (after["fail"], after["success"], after["requests"], after["slo"]) == \
        (before["fail"], before["success"], before["requests"], before["slo"])
    auth = {k: after["auth"].get(k, 0) - before["auth"].get(k, 0) for k in after["auth"]}
    assert auth == {'sokuji_auth_failures_total{status="401"}': 70,
                    'sokuji_auth_failures_total{status="403"}': 21}  # no model, no tenant


def test_a_failure_after_authorisation_counts_for_the_model_and_the_tenant(
        keyed: TestClient) -> None:
    before = figures(keyed)
    assert keyed.post(INFER, json={"inputs": []}, headers=ACME).status_code == 400
    assert keyed.get(INFER, headers=ACME).status_code == 405
    assert keyed.post(INFER, json=BODY, headers=ACME).status_code == 200
    after = figures(keyed)
    assert after["fail"] - before["fail"] == 2 and after["success"] - before["success"] == 1
    requests = {k: v - before["requests"].get(k, 0) for k, v in after["requests"].items()}
    assert requests == {'sokuji_requests_total{model="synth",status="400"}': 1,
                        'sokuji_requests_total{model="synth",status="405"}': 1,
                        'sokuji_requests_total{model="synth",status="200"}': 1}
    assert after["slo"][("synth", "acme")] - before["slo"].get(("synth", "acme"), 0) == 3
    assert ("synth", "bolt") not in after["slo"]  # bolt's refusals touched no SLO of synth
