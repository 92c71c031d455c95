"""Triton's model configuration and statistics extensions, /health, and Allow on every 405,
in-process on the synthetic runtime."""

from __future__ import annotations

import time
from typing import Any

import pytest
from starlette.testclient import TestClient

from sokuji.bench.engine import parse_server_timing
from tests.conftest import client_for, synthetic_config

INFER = "/v2/models/synth/infer"


def v2_body(texts: list[str], shape: list[int] | None = None) -> dict[str, Any]:
    return {"inputs": [{"name": "text", "datatype": "BYTES", "shape": shape or [len(texts)],
                        "data": texts}]}


def stats_of(client: TestClient, path: str = "/v2/models/synth/stats") -> dict[str, Any]:
    r = client.get(path)
    assert r.status_code == 200, r.text
    (entry,) = r.json()["model_stats"]
    return entry


def test_server_metadata_advertises_the_extensions(synth: TestClient) -> None:
    extensions = synth.get("/v2").json()["extensions"]
    assert {"binary_tensor_data", "model_configuration", "statistics"} <= set(extensions)


def test_model_config_in_tritons_format() -> None:
    config = synthetic_config(max_queue_depth=77, default_timeout_ms=250.0,
                              max_queue_delay_ms=1.5, instances=2)
    with client_for(config) as client:
        r = client.get("/v2/models/synth/config")
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
        doc = r.json()
        assert client.get("/v2/models/synth/versions/1/config").json() == doc
    assert (doc["name"], doc["platform"], doc["backend"]) == ("synth", "sokuji_synthetic",
                                                             "synthetic")
    assert doc["max_batch_size"] == 8
    (inp,) = doc["input"]
    assert (inp["name"], inp["data_type"], inp["dims"]) == ("text", "TYPE_STRING", [1])
    assert inp["reshape"] == {"shape": []}  # one string per batch item
    (out,) = doc["output"]
    assert (out["name"], out["data_type"], out["dims"]) == ("length", "TYPE_FP32", [1])
    batching = doc["dynamic_batching"]
    assert batching["max_queue_delay_microseconds"] == 1500
    assert batching["priority_levels"] == 2 and batching["default_priority_level"] == 1
    assert batching["default_queue_policy"] == {
        "timeout_action": "REJECT", "default_timeout_microseconds": 250_000,
        "allow_timeout_override": True, "max_queue_size": 77}
    assert doc["instance_group"][0]["kind"] == "KIND_CPU"
    assert doc["instance_group"][0]["count"] == 2
    assert doc["version_policy"] == {"latest": {"num_versions": 1}}
    assert doc["model_transaction_policy"] == {"decoupled": False}
    assert doc["response_cache"] == {"enable": True}
    assert doc["parameters"]["batching"] == {"string_value": "length"}


def test_requests_built_from_metadata_or_config_are_accepted(synth: TestClient) -> None:
    """perf_analyzer builds [batch, *metadata shape[1:]] when max_batch_size > 0 and stops
    on an empty remainder ("unable to set shape for the input"); a client following the
    config's dims builds [batch, *dims]; older clients send [N]. All must work."""
    meta, config = synth.get("/v2/models/synth").json(), synth.get("/v2/models/synth/config")
    dims, tail = config.json()["input"][0]["dims"], meta["inputs"][0]["shape"][1:]
    assert config.json()["max_batch_size"] > 0 and tail and tail == dims
    for batch in (1, 3):
        for shape in ([batch, *tail], [batch, *dims], [batch]):
            texts = ["abc"] * batch
            r = synth.post(INFER, json=v2_body(texts, shape))
            assert r.status_code == 200, (shape, r.text)


def test_config_of_unknown_model_or_version_is_404(synth: TestClient) -> None:
    r = synth.get("/v2/models/nope/config")
    assert r.status_code == 404 and "unknown model 'nope'" in r.json()["error"]
    r = synth.get("/v2/models/synth/versions/9/stats")
    assert r.status_code == 404 and "no version '9'" in r.json()["error"]


