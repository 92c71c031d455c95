"""One accounting place (``server/accounting.py``): a request's end is counted once, with its
status, in ``sokuji_requests_total``, Triton's statistics and the GenAI metrics, whatever
the protocol and however it ended."""

from __future__ import annotations

from typing import Any

from starlette.testclient import TestClient

from tests.conftest import client_for, synthetic_config

INFER = "/v2/models/synth/infer"


def _body(texts: list[Any]) -> dict[str, Any]:
    return {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [len(texts)],
                        "data": texts}]}


def _counts(client: TestClient) -> dict[str, float]:
    out = {}
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(("sokuji_requests_total{",
                            "gen_ai_server_request_duration_seconds_count{")):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_each_request_is_counted_once_with_its_status(synth: TestClient) -> None:
    assert synth.post(INFER, json=_body(["a"])).status_code == 200
    assert synth.post("/v1/embeddings", json={"model": "synth", "input": "ab"}).status_code \
        == 200
    assert synth.post(INFER, json=_body(["a"] * 9)).status_code == 413  # past max_batch_size
    assert synth.post(INFER, json=_body(["a"]), headers={
        "content-type": "text/plain"}).status_code == 415
    assert synth.post("/v1/chat/completions", json={
        "model": "synth", "messages": [{"role": "user", "content": "hi"}]}).status_code == 400
    counts = _counts(synth)
    assert counts['sokuji_requests_total{model="synth",status="200"}'] == 2.0
    assert counts['sokuji_requests_total{model="synth",status="400"}'] == 1.0
    assert counts['sokuji_requests_total{model="synth",status="413"}'] == 1.0
    assert counts['sokuji_requests_total{model="synth",status="415"}'] == 1.0
    assert counts['gen_ai_server_request_duration_seconds_count{gen_ai_operation_name="infer",'
                  'gen_ai_request_model="synth"}'] == 1.0
    assert counts['gen_ai_server_request_duration_seconds_count{gen_ai_operation_name='
                  '"embeddings",gen_ai_request_model="synth"}'] == 1.0
    stats = synth.get("/v2/models/synth/stats").json()["model_stats"][0]["inference_stats"]
    assert stats["success"]["count"] == 2 and stats["fail"]["count"] == 3


def test_a_route_a_model_does_not_serve_names_the_ones_it_does() -> None:
    config = synthetic_config()
    with client_for(config) as client:
        r = client.post("/v1/completions", json={"model": "synth", "prompt": "x"})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        "model 'synth' does not serve /v1/completions; it serves /v2/models/synth/infer, "
        "/v1/embeddings")


def test_a_route_the_model_does_not_serve_is_counted_under_the_model() -> None:
    """The model was found, so the 400 is its own (the generate extension as chat)."""
    with client_for(synthetic_config()) as client:
        assert client.post("/v2/models/synth/generate",
                           json={"text_input": "x"}).status_code == 400
        assert client.post("/v1/completions",
                           json={"model": "synth", "prompt": "x"}).status_code == 400
        counts = _counts(client)
    assert counts['sokuji_requests_total{model="synth",status="400"}'] == 2.0
