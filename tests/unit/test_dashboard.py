"""The dashboard: the sampler's figures from real metrics objects, and its routes (the page's
security headers, the data's ``since``, the rule of /metrics for keys)."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from starlette.testclient import TestClient

from sokuji import config as cfg
from sokuji.core.forming import BatchInfo
from sokuji.core.request import Stage, Timeline
from sokuji.llm.request import Timing
from sokuji.observability.metrics import Metrics
from sokuji.observability.timeseries import Sampler
from sokuji.repository.models import ModelRepository
from tests.conftest import client_for, synthetic_config

MS = 1_000_000
ADMIN, TENANT = "admin-key-0123456789", "tenant-key-0123456789"


@pytest.fixture
def sampled() -> Iterator[tuple[Metrics, Sampler]]:
    slo = cfg.SloConfig(p99_ms=50.0, window_s=60.0)
    config = synthetic_config(slo=slo)
    metrics = Metrics()
    metrics.add_slos({"synth": slo}, ())  # as create_app does
    repo = ModelRepository.load(config, on_batch=metrics.batch_observer)
    for model in repo.every():
        metrics.add_model(model.metric_name, model.served)
    sampler = Sampler(metrics, repo.every(), keep=3)
    sampler.attach()
    yield metrics, sampler
    sampler.detach()


def timeline(total_ms: int, cached: bool = False) -> Timeline:
    tl = Timeline(0)
    if cached:
        tl.mark(Stage.CACHE, total_ms * MS)
        return tl
    tl.mark(Stage.QUEUE, MS)  # 1 ms queued, the rest computing
    tl.mark(Stage.INFER, total_ms * MS)
    return tl


def last_point(sampler: Sampler) -> dict[str, Any]:
    doc = orjson.loads(sampler.since(sampler.seq - 1))
    assert [p["seq"] for p in doc["points"]] == [sampler.seq]
    return doc["points"][0]["models"]["synth"]


def test_an_interval_holds_its_own_requests_only(sampled: tuple[Metrics, Sampler]) -> None:
    metrics, sampler = sampled
    metrics.observe_request("synth", timeline(500), 200)
    sampler.tick()  # closes the first interval, with that request in it
    for total in range(1, 101):  # 1..100 ms
        metrics.observe_request("synth", timeline(total), 200)
    for _ in range(3):
        metrics.requests.labels("synth", "429").inc()
    metrics.requests.labels("synth", "503").inc()
    observe = metrics.batch_observer("synth")
    for items in (1, 2, 2, 7):
        observe(BatchInfo(num_requests=items, num_items=items, padded_tokens=items,
                          real_tokens=items))
    sampler.tick()
    m = last_point(sampler)
    assert (m["ok"], m["shed"], m["err"], m["rej"]) == (100, 3, 1, 0)
    assert (m["p50"], m["p95"], m["p99"]) == (50.0, 95.0, 99.0)  # exact, not bucketed
    stages = dict(zip([s.value for s in Stage], m["stages"], strict=True))
    assert stages["queue"] == 1.0 and stages["infer"] == 49.5 and stages["encode"] == 0.0
    assert (m["batches"], m["batch_mean"], m["batch_max"]) == (4, 3.0, 7)
    assert m["batch_bins"] == [1, 2, 0, 1]  # 1 | 2 | 3-4 | 5-8
    assert m["waiting"] == 0 and m["queue_bound"] == 1024
    assert "cache_hit" not in m  # no lookups in the interval

    sampler.tick()  # an idle second: nothing carried over
    m = last_point(sampler)
    assert (m["ok"], m["shed"], m["batches"]) == (0, 0, 0)
    assert "p99" not in m and m["batch_mean"] is None


def test_cache_hits_and_the_slo(sampled: tuple[Metrics, Sampler]) -> None:
    metrics, sampler = sampled
    for _ in range(3):
        metrics.observe_request("synth", timeline(2, cached=True), 200)  # hits
    tl = timeline(4)
    tl.durations_ns[Stage.CACHE] = 0  # a miss: looked up, then computed
    metrics.observe_request("synth", tl, 200)
    sampler.tick()
    m = last_point(sampler)
    assert m["cache_hit"] == 0.75
    metrics.observe_slo("synth", "anyone", 80.0, 200)  # (app.py feeds it in the server)
    metrics.observe_slo("synth", "anyone", None, 503)
    sampler.tick()
    slo = orjson.loads(sampler.since(None))["points"][-1]["slo"]
    assert [(s["model"], s["tenant"], s["target_p99_ms"], s["requests"], s["errors"])
            for s in slo] == [("synth", "", 50.0, 2, 1)]
    assert slo[0]["latency_ok"] is False and slo[0]["budget_remaining"] < 0


def test_generations_give_ttft_itl_and_tokens(sampled: tuple[Metrics, Sampler]) -> None:
    metrics, sampler = sampled
    for i in range(10):  # arrival 0, submitted 1, admitted 3, first token 10+i ms, 4 tokens
        first = (10 + i) * MS
        t = Timing(arrival_ns=0, submitted_ns=MS, admitted_ns=3 * MS, first_token_ns=first,
                   end_ns=first + 6 * MS, token_ns=[first + k * 2 * MS for k in range(4)])
        metrics.observe_generation("synth", t, 4, 200)
    failed = Timing(arrival_ns=0, submitted_ns=MS, end_ns=2 * MS)
    metrics.observe_generation("synth", failed, 0, 503)
    sampler.tick()
    m = last_point(sampler)
    assert m["tokens"] == 40 and m["err"] == 1
    assert (m["ttft_p50"], m["ttft_p99"]) == (14.0, 19.0)
    assert (m["itl_p50"], m["itl_p99"]) == (2.0, 2.0)
    assert m["p99"] == 25.0  # arrival to last token
    assert m["gen_stages"] == [1.0, 2.0, 11.5, 6.0]  # preprocess, queue, prefill, decode


def test_since_and_the_ring(sampled: tuple[Metrics, Sampler]) -> None:
    _, sampler = sampled
    for _ in range(5):
        sampler.tick()
    doc = orjson.loads(sampler.since(None))
    assert doc["seq"] == 5 and [p["seq"] for p in doc["points"]] == [3, 4, 5]  # keep=3
    assert doc["models"] == [{"name": "synth", "apis": ["infer", "embed"],
                              "runtime": "synthetic", "max_batch_size": 8}]
    assert [p["seq"] for p in orjson.loads(sampler.since(4))["points"]] == [5]
    assert orjson.loads(sampler.since(5))["points"] == []
    assert [p["seq"] for p in orjson.loads(sampler.since(0))["points"]] == [3, 4, 5]
    # a seq beyond the newest (a page of a run before this one, or anyone's guess): nothing;
    # the page sees ``boot`` change and asks again without ``since``
    doc = orjson.loads(sampler.since(99))
    assert (doc["points"], doc["upto"], doc["more"]) == ([], 5, False)


def test_an_answer_is_bounded_and_the_page_pages_on(sampled: tuple[Metrics, Sampler]) -> None:
    """The attack: ``since`` past the end, or none, returned the whole buffer (839 KB on a
    busy server). Now an answer holds at most ``max_bytes`` of points, oldest first, and says
    where to go on from."""
    _, sampler = sampled
    sampler.points = type(sampler.points)(maxlen=200)
    for _ in range(150):
        sampler.tick()
    size = len(sampler.points[-1][1])
    whole = orjson.loads(sampler.since(None, max_bytes=1 << 30))
    assert len(whole["points"]) == 150 and not whole["more"]
    got: list[int] = []
    since: int | None = None
    for _ in range(100):
        raw = sampler.since(since, max_bytes=20 * size)
        doc = orjson.loads(raw)
        assert len(doc["points"]) <= 21 and len(raw) < 22 * size + len(sampler._header)
        got += [p["seq"] for p in doc["points"]]
        since = doc["upto"]
        if not doc["more"]:
            break
    assert got == list(range(1, 151)) and doc["seq"] == 150  # every point, once, in order
    one = orjson.loads(sampler.since(3, max_bytes=1))  # at least one point, however small
    assert [p["seq"] for p in one["points"]] == [4] and one["upto"] == 4 and one["more"]
    for beyond in (150, 151, 10**14):
        doc = orjson.loads(sampler.since(beyond))
        assert (doc["points"], doc["upto"], doc["more"]) == ([], 150, False), beyond
    from sokuji.observability import timeseries

    assert len(sampler.since(None)) < timeseries.MAX_BYTES + size + len(sampler._header)


# --- routes --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def open_client() -> Iterator[TestClient]:
    with client_for(synthetic_config()) as client:
        yield client


@pytest.fixture(scope="module")
def keyed_client() -> Iterator[TestClient]:
    config = cfg.validate(cfg.ServerConfig(
        models=(cfg.ModelConfig(name="synth", runtime="synthetic"),),
        api_keys=(cfg.ApiKey(key=ADMIN, tenant="ops", admin=True),
                  cfg.ApiKey(key=TENANT, tenant="acme")),
        cache_dir=tempfile.mkdtemp(prefix="sokuji-test-")))  # metrics_require_key: default
    with client_for(config) as client:
        yield client


def test_the_page_is_static_and_locked_down(open_client: TestClient) -> None:
    r = open_client.get("/dashboard")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "script-src 'self'" in csp
    assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
    assert r.headers["x-content-type-options"] == "nosniff"
    assert r.headers["x-frame-options"] == "DENY"
    page = r.text
    assert page.count("<script") == page.count(  # no inline script
        '<script type="module" src="/dashboard/dashboard.js">') == 1
    assert "http://" not in page and "https://" not in page  # nothing from elsewhere
    for name, kind in (("dashboard.js", "text/javascript"), ("charts.js", "text/javascript"),
                       ("dashboard.css", "text/css"), ("favicon.svg", "image/svg+xml")):
        f = open_client.get(f"/dashboard/{name}")
        assert f.status_code == 200 and f.headers["content-type"].startswith(kind)
        assert f.headers["x-content-type-options"] == "nosniff"
        assert b"http://" not in f.content.replace(b"http://www.w3.org/2000/svg", b"")
    assert open_client.get("/dashboard/dashboard.html.bak").status_code == 404
    assert open_client.get("/dashboard/..%2Fapp.py").status_code == 404
    assert open_client.post("/dashboard/data").status_code == 405


def test_data_and_its_since(open_client: TestClient) -> None:
    r = open_client.get("/dashboard/data")
    assert r.status_code == 200 and r.headers["cache-control"] == "no-store"
    doc = r.json()
    assert doc["boot"] and doc["models"][0]["name"] == "synth" and "queue" in doc["stages"]
    assert open_client.get(f"/dashboard/data?since={doc['seq']}").status_code == 200
    for bad in ("abc", "-1", "1.5", "²", "9" * 16, ""):
        r = open_client.get("/dashboard/data", params={"since": bad})
        assert r.status_code == 400, bad
        assert r.json()["code"] == "invalid_input" and "since" in r.json()["error"]


def test_data_follows_the_rule_of_metrics(keyed_client: TestClient) -> None:
    assert keyed_client.get("/dashboard").status_code == 200  # the page holds no data
    r = keyed_client.get("/dashboard/data")
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    r = keyed_client.get("/dashboard/data", headers={"authorization": "Bearer wrong-key-123"})
    assert r.status_code == 401
    r = keyed_client.get("/dashboard/data", headers={"authorization": f"Bearer {TENANT}"})
    assert r.status_code == 403 and "admin" in r.json()["error"]
    r = keyed_client.get("/dashboard/data", headers={"authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200 and r.json()["models"][0]["name"] == "synth"
    # the same answers as /metrics
    assert keyed_client.get("/metrics").status_code == 401
    assert keyed_client.get("/metrics", headers={"x-api-key": TENANT}).status_code == 403


def test_keys_close_the_data_unless_opted_out() -> None:
    def config(**extra: object) -> cfg.ServerConfig:
        return cfg.validate(cfg.ServerConfig(
            models=(cfg.ModelConfig(name="synth", runtime="synthetic"),),
            api_keys=(cfg.ApiKey(key=TENANT, tenant="acme"),),
            cache_dir=tempfile.mkdtemp(prefix="sokuji-test-"), **extra))  # type: ignore[arg-type]

    with client_for(config()) as client:  # the default, once any key exists: closed
        for path in ("/dashboard/data", "/metrics"):
            assert client.get(path).status_code == 401, path
            assert client.get(path, headers={"x-api-key": TENANT}).status_code == 403, path
    with client_for(config(metrics_require_key=False)) as client:  # said in so many words
        assert client.get("/dashboard/data").status_code == 200
        assert client.get("/metrics").status_code == 200
    with client_for(synthetic_config()) as client:  # no keys at all: open, as make serve
        assert client.get("/dashboard/data").status_code == 200
        assert client.get("/metrics").status_code == 200
        assert client.get("/v2/models/stats").status_code == 200
