"""The plain JSON routes of a Python model (issue 27, items 1 and 4): ``POST
/v2/models/{m}/predict`` and LitServe's ``POST /predict``, typed inputs refused before
``predict`` runs, and a generator's partials as Server-Sent Events (``server/predict.py``).

Real classes (``tests/data/pymodels/predict_*.py``, ``stream_*.py``) under the real server:
in process (Starlette's TestClient, which hands over a streamed body only once it is whole)
for what a response says, and as a ``sokuji serve`` process for when its events arrive, what
a client that goes away or reads too slowly gets.
"""

from __future__ import annotations

import json
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from starlette.testclient import TestClient

from sokuji import config as cfg
from tests.conftest import client_for
from tests.integration.serving import sokuji_server

pytestmark = pytest.mark.integration

MODELS = Path(__file__).resolve().parent.parent / "data" / "pymodels"
PLAIN = f"{MODELS}/predict_plain.py"
STREAM = f"{MODELS}/stream_gen.py"


def _python(name: str, entry: str, **extra: Any) -> cfg.ModelConfig:
    return cfg.ModelConfig(name=name, runtime="python", max_batch_size=8,
                           options={"entry": entry}, **extra)


def _config(*models: cfg.ModelConfig) -> cfg.ServerConfig:
    return cfg.validate(cfg.ServerConfig(models=models, builtin_pipelines=False,
                                         cache_dir=tempfile.mkdtemp(prefix="sokuji-test-")))


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    config = _config(
        _python("echo", f"{PLAIN}:Echo", max_request_bytes=2048),
        _python("scorer", f"{PLAIN}:StructScorer"),
        _python("pyd", f"{PLAIN}:PydanticEcho"),
        _python("counted", f"{PLAIN}:Counted"),
        _python("steps", f"{STREAM}:Steps"),
        _python("asteps", f"{STREAM}:AsyncSteps"),
        _python("fails", f"{STREAM}:FailsMidway"),
        cfg.ModelConfig(name="synth", runtime="synthetic", max_batch_size=8,
                        options={"base_ms": 0.0}))
    with client_for(config) as c:
        yield c


def events(text: str) -> list[tuple[str, Any]]:
    """An SSE body as (event, data) pairs (``message`` where it names none; comments as
    ``comment``), each data parsed as JSON."""
    out: list[tuple[str, Any]] = []
    for block in text.split("\n\n"):
        if not block:
            continue
        name, data = "message", None
        for line in block.split("\n"):
            if line.startswith(":"):
                name, data = "comment", line[1:].strip()
            elif line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
        out.append((name, data))
    return out


# -- plain JSON ----------------------------------------------------------------------------
def test_untyped_json_round_trip(client: TestClient) -> None:
    body = {"a": 1, "nested": {"b": [1.5, "x", None]}, "flag": True}
    r = client.post("/v2/models/echo/predict", json=body)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json"
    assert r.json() == {"got": body, "keys": ["a", "flag", "nested"], "ragged": [[1], [2, 3]],
                        "none": None}
    assert "infer;dur=" in r.headers["server-timing"]
    versioned = client.post("/v2/models/echo/versions/1/predict", json=body)
    assert versioned.status_code == 200 and versioned.json() == r.json()


def test_body_must_be_a_bounded_json_object(client: TestClient) -> None:
    r = client.post("/v2/models/echo/predict", json=[1, 2])
    assert r.status_code == 400 and "JSON object" in r.json()["error"]
    r = client.post("/v2/models/echo/predict", content=b"{not json")
    assert r.status_code == 400
    r = client.post("/v2/models/echo/predict", json={"x": "y" * 4096})  # past 2048 bytes
    assert r.status_code == 413, r.text
    r = client.post("/v2/models/echo/predict", json={}, headers={"x-sokuji-priority": "top"})
    assert r.status_code == 400 and "priority" in r.json()["error"]