def test_stats_are_the_server_timing_timeline_summed(synth: TestClient) -> None:
    before_ms = time.time_ns() // 1_000_000
    start = stats_of(synth)
    timings = []
    items = 0
    for i in range(5):
        texts = [f"text {i}"] * (1 + i % 3)  # distinct: every request is computed
        items += len(texts)
        r = synth.post(INFER, json=v2_body(texts))
        assert r.status_code == 200
        timings.append(parse_server_timing(r.headers["server-timing"]))
    after_ms = time.time_ns() // 1_000_000
    end = stats_of(synth)
    assert (end["name"], end["version"]) == ("synth", "1")
    assert before_ms <= end["last_inference"] <= after_ms

    def delta(part: str) -> tuple[int, int]:
        a, b = start["inference_stats"][part], end["inference_stats"][part]
        return b["count"] - a["count"], b["ns"] - a["ns"]

    def summed(*stages: str) -> float:
        return sum(t[s] for t in timings for s in stages) * 1e6  # ms -> ns

    tolerance_ns = len(timings) * len(("total",)) * 1000  # Server-Timing rounds to 1 us
    for part, stages in (("success", ("total",)), ("queue", ("queue", "batch")),
                         ("compute_input", ("preprocess",)), ("compute_infer", ("infer",)),
                         ("compute_output", ("postprocess",)), ("cache_miss", ("cache",))):
        count, ns = delta(part)
        assert count == 5, part
        assert ns == pytest.approx(summed(*stages), abs=tolerance_ns * len(stages)), part
    assert delta("cache_hit") == (0, 0) and delta("fail") == (0, 0)
    assert end["inference_count"] - start["inference_count"] == items
    assert end["execution_count"] - start["execution_count"] == 5  # one request a batch here
    sizes = {b["batch_size"]: b["compute_infer"]["count"] for b in end["batch_stats"]}
    assert sum(sizes.values()) == end["execution_count"]
    assert set(sizes) <= {1, 2, 3}


def test_cache_hits_leave_compute_counts_alone(synth: TestClient) -> None:
    start = stats_of(synth)
    body = v2_body(["the same text, twice"])
    assert synth.post(INFER, json=body).status_code == 200
    assert synth.post(INFER, json=body).status_code == 200
    end = stats_of(synth)
    diff = {k: end["inference_stats"][k]["count"] - start["inference_stats"][k]["count"]
            for k in end["inference_stats"]}
    assert diff == {"success": 2, "fail": 0, "queue": 2, "compute_input": 1,
                    "compute_infer": 1, "compute_output": 1, "cache_hit": 1, "cache_miss": 1}
    assert end["inference_count"] - start["inference_count"] == 1  # hits are not inferences
    assert end["inference_stats"]["cache_hit"]["ns"] > start["inference_stats"]["cache_hit"]["ns"]


def test_failed_requests_count_in_fail(synth: TestClient) -> None:
    start = stats_of(synth)["inference_stats"]
    assert synth.post(INFER, json={"inputs": []}).status_code == 400
    assert synth.get(INFER).status_code == 405
    assert synth.post("/v1/embeddings", json={"model": "synth", "input": ["a"] * 9}
                      ).status_code == 400
    end = stats_of(synth)["inference_stats"]
    assert end["fail"]["count"] - start["fail"]["count"] == 3
    assert end["fail"]["ns"] > start["fail"]["ns"]
    assert end["success"] == start["success"]


def test_all_models_stats_and_a_models_versions() -> None:
    with client_for(synthetic_config()) as client:
        everything = client.get("/v2/models/stats").json()["model_stats"]
        assert [(s["name"], s["version"]) for s in everything] == [("synth", "1")]
        assert client.get("/v2/models/synth/versions/1/stats").json()["model_stats"] == \
            everything
        assert client.get("/v2/models/synth").json()["versions"] == ["1"]


def test_health_follows_readiness() -> None:
    with client_for(synthetic_config()) as client:
        r = client.get("/health")
        assert r.status_code == 200
        client.app.inference.repo.mark_unready()  # type: ignore[attr-defined]
        assert client.get("/health").status_code == 503
        assert client.get("/v2/health/ready").status_code == 503


def allowed(r: Any) -> set[str]:
    return {m.strip() for m in r.headers["allow"].split(",")}


@pytest.mark.parametrize(("method", "path", "allow"), [
    ("GET", INFER, {"POST"}),                              # the direct inference path
    ("PUT", "/v2/models/synth/versions/1/infer", {"POST"}),
    ("GET", "/v1/embeddings", {"POST"}),
    ("GET", "/v1/chat/completions", {"POST"}),             # the generation endpoints
    ("DELETE", "/v1/completions", {"POST"}),
    ("POST", "/v2/health/live", {"GET", "HEAD"}),          # Starlette's router
    ("POST", "/v2/models/synth/config", {"GET", "HEAD"}),
    ("DELETE", "/v2/models/stats", {"GET", "HEAD"}),
    ("POST", "/health", {"GET", "HEAD"}),
    ("POST", "/metrics", {"GET", "HEAD"}),
    ("POST", "/v2/jobs/0123", {"GET"}),                     # jobs
])
def test_every_405_says_what_is_allowed(synth: TestClient, method: str, path: str,
                                        allow: set[str]) -> None:
    r = synth.request(method, path)
    assert r.status_code == 405, r.text
    assert allowed(r) == allow
    body = r.json()
    assert "not allowed" in str(body).lower() or "method not allowed" in str(body).lower()


