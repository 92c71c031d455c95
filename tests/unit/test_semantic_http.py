"""The semantic cache in the request path: a classifier's items and a generator's answers,
per tenant, guarded, measured (nearest similarity of every lookup), audited."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from sokuji import config as cfg
from sokuji.errors import ConfigError
from tests.conftest import CACHE_DIR, client_for

DATA = Path(__file__).resolve().parent.parent / "data" / "routing"
KEYS = (cfg.ApiKey(key="tenant-a-key", tenant="a"), cfg.ApiKey(key="tenant-b-key", tenant="b"),
        cfg.ApiKey(key="operator-key", tenant="ops", admin=True))
A = {"authorization": "Bearer tenant-a-key"}
OPS = {"authorization": "Bearer operator-key"}  # /metrics needs an admin key
B = {"authorization": "Bearer tenant-b-key"}


def _config(*models: cfg.ModelConfig) -> cfg.ServerConfig:
    return cfg.validate(cfg.ServerConfig(models=(cfg.ModelConfig(name="minilm"), *models),
                                         api_keys=KEYS, cache_dir=str(CACHE_DIR),
                                         builtin_pipelines=False))


def _classifier(**semantic: Any) -> cfg.ModelConfig:
    return cfg.ModelConfig(
        name="intent", runtime="classifier",
        options={"encoder": "minilm", "prototypes": str(DATA / "prototypes.jsonl")},
        semantic_cache={"enabled": True, "embedder": "minilm", "threshold": 0.85,
                        "audit_rate": 1.0, **semantic})


@pytest.fixture(scope="module")
def intent() -> Iterator[TestClient]:
    with client_for(_config(_classifier())) as client:
        yield client


def _ask(client: TestClient, texts: list[str], headers: dict[str, str]) -> Any:
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [len(texts)],
                        "data": texts}]}
    r = client.post("/v2/models/intent/infer", json=body,
                    headers={**headers, "cache-control": "no-cache"})
    assert r.status_code == 200, r.text
    return r


def _metric(client: TestClient, start: str) -> float:
    for line in client.get("/metrics", headers=OPS).text.splitlines():
        if line.startswith(start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_paraphrase_hits_and_its_row_is_the_cached_one(intent: TestClient) -> None:
    first = _ask(intent, ["please tell me my current account balance"], A)
    assert "semantic 0/1 hit" in first.headers["server-timing"]
    second = _ask(intent, ["tell me my current account balance please"], A)
    # the same words reordered: refused by the guard, computed afresh
    assert "semantic 0/1 hit" in second.headers["server-timing"]
    third = _ask(intent, ["please tell me my current account balance now"], A)
    assert "semantic 1/1 hit" in third.headers["server-timing"]
    assert third.json()["outputs"][0]["data"] == first.json()["outputs"][0]["data"]
    assert _metric(intent, 'sokuji_semantic_cache_lookups_total{model="intent",'
                           'result="hit"}') >= 1
    assert _metric(intent, 'sokuji_semantic_cache_lookups_total{model="intent",'
                           'result="guarded"}') >= 1
    # every lookup into a non-empty scope observes its nearest similarity (the first found
    # the tenant's scope empty: counted as result="empty")
    assert _metric(intent, 'sokuji_semantic_cache_nearest_similarity_count{model="intent"}') \
        >= 2


def test_tenants_never_share_entries(intent: TestClient) -> None:
    _ask(intent, ["I cannot find my card anywhere at all"], A)
    other = _ask(intent, ["I cannot find my card anywhere at all"], B)
    assert "semantic 0/1 hit" in other.headers["server-timing"]


def test_items_of_one_request_hit_one_by_one(intent: TestClient) -> None:
    _ask(intent, ["what will the weather be like this weekend"], A)
    r = _ask(intent, ["what will the weather be like this weekend please",
                      "set an alarm for 7 tomorrow morning"], A)
    assert "semantic 1/2 hit" in r.headers["server-timing"]
    rows = r.json()["outputs"][0]["data"]
    assert len(rows) == 2 * 4  # two rows of four labels


def test_hits_are_audited(intent: TestClient) -> None:
    import time

    _ask(intent, ["how much money is left in my savings"], A)
    _ask(intent, ["how much money is left in my savings now"], A)
    deadline = time.monotonic() + 10
    total = 0.0
    while time.monotonic() < deadline and not total:
        total = sum(_metric(intent, 'sokuji_semantic_cache_audits_total{model="intent",'
                                    f'outcome="{o}"}}') for o in ("agree", "disagree"))
    assert total >= 1


def test_a_plain_encoder_cannot_have_one() -> None:
    model = cfg.ModelConfig(name="enc2", runtime="synthetic",
                            semantic_cache={"enabled": True, "embedder": "minilm"})
    with pytest.raises(ConfigError, match="an encoder's output is the embedding"):
        client_for(_config(model))


def test_bad_semantic_options_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"models\[1\].semantic_cache.threshold"):
        _config(_classifier(threshold=1.5))
    with pytest.raises(ConfigError, match=r"semantic_cache.embedder"):
        _config(_classifier(embedder="nope"))


def test_a_generator_answers_a_paraphrase_from_the_cache() -> None:
    llm = cfg.ModelConfig(name="smollm2", runtime="llama", cache=False,
                          options={"slots": 2, "context_size": 512},
                          semantic_cache={"enabled": True, "embedder": "minilm",
                                          "threshold": 0.9})
    with client_for(_config(llm)) as c:
        def chat(text: str, headers: dict[str, str], **extra: Any) -> Any:
            body = {"model": "smollm2", "max_tokens": 12, "temperature": 0,
                    "messages": [{"role": "user", "content": text}], **extra}
            r = c.post("/v1/chat/completions", json=body, headers=headers)
            assert r.status_code == 200, r.text
            return r

        first = chat("What is the capital city of France?", A)
        assert "x-sokuji-served-by" not in first.headers
        again = chat("What is the capital city of France ?", A)
        assert again.headers["x-sokuji-served-by"].startswith("cache semantic")
        assert again.json()["choices"][0]["message"]["content"] == \
            first.json()["choices"][0]["message"]["content"]
        # another tenant, other sampling, or a stream: each its own scope or way
        assert "x-sokuji-served-by" not in chat("What is the capital city of France ?",
                                                B).headers
        assert "x-sokuji-served-by" not in chat("What is the capital city of France ?", A,
                                                max_tokens=5).headers
        stream = c.post("/v1/chat/completions", headers=A, json={
            "model": "smollm2", "max_tokens": 12, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "What is the capital city of France"}]})
        assert stream.headers["x-sokuji-served-by"].startswith("cache semantic")
        assert first.json()["choices"][0]["message"]["content"][:5] in stream.text
