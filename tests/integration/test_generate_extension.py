"""Triton's generate extension (``server/generate_api.py``) on a real ``sokuji serve`` with
the shipped SmolLM2: ``/generate`` equals ``/v1/completions`` for the same greedy prompt,
``/generate_stream``'s chunks concatenate to the whole, and each bad input is a 400 with its
reason (a non-generator: a 400 naming what it serves)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import orjson
import pytest

from tests.conftest import CACHE_DIR, ROOT
from tests.integration.serving import sokuji_server

pytestmark = pytest.mark.integration

ECHO = ROOT / "tests" / "data" / "pymodels" / "core_forms.py"
CONFIG = f"""cache_dir = "{CACHE_DIR}"
[[models]]
name = "smollm2"
runtime = "llama"
cache = false
[models.options]
slots = 2
context_size = 256
max_new_tokens = 64
[[models]]
name = "echo"
runtime = "python"
max_batch_size = 8
[models.options]
entry = "{ECHO}:Echo"
"""
PROMPT = "The three primary colors are"
GREEDY = {"temperature": 0.0, "max_tokens": 6}


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with sokuji_server(CONFIG) as base:
        yield base


def completion(url: str, prompt: str, **fields: object) -> dict:
    r = httpx.post(f"{url}/v1/completions", json={"model": "smollm2", "prompt": prompt,
                                                   **GREEDY, **fields}, timeout=60)
    assert r.status_code == 200, r.text
    return dict(r.json())


def events(r: httpx.Response) -> list[dict]:
    return [orjson.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]


def test_generate_equals_completions(url: str) -> None:
    want = completion(url, PROMPT)
    r = httpx.post(f"{url}/v2/models/smollm2/generate",
                   json={"text_input": PROMPT, "parameters": GREEDY}, timeout=60)
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["model_name"] == "smollm2" and doc["model_version"]
    assert doc["text_output"] == want["choices"][0]["text"] and doc["text_output"]
    assert doc["finish_reason"] == want["choices"][0]["finish_reason"] == "length"
    assert doc["usage"]["completion_tokens"] == 6
    assert doc["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
    # the parameters may stand at the top level too (as Triton allows), and a version
    top = httpx.post(f"{url}/v2/models/smollm2/versions/{doc['model_version']}/generate",
                     json={"text_input": PROMPT, **GREEDY}, timeout=60)
    assert top.status_code == 200, top.text
    assert top.json()["text_output"] == doc["text_output"]


def test_generate_stream_chunks_concatenate(url: str) -> None:
    whole = httpx.post(f"{url}/v2/models/smollm2/generate",
                       json={"text_input": PROMPT, "parameters": GREEDY}, timeout=60).json()
    r = httpx.post(f"{url}/v2/models/smollm2/generate_stream",
                   json={"text_input": PROMPT, "parameters": {**GREEDY, "stream": True}},
                   timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    got = events(r)
    assert len(got) >= 3  # several chunks, then the last event
    assert all(e["model_name"] == "smollm2" for e in got)
    chunks = [e["text_output"] for e in got[:-1]]
    assert all(chunks)
    assert "".join(chunks) == whole["text_output"]
    assert got[-1]["finish_reason"] == "length" and got[-1]["text_output"] == ""
    assert got[-1]["usage"]["completion_tokens"] == 6


def test_genai_perfs_body_on_generate_streams(url: str) -> None:
    """genai-perf ``--endpoint-type generate --streaming`` posts to ``/generate`` with
    ``text_input`` as a list of one string and ``"stream": true`` at the top level, and
    reads server-sent events."""
    whole = httpx.post(f"{url}/v2/models/smollm2/generate",
                       json={"text_input": PROMPT, "parameters": GREEDY}, timeout=60).json()
    r = httpx.post(f"{url}/v2/models/smollm2/generate",
                   json={"text_input": [PROMPT], "stream": True, **GREEDY}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    got = events(r)
    assert "".join(e["text_output"] for e in got) == whole["text_output"]
    assert got[-1]["finish_reason"] == "length"


def test_generate_stop_as_on_completions(url: str) -> None:
    base = completion(url, PROMPT)["choices"][0]["text"]
    stop = base.strip().split()[0]
    want = completion(url, PROMPT, stop=[stop])
    r = httpx.post(f"{url}/v2/models/smollm2/generate",
                   json={"text_input": PROMPT, "parameters": {**GREEDY, "stop": [stop]}},
                   timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["text_output"] == want["choices"][0]["text"]
    assert r.json()["finish_reason"] == "stop" == want["choices"][0]["finish_reason"]


@pytest.mark.parametrize(("body", "reason"), [
    ({"parameters": GREEDY}, "text_input"),
    ({"text_input": 3}, "text_input"),
    ({"text_input": "x", "parameters": {"max_tokens": "six"}}, "max_tokens"),
    ({"text_input": "x", "parameters": {"temperature": 9}}, "temperature"),
    ({"text_input": "x", "parameters": {"max_tokens": 100000}}, "max_tokens"),
    ({"text_input": "x", "parameters": {"beam_width": 2}}, "beam_width"),
    ({"text_input": "x", "parameters": []}, "parameters"),
    ({"text_input": "x", "max_tokens": 4, "parameters": {"max_tokens": 5}}, "max_tokens"),
    ({"text_input": "x", "stream": "yes"}, "stream"),
])
@pytest.mark.parametrize("route", ["generate", "generate_stream"])
def test_bad_input_is_400(url: str, route: str, body: dict, reason: str) -> None:
    r = httpx.post(f"{url}/v2/models/smollm2/{route}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert reason in r.json()["error"]


def test_not_json_and_unknown_model(url: str) -> None:
    r = httpx.post(f"{url}/v2/models/smollm2/generate", content=b"{nope",
                   headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]
    r = httpx.post(f"{url}/v2/models/nosuch/generate", json={"text_input": "x"}, timeout=10)
    assert r.status_code == 404 and "nosuch" in r.json()["error"]


def test_server_metadata_lists_the_extension(url: str) -> None:
    assert "generate" in httpx.get(f"{url}/v2", timeout=10).json()["extensions"]


def test_generate_on_a_non_generator_names_its_protocol(url: str) -> None:
    r = httpx.post(f"{url}/v2/models/echo/generate", json={"text_input": "x"}, timeout=10)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "does not serve /v2/models/echo/generate" in error
    assert "/v2/models/echo/infer" in error or "predict" in error


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name) and 'model="smollm2"' in line)


def test_disconnect_cancels_the_stream(url: str) -> None:
    cancelled = metric(url, 'sokuji_requests_total{model="smollm2",status="499"}')
    body = {"text_input": "Count from 1 to 1000, separated by commas: 1, 2, 3,",
            "parameters": {"max_tokens": 64, "temperature": 0.0, "ignore_eos": True}}
    with httpx.stream("POST", f"{url}/v2/models/smollm2/generate_stream", json=body) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen == 2:
                break
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and metric(
            url, 'sokuji_requests_total{model="smollm2",status="499"}') == cancelled:
        time.sleep(0.05)  # polling the server's own counters
    assert metric(url, 'sokuji_requests_total{model="smollm2",status="499"}') == cancelled + 1
    assert metric(url, "sokuji_llm_running_sequences") == 0
