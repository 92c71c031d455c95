"""Admission once per request: the edge (HTTP) asks ``check_admission`` once, before the
body; ``submit`` admits atomically; the layers between (a router, a pipeline's steps) ask
no more. A full target still refuses with 429, and a router still falls back on it."""

from __future__ import annotations

import tempfile
from collections import Counter
from typing import Any

from sokuji import config as cfg
from sokuji.errors import Overloaded
from sokuji.pipelines.config import PipelineConfig, StepConfig
from tests.conftest import client_for


def _config() -> cfg.ServerConfig:
    def model(name: str) -> cfg.ModelConfig:
        return cfg.ModelConfig(name=name, runtime="synthetic", max_batch_size=8,
                               options={"base_ms": 0.0})

    router = cfg.ModelConfig(name="r", runtime="router", options={
        "kind": "rules", "default": "a", "fallbacks": ["b"]})
    pipe = PipelineConfig(name="p", steps=(StepConfig(
        name="embed", kind="model", model="a", inputs={"texts": "input.question"}),))
    return cfg.validate(cfg.ServerConfig(
        models=(model("a"), model("b"), router), pipelines=(pipe,),
        builtin_pipelines=False, cache=cfg.CacheConfig(enabled=False),
        cache_dir=tempfile.mkdtemp(prefix="sokuji-test-")))


def _count(client: Any, calls: Counter[str]) -> None:
    """Count each model's ``check_admission`` calls."""
    for name in ("a", "b"):
        served = client.app.inference.repo.models[name].served
        original = served.check_admission

        def counted(name: str = name, original: Any = original) -> None:
            calls[name] += 1
            original()
        served.check_admission = counted


def _v2(texts: list[str], name: str = "text") -> dict[str, Any]:
    return {"inputs": [{"name": name, "datatype": "BYTES", "shape": [len(texts)],
                        "data": texts}]}


def test_a_routed_request_and_a_pipelines_step_are_admitted_once() -> None:
    calls: Counter[str] = Counter()
    with client_for(_config()) as c:
        _count(c, calls)
        assert c.post("/v2/models/r/infer", json=_v2(["x"])).status_code == 200
        assert calls == {"a": 1}  # the router's edge check asks its first target, once
        calls.clear()
        assert c.post("/v2/models/p/infer", json=_v2(["q"], "question")).status_code == 200
        assert calls == {"a": 1}  # the pipeline's edge check; its step asks no more
        calls.clear()
        assert c.post("/v2/models/a/infer", json=_v2(["x"])).status_code == 200
        assert calls == {"a": 1}


def test_a_full_target_refuses_and_the_router_falls_back() -> None:
    with client_for(_config()) as c:
        a = c.app.inference.repo.models["a"].served
        batcher = a.batcher

        def full(*_: Any) -> None:
            raise Overloaded("model 'a': full", retry_after_s=1)
        batcher._admit = full  # its submit refuses (the edge check still passes)
        r = c.post("/v2/models/r/infer", json=_v2(["x"]))
        assert r.status_code == 200 and r.headers["x-sokuji-served-by"] == "b"
        assert "a refused" in r.headers["server-timing"]
        direct = c.post("/v2/models/a/infer", json=_v2(["x"]))
        assert direct.status_code == 429
