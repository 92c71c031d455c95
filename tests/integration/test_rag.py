"""The built-in ``rag`` pipeline as ``make serve`` starts it: a real ``sokuji serve`` on the
default models (MiniLM, SmolLM2), the pydoc index and the Feast store built in the test
cache, driven by the official ``openai`` client and plain HTTP."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from sokuji.bench.engine import parse_server_timing
from sokuji.retrieval.corpus import pydoc_passages
from sokuji.retrieval.questions import load_questions
from tests.conftest import CACHE_DIR
from tests.integration.serving import sokuji_server

pytestmark = pytest.mark.integration

CONFIG = f"""cache_dir = "{CACHE_DIR}"
[[models]]
name = "minilm"
[[models]]
name = "smollm2"
runtime = "llama"
cache = false
[models.options]
slots = 2
context_size = 1536
"""


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with sokuji_server(CONFIG) as base:
        yield base


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def spans(header: str) -> dict[str, tuple[float, float]]:
    out = {}
    for part in header.split(", "):
        name, start, dur = part.split(";")
        s = float(start.removeprefix("start="))
        out[name] = (s, s + float(dur.removeprefix("dur=")))
    return out


def test_rag_streams_an_answer_with_its_sources(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="rag", messages=[{"role": "user", "content": "What does the with statement do?"}],
        max_tokens=12, temperature=0, stream=True, user="user-0001")
    chunks = list(raw.parse())
    sources = (chunks[0].model_extra or {})["sources"]["retrieve"]
    assert len(sources) == 5 and sources[0]["metadata"]["topic"] in ("with", "context-managers")
    assert "text" in sources[0] and sources[0]["score"] > 0
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    steps = spans(raw.headers["x-sokuji-pipeline-steps"])
    (f0, f1), (r0, r1) = steps["features"], steps["retrieve"]
    assert f0 < r1 and r0 < f1  # the user's features were looked up during the retrieval
    assert steps["prompt"][0] >= max(f1, r1) - 0.01


def test_rag_over_v2_times_every_step(url: str) -> None:
    r = httpx.post(f"{url}/v2/models/rag/infer", timeout=120, json={"inputs": [
        {"name": "question", "datatype": "BYTES", "shape": [1],
         "data": ["How do I define a function with default argument values?"]},
        {"name": "user", "datatype": "BYTES", "shape": [1], "data": ["user-0002"]}]})
    assert r.status_code == 200, r.text
    out = {o["name"]: o for o in r.json()["outputs"]}
    assert out["answer"]["datatype"] == "BYTES" and out["answer"]["data"][0]
    assert out["retrieve"]["shape"] == [5]
    timing = parse_server_timing(r.headers["server-timing"])
    for name in ("step.features", "step.retrieve", "step.prompt", "step.answer",
                 "critical-path", "total"):
        assert name in timing, name
    assert timing["critical-path"] <= timing["total"]
    metrics = httpx.get(f"{url}/metrics").text
    assert 'sokuji_pipeline_step_outcomes_total{outcome="ok",pipeline="rag",step="features"}' \
        in metrics


def test_served_retrieval_finds_the_answers(client: openai.OpenAI) -> None:
    """The sources the served pipeline returns hold a known answer for most of a sample of
    the written questions (hybrid recall@5 over all of them: tests/unit)."""
    # 6 of 106, both styles (each answer costs a prefill of the quoted passages, ~1-2 s)
    questions = load_questions(pydoc_passages())[::18]
    found = 0
    for q in questions:
        reply = client.chat.completions.create(
            model="rag", messages=[{"role": "user", "content": q.text}], max_tokens=1)
        ids = {s["id"] for s in (reply.model_extra or {})["sources"]["retrieve"]}
        found += bool(ids & q.answers)
    assert found >= 0.6 * len(questions), (found, len(questions))


@pytest.mark.parametrize(("inputs", "why"), [
    ([], "needs input 'question'"),
    ([{"name": "question", "datatype": "BYTES", "shape": [1], "data": ["q"]},
      {"name": "city", "datatype": "BYTES", "shape": [1], "data": ["x"]}],
     "unexpected input 'city'"),
    ([{"name": "question", "datatype": "BYTES", "shape": [1], "data": ["   "]}],
     "step 'retrieve': 'query' must be a non-empty string"),
])
def test_bad_rag_inputs_are_4xx_naming_the_problem(url: str, inputs: list[object],
                                                    why: str) -> None:
    r = httpx.post(f"{url}/v2/models/rag/infer", timeout=60, json={"inputs": inputs})
    assert r.status_code == 400 and why in r.json()["error"], r.text
