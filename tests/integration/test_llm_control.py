"""The control plane for a generative model, in-process on the shipped SmolLM2: Triton's
config and statistics of a generation, and the tenant's priority ceiling on the LLM path."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from sokuji import config as cfg
from sokuji.core.request import Priority
from tests.conftest import CACHE_DIR, client_for

pytestmark = pytest.mark.integration

CAPPED = {"x-api-key": "key-of-capd-0004"}
OPS = {"x-api-key": "key-of-ops-00005"}  # statistics need an admin key


@pytest.fixture(scope="module")
def llm() -> Iterator[TestClient]:
    model = cfg.ModelConfig(name="smollm2", runtime="llama", cache=False,
                            options={"slots": 1, "context_size": 256, "max_new_tokens": 16,
                                     "prefix_cache_mb": 0})
    keys = (cfg.ApiKey(key="key-of-capd-0004", tenant="capd", max_priority="batch"),
            cfg.ApiKey(key="key-of-ops-00005", tenant="ops", admin=True))
    config = cfg.validate(cfg.ServerConfig(models=(model,), cache_dir=str(CACHE_DIR),
                                           api_keys=keys))
    with client_for(config) as client:
        yield client


def chat(client: TestClient, headers: dict[str, str]) -> Any:
    r = client.post("/v1/chat/completions", headers=headers, json={
        "model": "smollm2", "max_tokens": 2, "temperature": 0,
        "messages": [{"role": "user", "content": "Say hi."}]})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_generation_cannot_rise_above_the_tenants_ceiling(llm: TestClient) -> None:
    engine = llm.app.inference.repo.models["smollm2"].served.engine  # type: ignore[attr-defined]
    seen: list[Priority] = []
    submit = engine.submit

    def spy(gen: Any) -> None:
        seen.append(gen.priority)
        submit(gen)

    engine.submit = spy
    try:
        chat(llm, CAPPED | {"x-sokuji-priority": "interactive"})
    finally:
        engine.submit = submit
    assert seen == [Priority.BATCH]


def test_config_and_stats_of_a_generative_model(llm: TestClient) -> None:
    config = llm.get("/v2/models/smollm2/config", headers=CAPPED).json()
    assert config["max_batch_size"] == 0 and "dynamic_batching" not in config
    assert config["model_transaction_policy"] == {"decoupled": True}
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["input"]] == \
        [("text_input", "TYPE_STRING", [1])]
    assert llm.get("/v2/models/smollm2/stats", headers=CAPPED).status_code == 403
    (before,) = llm.get("/v2/models/smollm2/stats", headers=OPS).json()["model_stats"]
    chat(llm, CAPPED)
    (after,) = llm.get("/v2/models/smollm2/stats", headers=OPS).json()["model_stats"]
    stats = {k: (after["inference_stats"][k]["count"] - before["inference_stats"][k]["count"],
                 after["inference_stats"][k]["ns"] - before["inference_stats"][k]["ns"])
             for k in after["inference_stats"]}
    assert after["inference_count"] - before["inference_count"] == 1  # one generation
    for part in ("success", "queue", "compute_input", "compute_infer", "compute_output"):
        assert stats[part][0] == 1, part
    assert stats["compute_infer"][1] > 0 and stats["compute_output"][1] == 0
    assert stats["success"][1] >= stats["compute_input"][1] + stats["queue"][1] + \
        stats["compute_infer"][1]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_readiness_turns_503_when_the_engine_thread_dies() -> None:
    model = cfg.ModelConfig(name="smollm2", runtime="llama", cache=False, warmup=False,
                            options={"slots": 1, "context_size": 256, "prefix_cache_mb": 0})
    config = cfg.validate(cfg.ServerConfig(models=(model,), cache_dir=str(CACHE_DIR)))
    with client_for(config) as client:
        def ready() -> tuple[int, int, int]:
            return (client.get("/v2/health/ready").status_code,
                    client.get("/health").status_code,
                    client.get("/v2/models/smollm2/ready").status_code)

        assert ready() == (200, 200, 200)
        engine = client.app.inference.repo.models["smollm2"].served.engine  # type: ignore[attr-defined]

        def broken(entries: object) -> int:
            raise ZeroDivisionError("a bug inside the engine loop")

        engine.model.decode = broken  # the next step raises inside the engine thread
        r = client.post("/v1/completions", json={"model": "smollm2", "prompt": "Hi",
                                                 "max_tokens": 2})
        assert r.status_code == 500 and "internal error in the generation engine" in r.text
        assert engine._thread is not None
        engine._thread.join(30)
        assert not engine.alive
        assert ready() == (503, 503, 503)
        r = client.post("/v1/completions", json={"model": "smollm2", "prompt": "Hi",
                                                 "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_ready"
        assert client.get("/v2/health/live").status_code == 200
