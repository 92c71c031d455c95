"""Asynchronous inference in-process: 202 + Location, polling, results, tenants, callbacks."""

from __future__ import annotations

import http.server
import json
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
from starlette.testclient import TestClient

from sokuji import config as cfg
from tests.conftest import client_for

INFER = "/v2/models/synth/infer"
ASYNC = {"prefer": "respond-async"}


def body(text: str) -> dict[str, Any]:
    return {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [text]}]}


def server_config(**extra: Any) -> cfg.ServerConfig:
    model = cfg.ModelConfig(name="synth", runtime="synthetic", options={"base_ms": 1.0})
    other = cfg.ModelConfig(name="other", runtime="synthetic", options={"base_ms": 1.0})
    return cfg.validate(cfg.ServerConfig(models=(model, other), cache_dir=tempfile.mkdtemp(),
                                         **extra))


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


class Hook(http.server.BaseHTTPRequestHandler):
    received: ClassVar[list[dict[str, Any]]] = []
    fail_first = 1

    def do_POST(self) -> None:
        data = self.rfile.read(int(self.headers["content-length"]))
        status = 500 if Hook.fail_first > 0 else 200
        Hook.fail_first -= 1
        if status == 200:
            Hook.received.append(json.loads(data))
        self.send_response(status)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def test_a_callback_is_retried_until_it_is_delivered(client: TestClient) -> None:
    hook = http.server.HTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=hook.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{hook.server_address[1]}/done"
        r = client.post(INFER, json=body("call me"),
                        headers={**ASYNC, "x-sokuji-callback-url": url})
        location = r.headers["location"]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not Hook.received:
            client.get(location)
        assert Hook.received and Hook.received[0]["id"] == r.json()["id"]
        assert Hook.received[0]["status"] == 200
        assert json.loads(Hook.received[0]["body"])["outputs"][0]["data"] == [7.0]
        assert client.get(location).json()["callback"] == "delivered (200)"
    finally:
        hook.shutdown()
