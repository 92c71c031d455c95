"""The HTTP surface in-process, on the synthetic runtime: protocols, timing, and every 4xx."""

from __future__ import annotations

import struct
import tempfile
from typing import Any

import orjson
import pytest
from starlette.testclient import TestClient

from sokuji import config as cfg
from sokuji.bench.engine import parse_server_timing
from sokuji.core.request import STAGES, TOTAL
from tests.conftest import client_for, synthetic_config

INFER = "/v2/models/synth/infer"


def v2_body(texts: list[Any], **extra: Any) -> dict[str, Any]:
    doc = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [len(texts)],
                       "data": texts}]}
    doc.update(extra)
    return doc




def test_v2_infer_answers_with_outputs_id_and_server_timing(synth: TestClient) -> None:
    r = synth.post(INFER, json=v2_body(["ab", "abcd"], id="req-7",
                                       parameters={"custom": 1}))
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["id"] == "req-7" and doc["model_name"] == "synth"
    assert doc["outputs"] == [{"name": "length", "datatype": "FP32", "shape": [2, 1],
                               "data": [2.0, 4.0]}]
    timing = parse_server_timing(r.headers["server-timing"])
    assert list(timing) == [s.value for s in STAGES] + [TOTAL]
    assert sum(v for k, v in timing.items() if k != TOTAL) == pytest.approx(
        timing[TOTAL], abs=0.01)


def test_v2_binary_tensor_extension_both_ways(synth: TestClient) -> None:
    texts = ["héllo", "wörld!"]
    blob = b"".join(struct.pack("<I", len(t.encode())) + t.encode() for t in texts)
    head = orjson.dumps({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2],
                                     "parameters": {"binary_data_size": len(blob)}}],
                         "parameters": {"binary_data_output": True}})
    r = synth.post(INFER, content=head + blob, headers={
        "content-type": "application/octet-stream",
        "inference-header-content-length": str(len(head))})
    assert r.status_code == 200, r.text
    n = int(r.headers["inference-header-content-length"])
    doc = orjson.loads(r.content[:n])
    assert doc["outputs"][0]["parameters"]["binary_data_size"] == 8
    assert struct.unpack("<2f", r.content[n:]) == (5.0, 6.0)


def test_v2_shape_n_by_1_and_nested_data(synth: TestClient) -> None:
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2, 1],
                        "data": [["a"], ["bb"]]}]}
    r = synth.post(INFER, json=body)
    assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [1.0, 2.0]


