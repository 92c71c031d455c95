"""What the server tells about everyone: once keys are configured, ``/metrics`` and the
dashboard's data need an admin key, the dashboard's data is bounded whatever ``since`` asks,
and a request refused before authorisation counts against no model."""

from __future__ import annotations

import time

import orjson
import pytest
import requests

from tests.hostile import declared
from tests.hostile.conftest import Server, auth, post

pytestmark = pytest.mark.integration

CLOSED = "issue 25: observability closed by default"


@pytest.mark.parametrize("path", ["/metrics", "/dashboard/data"])
def test_what_lists_every_tenant_needs_an_admin_key(server: Server, path: str) -> None:
    assert requests.get(server.url + path, timeout=10, headers=auth("ops")).status_code == 200
    anonymous = requests.get(server.url + path, timeout=10)
    assert anonymous.status_code == 401, anonymous.text[:200]
    tenant = requests.get(server.url + path, timeout=10, headers=auth("t1"))
    assert tenant.status_code == 403, tenant.text[:200]


def _points(server: Server, since: int | None) -> tuple[int, int]:
    query = "" if since is None else f"?since={since}"
    r = requests.get(f"{server.url}/dashboard/data{query}", headers=auth("ops"), timeout=10)
    assert r.status_code == 200, r.text[:200]
    doc = orjson.loads(r.content)
    return int(doc["seq"]), len(doc["points"])


def test_the_dashboard_data_past_its_last_point_is_empty(server: Server) -> None:
    deadline = time.monotonic() + 10
    seq, kept = _points(server, None)
    while kept < 3 and time.monotonic() < deadline:  # the sampler keeps a point a second
        post(server, declared.DECLARED["synthetic"].normal)
        time.sleep(0.5)
        seq, kept = _points(server, None)
    assert kept >= 3, "too few points to tell"
    _, latest = _points(server, seq)
    _, beyond = _points(server, 10 ** 12)
    assert beyond <= latest + 1, (beyond, latest)


def _count(server: Server, model: str, status: str) -> float:
    text = requests.get(f"{server.url}/metrics", headers=auth("ops"), timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("sokuji_requests_total{") and f'model="{model}"' in line \
                and f'status="{status}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_a_request_refused_before_authorisation_counts_against_no_model(
        server: Server) -> None:
    before = _count(server, "synth", "401")
    request = declared.v2_texts("synth", ["not a tenant"])
    for _ in range(5):
        r = requests.post(f"{server.url}{request.path}", data=request.body, timeout=10,
                          headers={**request.headers, "Authorization": "Bearer wrong-key-000"})
        assert r.status_code == 401 and r.json()["error"], r.text
    assert _count(server, "synth", "401") == before