def test_msgspec_typed_input_and_output(client: TestClient) -> None:
    good = {"sepal": [1.0, 2.0], "petal": [3.0], "label": "a"}
    first = client.post("/v2/models/scorer/predict", json=good)
    assert first.status_code == 200, first.text
    assert first.json()["total"] == 6.0 and first.json()["label"] == "a"
    calls = first.json()["count"]
    missing = client.post("/v2/models/scorer/predict", json={"sepal": [1.0]})
    assert missing.status_code == 400 and "petal" in missing.json()["error"]
    wrong = client.post("/v2/models/scorer/predict", json={"sepal": "x", "petal": [1.0]})
    assert wrong.status_code == 400 and "sepal" in wrong.json()["error"]
    again = client.post("/v2/models/scorer/predict", json=good)
    assert again.json()["count"] == calls + 1  # the refused two never reached predict


def test_pydantic_typed_input_and_output(client: TestClient) -> None:
    first = client.post("/v2/models/pyd/predict", json={"text": "ab", "repeat": 2})
    assert first.status_code == 200, first.text
    assert first.json()["text"] == "abab"
    calls = first.json()["count"]
    missing = client.post("/v2/models/pyd/predict", json={"repeat": 2})
    assert missing.status_code == 400 and "text" in missing.json()["error"]
    wrong = client.post("/v2/models/pyd/predict", json={"text": "a", "repeat": "many"})
    assert wrong.status_code == 400 and "repeat" in wrong.json()["error"]
    again = client.post("/v2/models/pyd/predict", json={"text": "c"})
    assert again.json() == {"text": "c", "count": calls + 1}


def test_deterministic_answers_are_cached(client: TestClient) -> None:
    body = {"q": "same"}
    first = client.post("/v2/models/counted/predict", json=body)
    second = client.post("/v2/models/counted/predict", json=body)
    assert first.status_code == second.status_code == 200
    assert second.json() == first.json()  # the count did not move: predict did not run
    assert 'desc="hit"' in second.headers["server-timing"]
    other = client.post("/v2/models/counted/predict", json={"q": "other"})
    assert other.json()["calls"] == first.json()["calls"] + 1


def test_model_without_predict_names_its_routes(client: TestClient) -> None:
    r = client.post("/v2/models/synth/predict", json={})
    assert r.status_code == 400
    assert "does not serve /v2/models/synth/predict" in r.json()["error"]
    assert "/v2/models/synth/infer" in r.json()["error"]
    r = client.get("/v2/models/echo/predict")
    assert r.status_code == 405


def test_alias_with_several_models_names_them(client: TestClient) -> None:
    r = client.post("/predict", json={})
    assert r.status_code == 400
    error = r.json()["error"]
    assert "echo" in error and "scorer" in error and "/v2/models/{m}/predict" in error
    assert "synth" not in error  # it does not serve predict


def test_alias_with_one_model() -> None:
    config = _config(_python("only", f"{PLAIN}:StructScorer"),
                     cfg.ModelConfig(name="synth", runtime="synthetic", max_batch_size=8,
                                     options={"base_ms": 0.0}))
    with client_for(config) as c:
        r = c.post("/predict", json={"sepal": [1.0], "petal": [2.0]})
        assert r.status_code == 200, r.text
        assert r.json()["total"] == 3.0
        assert c.post("/predict", json={"sepal": [1.0]}).status_code == 400


# -- streams, whole ------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["steps", "asteps"])
def test_stream_events(client: TestClient, name: str) -> None:
    r = client.post(f"/v2/models/{name}/predict", json={"n": 5})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    got = events(r.text)
    assert [d["step"] for e, d in got if e == "message"] == [0, 1, 2, 3, 4]
    assert got[-2][0] == "comment" and got[-2][1].startswith("server-timing ")
    assert got[-1] == ("end", {"model_name": name, "model_version": "1", "partials": 5})


def test_failure_mid_stream_is_an_error_event(client: TestClient) -> None:
    r = client.post("/v2/models/fails/predict", json={})
    assert r.status_code == 200
    got = events(r.text)
    assert [d for e, d in got if e == "message"] == [{"step": 0}, {"step": 1}]
    name, data = got[-1]
    assert name == "error" and data["code"] == "model_error" and data["status"] == 502
    assert "ValueError" in data["error"] and "secret" not in data["error"]