def test_an_async_submission_with_the_wrong_method_is_a_405_with_allow(synth: TestClient
                                                                       ) -> None:
    r = synth.get(INFER, headers={"prefer": "respond-async"})
    assert r.status_code == 405 and allowed(r) == {"POST"}


@pytest.fixture
def with_variants() -> Any:
    """A model serving variant "fp32", with "int8" and "opt" as versions, the way
    the ``onnx`` kind arranges ONNX variants (here over the synthetic runtime)."""
    from sokuji.kinds.encoder.model import EncoderModel
    from sokuji.kinds.kind import Built
    from sokuji.kinds.synthetic.kind import KIND
    from sokuji.observability.metrics import Metrics
    from sokuji.repository.models import Model, ModelRepository
    from sokuji.runtimes.synthetic import SyntheticRuntime
    from sokuji.server.app import create_app

    config = synthetic_config()
    metrics = Metrics()
    mc = config.models[0]
    served = {}
    for name in ("fp32", "int8", "opt"):
        runtime = SyntheticRuntime(KIND.parse(mc, "models[0]"))
        runtime.load()
        served[name] = EncoderModel.over(runtime, mc, (), "synth" if name == "fp32"
                                         else f"synth@{name}", metrics.batch_observer)
    primary = served.pop("fp32")
    repo = ModelRepository({"synth": Model.of(mc, Built(primary, "fp32", served))})
    with TestClient(create_app(config, repo, metrics), base_url="http://localhost") as client:
        yield client


def test_metadata_lists_every_version_and_stats_name_them(with_variants: TestClient) -> None:
    client = with_variants
    for path in ("/v2/models/synth", "/v2/models/synth/versions/int8"):
        assert client.get(path).json()["versions"] == ["1", "fp32", "int8", "opt"]
    for version in ("1", "fp32", "int8", "opt"):
        r = client.post(f"/v2/models/synth/versions/{version}/infer",
                        json=v2_body([f"for {version}"]))
        assert r.status_code == 200, r.text
    stats = client.get("/v2/models/synth/stats").json()["model_stats"]
    # The default variant is named by its configured version: perf_analyzer parses it as an
    # integer. The others by their names.
    assert {s["version"]: s["inference_stats"]["success"]["count"] for s in stats} == \
        {"1": 2, "int8": 1, "opt": 1}
    (int8,) = client.get("/v2/models/synth/versions/int8/stats").json()["model_stats"]
    assert int8["version"] == "int8" and int8["execution_count"] == 1
    config = client.get("/v2/models/synth/versions/opt/config").json()
    assert config["version_policy"] == {"all": {}}
    assert config["parameters"]["variant"] == {"string_value": "opt"}


def test_a_generation_counts_as_one_inference() -> None:
    """LLMs: compute_input = parse/template/tokenise, queue = waiting for a slot,
    compute_infer = prefill + decode; a failed generation counts in fail."""
    from sokuji.llm.request import Timing
    from sokuji.observability.metrics import Metrics
    from sokuji.observability.stats import Duration

    class Idle:
        num_waiting = 0

    metrics = Metrics()
    metrics.add_model("llm", Idle())
    metrics.observe_generation("llm", Timing(arrival_ns=1_000, submitted_ns=3_000,
                                             admitted_ns=10_000, first_token_ns=20_000,
                                             end_ns=50_000, token_ns=[20_000, 50_000]), 2, 200)
    metrics.observe_generation("llm", Timing(arrival_ns=0, submitted_ns=100, end_ns=7_000),
                               0, 504)
    s = metrics.model_stats("llm")
    assert (s.success, s.fail) == (Duration(1, 49_000), Duration(1, 7_000))
    assert (s.compute_input, s.queue, s.compute_infer, s.compute_output) == (
        Duration(1, 2_000), Duration(1, 7_000), Duration(1, 40_000), Duration(1, 0))
    assert (s.inference_count, s.execution_count) == (1, 1)
    assert s.cache_hit == s.cache_miss == Duration(0, 0)