def test_health_metadata_and_models(synth: TestClient) -> None:
    assert synth.get("/v2/health/live").status_code == 200
    assert synth.get("/v2/health/ready").status_code == 200
    assert synth.get("/v2").json()["name"] == "sokuji"
    meta = synth.get("/v2/models/synth").json()
    # Triton's view of a batching model: [-1, *dims]; one string per item is dims [1].
    assert meta["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1, 1]}]
    assert synth.get("/v2/models/synth/versions/1").json()["versions"] == ["1"]
    assert synth.get("/v2/models/synth/ready").status_code == 200
    assert synth.get("/v1/models").json()["data"][0]["id"] == "synth"


def test_metrics_are_derived_from_the_timeline(synth: TestClient) -> None:
    for _ in range(3):
        assert synth.post(INFER, json=v2_body(["x"])).status_code == 200
    synth.post(INFER, json={"inputs": []})
    text = synth.get("/metrics").text
    for stage in STAGES:
        assert f'sokuji_stage_duration_seconds_count{{model="synth",stage="{stage}"}} 3.0' \
            in text
    assert 'sokuji_request_duration_seconds_count{model="synth"} 3.0' in text
    assert 'sokuji_requests_total{model="synth",status="200"} 3.0' in text
    assert 'sokuji_requests_total{model="synth",status="400"} 1.0' in text
    assert 'sokuji_batch_size_count{model="synth"}' in text
    assert 'sokuji_queue_depth{model="synth"} 0.0' in text


# --- bad input: a clear 4xx naming the problem, never a 500 ---------------------------------

BAD_V2: list[tuple[str, dict[str, Any], int, str]] = [
    ("missing inputs", {"id": "x"}, 400, "'inputs' must be a non-empty list"),
    ("empty inputs", {"inputs": []}, 400, "'inputs' must be a non-empty list"),
    ("extra input", {"inputs": [
        {"name": "text", "datatype": "BYTES", "shape": [1], "data": ["a"]},
        {"name": "image", "datatype": "BYTES", "shape": [1], "data": ["b"]}]},
     400, "unexpected input 'image'"),
    ("wrong input name", {"inputs": [
        {"name": "txt", "datatype": "BYTES", "shape": [1], "data": ["a"]}]},
     400, "unexpected input 'txt'"),
    ("input twice", {"inputs": [
        {"name": "text", "datatype": "BYTES", "shape": [1], "data": ["a"]},
        {"name": "text", "datatype": "BYTES", "shape": [1], "data": ["b"]}]},
     400, "given twice"),
    ("wrong datatype", {"inputs": [
        {"name": "text", "datatype": "FP32", "shape": [1], "data": [1.0]}]},
     400, "datatype 'FP32'; expected BYTES"),
    ("shape mismatch", {"inputs": [
        {"name": "text", "datatype": "BYTES", "shape": [3], "data": ["a"]}]},
     400, "shape [3] with 1 elements"),
    ("bad shape type", {"inputs": [
        {"name": "text", "datatype": "BYTES", "shape": "two", "data": ["a"]}]},
     400, "has shape 'two'"),
    ("non-string element", {"inputs": [
        {"name": "text", "datatype": "BYTES", "shape": [2], "data": ["a", 7]}]},
     400, "element 1 is int"),
    ("empty batch", {"inputs": [
        {"name": "text", "datatype": "BYTES", "shape": [0], "data": []}]},
     400, "is empty"),
    ("too many items", v2_body(["a"] * 9), 413,
     "input 'text' needs 9 items (texts in one request); the limit is max_batch_size = 8"),
    ("unknown output", {**v2_body(["a"]), "outputs": [{"name": "logits"}]},
     400, "unknown output 'logits'"),
    ("id not a string", {**v2_body(["a"]), "id": 5}, 400, "'id' must be a string"),
    ("no data", {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1]}]},
     400, "neither 'data' nor binary data"),
]


@pytest.mark.parametrize(("case", "body", "status", "reason"), BAD_V2,
                         ids=[c[0] for c in BAD_V2])
def test_bad_v2_requests(synth: TestClient, case: str, body: dict[str, Any], status: int,
                         reason: str) -> None:
    r = synth.post(INFER, json=body)
    assert r.status_code == status, r.text
    assert reason in r.json()["error"]


def test_malformed_json(synth: TestClient) -> None:
    r = synth.post(INFER, content=b'{"inputs": [', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]
    r = synth.post(INFER, content=b"[1, 2]", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "must be a JSON object" in r.json()["error"]


def test_non_utf8_text(synth: TestClient) -> None:
    body = b'{"inputs":[{"name":"text","datatype":"BYTES","shape":[1],"data":["\xff\xfe"]}]}'
    r = synth.post(INFER, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid UTF-8" in r.json()["error"]
    blob = struct.pack("<I", 2) + b"\xff\xfe"
    head = orjson.dumps({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1],
                                     "parameters": {"binary_data_size": len(blob)}}]})
    r = synth.post(INFER, content=head + blob, headers={
        "content-type": "application/octet-stream",
        "inference-header-content-length": str(len(head))})
    assert r.status_code == 400 and "element 0 is not valid UTF-8" in r.json()["error"]


def test_bad_binary_framing(synth: TestClient) -> None:
    head = orjson.dumps(v2_body(["a"]))
    r = synth.post(INFER, content=head + b"junk", headers={
        "inference-header-content-length": str(len(head))})
    assert r.status_code == 400 and "belong to no input" in r.json()["error"]
    r = synth.post(INFER, content=head, headers={"inference-header-content-length": "99999"})
    assert r.status_code == 400 and "does not fit" in r.json()["error"]
    r = synth.post(INFER, content=head, headers={"inference-header-content-length": "ten"})
    assert r.status_code == 400 and "not an integer" in r.json()["error"]


