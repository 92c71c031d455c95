"""A pipeline whose answer is generated, served by a real ``sokuji serve`` with the built-in
SmolLM2 and driven by the official ``openai`` client: the chat endpoint streams the answer,
returns the extra outputs as ``sources``, times each step; the answer is the model's own."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from sokuji.bench.engine import parse_server_timing
from tests.conftest import CACHE_DIR
from tests.integration.serving import sokuji_server

pytestmark = pytest.mark.integration
HERE = "tests.integration.test_pipeline_chat"

CONFIG = f"""cache_dir = "{CACHE_DIR}"
builtin_pipelines = false
[[models]]
name = "smollm2"
runtime = "llama"
cache = false
[models.options]
slots = 2
context_size = 512
max_new_tokens = 64

[[pipelines]]
name = "qa"
inputs = ["question"]
optional_inputs = ["user", "messages"]
extra_outputs = ["facts"]
[[pipelines.steps]]
name = "facts"
kind = "python"
function = "{HERE}:facts"
inputs = {{question = "input.question", user = "input.user"}}
[[pipelines.steps]]
name = "prompt"
kind = "python"
function = "{HERE}:prompt"
inputs = {{question = "input.question", facts = "facts"}}
[[pipelines.steps]]
name = "answer"
kind = "model"
model = "smollm2"
inputs = {{messages = "prompt"}}
options = {{max_tokens = 24}}
"""


def facts(question: str, user: str | None = None) -> list[dict[str, Any]]:
    return [{"id": "paris", "text": "The capital of France is Paris.", "user": user}]


def prompt(question: str, facts: list[dict[str, Any]]) -> list[dict[str, str]]:
    return [{"role": "system", "content": "Facts: " + " ".join(f["text"] for f in facts)},
            {"role": "user", "content": question}]


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with sokuji_server(CONFIG) as base:
        yield base


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


QUESTION = "What is the capital of France?"


def test_the_answer_is_the_models_own_with_sources(client: openai.OpenAI) -> None:
    direct = client.chat.completions.create(
        model="smollm2", messages=prompt(QUESTION, facts(QUESTION)),  # type: ignore[arg-type]
        max_tokens=24, temperature=0)
    piped = client.chat.completions.with_raw_response.create(
        model="qa", messages=[{"role": "user", "content": QUESTION}], max_tokens=24,
        temperature=0, user="ada")
    reply = piped.parse()
    assert reply.choices[0].message.content == direct.choices[0].message.content
    assert reply.model == "qa"
    sources = (reply.model_extra or {})["sources"]
    assert sources["facts"][0]["id"] == "paris" and sources["facts"][0]["user"] == "ada"
    timing = piped.headers["server-timing"]
    for name in ("step.facts", "step.prompt", "step.answer", "critical-path", "ttft",
                 "prefill", "decode"):
        assert f"{name};" in timing, name
    assert 'desc="facts>prompt>answer"' in timing
    durations = parse_server_timing(timing)
    # The answer's generation counts from the pipeline's arrival: its TTFT covers the steps.
    assert 0 < durations["step.facts"] + durations["step.prompt"] < durations["ttft"]
    assert durations["prefill"] > 0 and durations["preprocess"] >= 0
    assert durations["ttft"] <= durations["total"] and \
        durations["critical-path"] <= durations["total"]
    assert "facts;start=" in piped.headers["x-sokuji-pipeline-steps"]


def test_the_answer_streams(url: str, client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="qa", messages=[{"role": "user", "content": QUESTION}], max_tokens=24,
        temperature=0, stream=True)
    chunks = list(stream)
    assert (chunks[0].model_extra or {})["sources"]["facts"][0]["id"] == "paris"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = client.chat.completions.create(
        model="qa", messages=[{"role": "user", "content": QUESTION}], max_tokens=24,
        temperature=0)
    assert text == whole.choices[0].message.content and text
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=60, json={
            "model": "qa", "stream": True, "max_tokens": 8,
            "messages": [{"role": "user", "content": QUESTION}]}) as r:
        body = "".join(r.iter_text())
        assert "x-sokuji-pipeline-steps" in r.headers
    assert ": server-timing " in body and "step.answer;dur=" in body


def test_bad_chat_requests_name_the_problem(url: str) -> None:
    r = httpx.post(f"{url}/v1/chat/completions", json={
        "model": "qa", "messages": [{"role": "system", "content": "only a system message"}]})
    assert r.status_code == 400 and "user message" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/chat/completions", json={
        "model": "qa", "user": 7, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "user"
    r = httpx.post(f"{url}/v1/completions", json={"model": "qa", "prompt": "hi"})
    assert r.status_code == 400 and "answers chats" in r.json()["error"]["message"]


def test_v2_gives_the_whole_answer_and_the_sources(url: str, client: openai.OpenAI) -> None:
    r = httpx.post(f"{url}/v2/models/qa/infer", timeout=60, json={"inputs": [
        {"name": "question", "datatype": "BYTES", "shape": [1], "data": [QUESTION]}]})
    assert r.status_code == 200, r.text
    out = {o["name"]: o["data"] for o in r.json()["outputs"]}
    direct = client.chat.completions.create(
        model="smollm2", messages=prompt(QUESTION, facts(QUESTION)),  # type: ignore[arg-type]
        max_tokens=24, temperature=0)
    assert out["answer"] == [direct.choices[0].message.content]
    assert '"paris"' in out["facts"][0]


def test_the_answer_steps_max_tokens_is_a_ceiling(url: str, client: openai.OpenAI) -> None:
    """The replay of finding 6: a client's ``max_tokens`` 40 beat the step's configured
    limit. Now asking for more than the step's 24 is a 400 naming it, in whichever field the
    client used, before any step runs; asking for none gives the step's."""
    for field in ("max_tokens", "max_completion_tokens"):
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": "qa", field: 40, "messages": [{"role": "user", "content": QUESTION}]})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == field and "limit of 24" in error["message"]
    reply = client.chat.completions.create(
        model="qa", messages=[{"role": "user", "content": QUESTION}], temperature=0)
    assert reply.usage is not None and 0 < reply.usage.completion_tokens <= 24
