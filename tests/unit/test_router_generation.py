"""A router over generators (the built-in SmolLM2 twice): chat and completions through it,
streamed or not, as the model answers directly; the commit point; a generating pipeline
whose answer step is a router."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from sokuji import config as cfg
from sokuji.pipelines.config import PipelineConfig, StepConfig
from tests.conftest import CACHE_DIR, client_for

LLM = {"slots": 2, "context_size": 512}


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    from sokuji.llm import native

    gguf = str(native.smollm2_path())
    models = (
        cfg.ModelConfig(name="a", runtime="llama", cache=False, options=LLM, path=gguf),
        cfg.ModelConfig(name="b", runtime="llama", cache=False, options=LLM, path=gguf),
        cfg.ModelConfig(name="gr", runtime="router", options={
            "kind": "rules", "default": "a", "fallbacks": ["b"],
            "rules": [{"when": {"task": ["completion"]}, "target": "b"}]}))
    pipe = PipelineConfig(name="ask", inputs=("question",), steps=(StepConfig(
        name="answer", kind="model", model="gr", inputs={"prompt": "input.question"},
        options={"max_tokens": 8}),))
    config = cfg.validate(cfg.ServerConfig(models=models, pipelines=(pipe,),
                                           builtin_pipelines=False, cache_dir=str(CACHE_DIR)))
    with client_for(config) as c:
        yield c


def _chat(client: TestClient, model: str, **extra: Any) -> Any:
    body = {"model": model, "max_tokens": 10, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            **extra}
    return client.post("/v1/chat/completions", json=body)


def test_chat_through_a_router_is_the_models_own_answer(client: TestClient) -> None:
    direct = _chat(client, "a")
    routed = _chat(client, "gr")
    assert routed.status_code == 200, routed.text
    assert routed.headers["x-sokuji-served-by"] == "a"
    assert routed.json()["model"] == "gr"
    assert routed.json()["choices"][0]["message"]["content"] == \
        direct.json()["choices"][0]["message"]["content"]
    assert "route;" in routed.headers["server-timing"]


def test_streamed_through_a_router(client: TestClient) -> None:
    direct = _chat(client, "a")
    with client.stream("POST", "/v1/chat/completions", json={
            "model": "gr", "max_tokens": 10, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]}) as r:
        assert r.status_code == 200
        assert r.headers["x-sokuji-served-by"] == "a"
        text = "".join(r.iter_text())
    assert "[DONE]" in text and "route;" in text  # the timing trailer names the route
    import json

    pieces = [json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
              for line in text.splitlines()
              if line.startswith("data: {") and '"choices":[{' in line.replace(" ", "")]
    assert "".join(pieces) == direct.json()["choices"][0]["message"]["content"]


def test_completions_follow_the_task_rule(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"model": "gr", "prompt": "Once upon a time",
                                               "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.headers["x-sokuji-served-by"] == "b"


def test_a_pipeline_step_may_be_a_router(client: TestClient) -> None:
    body = {"inputs": [{"name": "question", "datatype": "BYTES", "shape": [1],
                        "data": ["The capital of France is"]}]}
    r = client.post("/v2/models/ask/infer", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["data"][0]


def test_bad_requests_are_the_clients_and_name_the_problem(client: TestClient) -> None:
    r = _chat(client, "gr", max_tokens=-1)
    assert r.status_code == 400
    assert "max_tokens" in r.text