def test_failure_before_the_first_partial_is_a_status(client: TestClient) -> None:
    r = client.post("/v2/models/fails/predict", json={"at_once": True})
    assert r.status_code == 502
    assert r.json()["code"] == "model_error"


def test_v2_infer_on_a_stream_answers_its_last_result(client: TestClient) -> None:
    r = client.post("/v2/models/steps/infer", json={"parameters": {"n": 3}, "inputs": []})
    assert r.status_code == 200, r.text
    outputs = {o["name"]: o["data"] for o in r.json()["outputs"]}
    assert outputs["step"] == [2]


# -- streams, as they arrive -----------------------------------------------------------------
SERVED = f"""
builtin_pipelines = false
[[models]]
name = "steps"
runtime = "python"
max_batch_size = 4
[models.options]
entry = "{STREAM}:Steps"
[[models]]
name = "asteps"
runtime = "python"
max_batch_size = 4
[models.options]
entry = "{STREAM}:AsyncSteps"
"""


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with sokuji_server(SERVED) as base:
        yield base


@pytest.mark.parametrize("name", ["steps", "asteps"])
def test_partials_arrive_as_they_are_yielded(url: str, name: str) -> None:
    """Each partial reaches the client before the generator yields the last one: compared
    with the times the generator itself stamped (one machine, one clock)."""
    arrived: list[float] = []
    stamped: list[float] = []
    ended = None
    with requests.post(f"{url}/v2/models/{name}/predict", json={"n": 5, "sleep_s": 0.2},
                       stream=True, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith(b"data: {\"step\""):
                arrived.append(time.time())
                stamped.append(json.loads(line[len(b"data: "):])["at"])
            elif line == b"event: end":
                ended = time.time()
    assert len(arrived) == 5 and ended is not None
    assert all(a < stamped[-1] for a in arrived[:-1]), (arrived, stamped)
    assert all(a >= s - 0.05 for a, s in zip(arrived, stamped, strict=True))


def test_client_going_away_stops_the_generator(url: str) -> None:
    progress = Path(tempfile.mkdtemp(prefix="sokuji-test-")) / "progress.txt"
    r = requests.post(f"{url}/v2/models/steps/predict", stream=True, timeout=30,
                      json={"n": 200, "sleep_s": 0.02, "progress": str(progress)})
    lines = r.iter_lines()
    assert next(lines).startswith(b"data: ")
    r.close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and "closed" not in progress.read_text():
        time.sleep(0.05)  # polling the server process's file, not waiting on our own code
    steps = progress.read_text().split()
    assert steps[-1] == "closed"
    assert len(steps) - 1 < 200  # it stopped early, not at its end
    gone = 'sokuji_requests_total{model="steps",status="499"}'
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and gone not in requests.get(f"{url}/metrics").text:
        time.sleep(0.05)
    assert gone in requests.get(f"{url}/metrics").text  # counted, as a cancelled generation


def test_a_client_reading_too_slowly_gets_an_error_event(url: str) -> None:
    """A client that reads nothing while the generator yields far more than the socket
    buffers hold: the model never waits for it; the stream ends with ``stream_overflow``."""
    port = int(url.rsplit(":", 1)[1])
    progress = Path(tempfile.mkdtemp(prefix="sokuji-test-")) / "progress.txt"
    body = json.dumps({"n": 3000, "pad": 16384, "progress": str(progress)}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"POST /v2/models/steps/predict HTTP/1.1\r\nHost: localhost\r\n"
                  b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
                  + body)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (
                not progress.exists() or "closed" not in progress.read_text()):
            time.sleep(0.05)  # the generator runs to its end while nothing is read
        data = b""
        while b"\r\n0\r\n\r\n" not in data[-64:]:
            chunk = s.recv(1 << 20)
            if not chunk:
                break
            data += chunk
    tail = data[-1000:].decode("latin-1")
    assert "event: error" in tail and '"code":"stream_overflow"' in tail, tail[-300:]
    assert '"status":408' in tail