def test_wrong_content_type(synth: TestClient) -> None:
    r = synth.post(INFER, content=orjson.dumps(v2_body(["a"])),
                   headers={"content-type": "text/plain"})
    assert r.status_code == 415 and "text/plain" in r.json()["error"]
    r = synth.post("/v1/embeddings", content=b"{}", headers={"content-type": "text/csv"})
    assert r.status_code == 415 and "text/csv" in r.json()["error"]["message"]


def test_compressed_body_is_refused_clearly(synth: TestClient) -> None:
    r = synth.post(INFER, content=b"x", headers={"content-encoding": "gzip"})
    assert r.status_code == 415 and "gzip" in r.json()["error"]


def test_body_over_the_limit(synth: TestClient) -> None:
    big = orjson.dumps(v2_body(["a" * 70_000]))
    r = synth.post(INFER, content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "exceeds the limit" in r.json()["error"]

    def chunks():  # no Content-Length: the limit is enforced while reading
        for _ in range(20):
            yield b"x" * 8192
    r = synth.post(INFER, content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_unknown_model_version_route_and_method(synth: TestClient) -> None:
    r = synth.post("/v2/models/nope/infer", json=v2_body(["a"]))
    assert r.status_code == 404 and "unknown model 'nope'" in r.json()["error"]
    r = synth.post("/v2/models/synth/versions/7/infer", json=v2_body(["a"]))
    assert r.status_code == 404 and "no version '7'" in r.json()["error"]
    assert synth.get("/v2/models/nope").status_code == 404
    r = synth.get("/v2/nothing/here")
    assert r.status_code == 404 and r.json()["code"] == "not_found"
    r = synth.get(INFER)
    assert r.status_code == 405 and r.json()["code"] == "method_not_allowed"


BAD_OPENAI: list[tuple[str, Any, int, str]] = [
    ("missing input", {"model": "synth"}, 400, "'input' is required"),
    ("missing model", {"input": "a"}, 400, "'model' is required"),
    ("empty list", {"model": "synth", "input": []}, 400, "empty list"),
    ("token ids", {"model": "synth", "input": [[1, 2, 3]]}, 400, "token-id input"),
    ("wrong type", {"model": "synth", "input": 5}, 400, "must be a string or a list"),
    ("bad format", {"model": "synth", "input": "a", "encoding_format": "int8"}, 400,
     "'encoding_format' 'int8'"),
    ("extra field", {"model": "synth", "input": "a", "temperature": 0}, 400,
     "unrecognized request argument(s): temperature"),
    ("dimensions", {"model": "synth", "input": "a", "dimensions": 64}, 400,
     "'dimensions' 64 is not supported"),
    ("too many", {"model": "synth", "input": ["a"] * 9}, 400, "has 9 items"),
    ("unknown model", {"model": "gpt-9", "input": "a"}, 404, "unknown model 'gpt-9'"),
    ("not an object", ["a"], 400, "must be a JSON object"),
]


@pytest.mark.parametrize(("case", "body", "status", "reason"), BAD_OPENAI,
                         ids=[c[0] for c in BAD_OPENAI])
def test_bad_openai_requests(synth: TestClient, case: str, body: Any, status: int,
                             reason: str) -> None:
    r = synth.post("/v1/embeddings", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert reason in err["message"] and err["type"] == "invalid_request_error"


def test_a_runtime_failure_is_reported_and_contained() -> None:
    config = synthetic_config(options={"base_ms": 0.0, "fail_on": "poison"})
    with client_for(config) as client:
        r = client.post(INFER, json=v2_body(["poison"]))
        assert r.status_code == 500 and "synthetic failure" in r.json()["error"]
        assert client.post(INFER, json=v2_body(["fine"])).status_code == 200


def test_an_unexpected_bug_is_a_logged_json_500_not_a_crash(caplog: pytest.LogCaptureFixture
                                                            ) -> None:
    with client_for(synthetic_config()) as client:
        app = client.app
        model = app.inference.repo.models["synth"]  # type: ignore[attr-defined]

        def broken(texts: list[str]) -> None:
            raise ValueError("bug")

        model.served.runtime.preprocess = broken
        r = client.post(INFER, json=v2_body(["a"]))
        assert r.status_code == 500
        assert r.json() == {"error": "internal error: ValueError", "code": "internal_error"}
        assert "unhandled error on POST /v2/models/synth/infer" in caplog.text
        assert client.get("/v2/health/live").status_code == 200


@pytest.mark.parametrize(("headers", "params", "reason"), [
    ({"x-sokuji-priority": "urgent"}, {}, "priority 'urgent' is not one of"),
    ({}, {"priority": -1}, "priority -1 is not one of"),
    ({"x-sokuji-timeout-ms": "soon"}, {}, "x-sokuji-timeout-ms 'soon' must be a finite number"),
    ({"x-sokuji-timeout-ms": "0"}, {}, "must be a finite number of milliseconds > 0"),
    ({"x-sokuji-timeout-ms": "inf"}, {}, "must be a finite number of milliseconds > 0"),
    ({"x-sokuji-timeout-ms": "nan"}, {}, "must be a finite number of milliseconds > 0"),
    ({}, {"timeout": "5s"}, "parameter 'timeout' '5s' must be a finite number of microseconds"),
])
def test_bad_scheduling_hints(synth: TestClient, headers: dict[str, str],
                              params: dict[str, Any], reason: str) -> None:
    r = synth.post(INFER, json=v2_body(["a"], parameters=params), headers=headers)
    assert r.status_code == 400 and reason in r.json()["error"]


def test_good_scheduling_hints_are_accepted(synth: TestClient) -> None:
    for headers, params in (({"x-sokuji-priority": "batch"}, {}), ({}, {"priority": 2}),
                            ({"x-sokuji-timeout-ms": "5000"}, {}), ({}, {"timeout": 5_000_000}),
                            # far but finite: capped at a day, never an overflow
                            ({"x-sokuji-timeout-ms": "1e308"}, {}), ({}, {"timeout": 1e308})):
        r = synth.post(INFER, json=v2_body(["a"], parameters=params), headers=headers)
        assert r.status_code == 200, r.text


# --- a 404 lists what there is only on an open server -----------------------------------------

def two_models(**server: Any) -> cfg.ServerConfig:
    models = tuple(cfg.ModelConfig(name=n, runtime="synthetic", options={"base_ms": 0.0})
                   for n in ("synth", "internal-ranker"))
    return cfg.validate(cfg.ServerConfig(models=models, **server,
                                         cache_dir=tempfile.mkdtemp(prefix="sokuji-test-")))


def not_found_texts(client: TestClient, headers: dict[str, str]) -> list[str]:
    """The 404 bodies for an unknown model and an unknown version, on every path."""
    replies = [
        client.get("/v2/models/nope", headers=headers),
        client.get("/v2/models/synth/versions/7", headers=headers),
        client.get("/v2/models/nope/config", headers=headers),
        client.post("/v2/models/nope/infer", json=v2_body(["a"]), headers=headers),
        client.post("/v2/models/synth/versions/7/infer", json=v2_body(["a"]),
                    headers=headers),
        client.post("/v1/embeddings", json={"model": "nope", "input": "a"}, headers=headers),
        client.post("/v1/chat/completions", json={
            "model": "nope", "messages": [{"role": "user", "content": "hi"}]},
            headers=headers),
    ]
    assert [r.status_code for r in replies] == [404] * len(replies), [r.text for r in replies]
    return [r.text for r in replies]


def test_with_api_keys_a_404_names_what_is_missing_not_what_there_is() -> None:
    keys = (cfg.ApiKey(key="key-of-open-0001", tenant="open"),)  # a tenant of every model
    config = two_models(api_keys=keys, models_require_key=False)
    with client_for(config) as client:
        texts = not_found_texts(client, {"authorization": "Bearer key-of-open-0001"})
    for text in texts:
        assert "available" not in text and "internal-ranker" not in text, text
    assert "unknown model 'nope'" in texts[0] and "no version '7'" in texts[1]


def test_without_api_keys_a_404_lists_the_models() -> None:
    with client_for(two_models()) as client:
        texts = not_found_texts(client, {})
    assert "available: internal-ranker, synth" in texts[0]
    assert "no version '7'; available: 1" in texts[1]
