"""Routers over synthetic models, through the HTTP layer: rules, fallbacks, circuit breakers,
the served-by header, admission, config checks."""

from __future__ import annotations

import tempfile
from typing import Any

import pytest

from sokuji import config as cfg
from sokuji.errors import ConfigError
from tests.conftest import client_for


def _model(name: str, **options: Any) -> cfg.ModelConfig:
    return cfg.ModelConfig(name=name, runtime="synthetic", max_batch_size=8,
                           options={"base_ms": 0.0, **options})


def _config(*models: cfg.ModelConfig, **server: Any) -> cfg.ServerConfig:
    server.setdefault("cache_dir", tempfile.mkdtemp(prefix="sokuji-test-"))
    return cfg.validate(cfg.ServerConfig(
        models=models, max_request_bytes=64 * 1024, cache=cfg.CacheConfig(enabled=False),
        **server))


def _router(name: str, **options: Any) -> cfg.ModelConfig:
    return cfg.ModelConfig(name=name, runtime="router", options=options)


def _infer(client: Any, model: str, texts: list[str], **headers: str) -> Any:
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [len(texts)],
                        "data": texts}]}
    return client.post(f"/v2/models/{model}/infer", json=body, headers=headers)


def _metric(client: Any, line_start: str) -> float:
    text = client.get("/metrics").text
    for line in text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


RULES = dict(kind="rules", rules=[
    {"when": {"max_chars": 10}, "target": "small"},
    {"when": {"header": {"x-sokuji-route": "big"}}, "target": "big"},
], default="big")


def test_rules_pick_the_target_and_name_it() -> None:
    with client_for(_config(_model("small"), _model("big"), _router("r", **RULES))) as c:
        short = _infer(c, "r", ["hi"])
        assert short.status_code == 200, short.text
        assert short.headers["x-sokuji-served-by"] == "small"
        assert 'route;' in short.headers["server-timing"]
        assert "rule:0" in short.headers["server-timing"]
        long_ = _infer(c, "r", ["a text longer than ten"])
        assert long_.headers["x-sokuji-served-by"] == "big"
        assert long_.json()["outputs"][0]["data"] == [22.0]  # the target's own answer
        assert _metric(c, 'sokuji_route_requests_total{reason="rule:0",router="r",'
                          'target="small"}') == 1
        assert _metric(c, 'sokuji_route_requests_total{reason="default",router="r",'
                          'target="big"}') == 1


def test_rules_match_headers_tenants_and_tasks() -> None:
    opts = dict(kind="rules", rules=[
        {"when": {"header": {"X-Sokuji-Route": "big"}}, "target": "big"},
        {"when": {"tenant": ["t2"]}, "target": "big"},
        {"when": {"task": ["chat"]}, "target": "big"},
    ], default="small")
    keys = (cfg.ApiKey(key="key-one-123", tenant="t1"), cfg.ApiKey(key="key-two-123",
                                                                    tenant="t2"))
    with client_for(_config(_model("small"), _model("big"), _router("r", **opts),
                            api_keys=keys)) as c:
        one = {"authorization": "Bearer key-one-123"}
        assert _infer(c, "r", ["x"], **one).headers["x-sokuji-served-by"] == "small"
        assert _infer(c, "r", ["x"], **one, **{"x-sokuji-route": "big"}).headers[
            "x-sokuji-served-by"] == "big"
        two = {"authorization": "Bearer key-two-123"}
        assert _infer(c, "r", ["x"], **two).headers["x-sokuji-served-by"] == "big"


def test_openai_embeddings_through_a_router() -> None:
    with client_for(_config(_model("small"), _model("big"), _router("r", **RULES))) as c:
        r = c.post("/v1/embeddings", json={"model": "r", "input": ["abc"]})
        assert r.status_code == 200, r.text
        assert r.headers["x-sokuji-served-by"] == "small"
        assert r.json()["data"][0]["embedding"] == [3.0]


def test_a_failing_target_falls_back_and_says_why() -> None:
    models = (_model("a", fail_on="boom"), _model("b"),
              _router("r", kind="rules", default="a", fallbacks=["b"]))
    with client_for(_config(*models)) as c:
        ok = _infer(c, "r", ["fine"])
        assert ok.headers["x-sokuji-served-by"] == "a"
        r = _infer(c, "r", ["boom"])
        assert r.status_code == 200, r.text
        assert r.headers["x-sokuji-served-by"] == "b"
        assert "fallback:error" in r.headers["server-timing"]
        assert "a error" in r.headers["server-timing"]
        assert _metric(c, 'sokuji_route_requests_total{reason="fallback:error",router="r",'
                          'target="b"}') == 1


def test_an_open_breaker_skips_its_target_without_calling_it() -> None:
    models = (_model("a", fail_on="boom"), _model("b"),
              _router("r", kind="rules", default="a", fallbacks=["b"],
                      breaker={"failures": 2, "cooldown_s": 60}))
    with client_for(_config(*models)) as c:
        for _ in range(2):
            assert _infer(c, "r", ["boom"]).headers["x-sokuji-served-by"] == "b"
        batches = _metric(c, 'sokuji_batch_size_count{model="a"}')
        r = _infer(c, "r", ["fine"])  # a is open now: b answers, a is not called
        assert r.headers["x-sokuji-served-by"] == "b"
        assert "a open" in r.headers["server-timing"]
        assert "fallback:breaker_open" in r.headers["server-timing"]
        assert _metric(c, 'sokuji_batch_size_count{model="a"}') == batches
        assert _metric(c, 'sokuji_breaker_state{target="a"}') == 2


def test_a_lone_failing_target_is_cooled_down_too() -> None:
    """LiteLLM's gap: a group of one deployment was never cooled down. Here the lone target's
    breaker opens, and requests fail at once with 503 and Retry-After, without calling it."""
    models = (_model("a", fail_on="boom"),
              _router("r", kind="rules", default="a", breaker={"failures": 2,
                                                               "cooldown_s": 30}))
    with client_for(_config(*models)) as c:
        for _ in range(2):
            assert _infer(c, "r", ["boom"]).status_code == 500
        batches = _metric(c, 'sokuji_batch_size_count{model="a"}')
        r = _infer(c, "r", ["fine"])
        assert r.status_code == 503, r.text
        assert 1 <= int(r.headers["retry-after"]) <= 30
        assert "cooling down" in r.json()["error"]
        assert _metric(c, 'sokuji_batch_size_count{model="a"}') == batches


def test_client_errors_do_not_fall_back() -> None:
    """A 4xx is the request's fault: another target would refuse it too. It is raised at
    once, and it does not count against the target's breaker."""
    import asyncio

    from sokuji.core.model import RequestContext
    from sokuji.core.request import Priority
    from sokuji.errors import InvalidInput
    from sokuji.routing.attempts import Attempts, RouteInfo, Target
    from sokuji.routing.breaker import Breaker, BreakerState
    from sokuji.routing.config import BreakerOptions, RouterOptions

    calls: list[str] = []

    async def call(target: Target) -> str:
        calls.append(target.name)
        raise InvalidInput("bad text", param="text")

    opts = RouterOptions(kind="rules", default="a", fallbacks=("b",))
    a = Target("a", None, Breaker("a", BreakerOptions(failures=1)))  # type: ignore[arg-type]
    b = Target("b", None, Breaker("b", BreakerOptions(failures=1)))  # type: ignore[arg-type]
    ctx = RequestContext(tenant="t", priority=Priority.INTERACTIVE, deadline_ns=None,
                         arrival_ns=0)
    with pytest.raises(InvalidInput):
        asyncio.run(Attempts("r", ctx, opts).run([(a, "default"), (b, "fallback")],
                                                 RouteInfo(), call))
    assert calls == ["a"]
    assert a.breaker.state is BreakerState.CLOSED


def test_a_slow_target_is_abandoned_for_the_fallback() -> None:
    models = (_model("a", base_ms=2000.0), _model("b"),
              _router("r", kind="rules", default="a", fallbacks=["b"],
                      attempt_timeout_ms=100))
    with client_for(_config(*models)) as c:
        r = _infer(c, "r", ["x"])
        assert r.status_code == 200, r.text
        assert r.headers["x-sokuji-served-by"] == "b"
        assert "fallback:timeout" in r.headers["server-timing"]


@pytest.mark.parametrize(("options", "key", "reason"), [
    (dict(kind="rules", default="nope"), "default", "no such model"),
    (dict(kind="cascade", targets=["a"], threshold=0.1), "targets", "a cascade has two targets"),
    (dict(kind="rules"), "rules", "needs rules or a default"),
    (dict(kind="canary"), "canary", "needs a canary table"),
    (dict(kind="rules", default="a", breaker={"failures": 0}), "breaker.failures",
     "must be at least 1"),
    (dict(kind="rules", default="a", surprise=1), "surprise", "unknown key"),
    (dict(kind="rules", default="r2"), "default", "routers do not nest"),
])
def test_bad_router_options_name_the_key(options: dict[str, Any], key: str,
                                         reason: str) -> None:
    with pytest.raises(ConfigError) as err:  # when the config loads, before any build
        _config(_model("a"), _router("r2", kind="rules", default="a"), _router("r", **options))
    assert err.value.param == f"models[2].options.{key}" and reason in err.value.message


def test_targets_must_take_and_return_the_same_tensors() -> None:
    # The tests' shared cache: MiniLM is exported there once (in a fresh one: ~25 s).
    from tests.conftest import CACHE_DIR

    config = _config(_model("a"), cfg.ModelConfig(name="minilm", warmup=False),
                     _router("r", kind="rules", default="a", fallbacks=["minilm"]),
                     cache_dir=str(CACHE_DIR))
    from sokuji.repository.models import ModelRepository

    with pytest.raises(ConfigError, match=r"target .minilm.*must take and return the same"):
        ModelRepository.load(config)


def test_a_cascade_needs_classifiers() -> None:
    config = _config(_model("a"), _model("b"),
                     _router("r", kind="cascade", targets=["a", "b"], threshold=0.1))
    from sokuji.repository.models import ModelRepository

    with pytest.raises(ConfigError, match="a cascade needs two classifiers"):
        ModelRepository.load(config)


def test_a_canary_that_degrades_is_rolled_back_within_its_window() -> None:
    """The canary (10% of traffic) starts failing every request after its 5th batch. The
    controller compares it with live stable after every completion and rolls back once the
    evidence is decisive (a handful of canary failures); each failed canary request was
    answered by stable meanwhile, so no client saw an error; then stable takes all."""
    canary = dict(stable="v1", canary="v2", steps=[10], window_s=30, min_samples=20,
                  min_failures=3, alpha=0.001, seed=7)
    models = (_model("v1"), _model("v2", degrade_after_batches=5, degrade_error_rate=1.0),
              _router("r", kind="canary", canary=canary))
    with client_for(_config(*models)) as c:
        statuses, served, timing = [], [], []
        for _ in range(400):
            r = _infer(c, "r", ["x"])
            statuses.append(r.status_code)
            served.append(r.headers.get("x-sokuji-served-by"))
            timing.append(r.headers.get("server-timing", ""))
        assert set(statuses) == {200}
        assert _metric(c, 'sokuji_canary_rollbacks_total{reason="errors",router="r"}') == 1
        failed = [i for i, t in enumerate(timing) if "v2 error" in t]
        assert 3 <= len(failed) <= 8, len(failed)
        assert all(served[i] == "v1" for i in failed)
        assert set(served[failed[-1] + 1:]) == {"v1"}  # rolled back: stable only
        assert "v2" in served[:failed[0]]  # it did get traffic before
        assert _metric(c, 'sokuji_canary_weight{router="r"}') == 0


def test_a_healthy_canary_holds_without_traffic_and_never_fails() -> None:
    canary = dict(stable="v1", canary="v2", steps=[50, 100], window_s=30, min_samples=50,
                  seed=3)
    models = (_model("v1"), _model("v2"), _router("r", kind="canary", canary=canary))
    with client_for(_config(*models)) as c:
        for _ in range(20):  # too few for a verdict
            assert _infer(c, "r", ["x"]).status_code == 200
        assert _metric(c, 'sokuji_canary_rollbacks_total{reason="errors",router="r"}') == 0
        assert _metric(c, 'sokuji_canary_weight{router="r"}') == 50


def test_a_router_has_metadata_config_and_statistics_like_a_model() -> None:
    with client_for(_config(_model("small"), _model("big"), _router("r", **RULES))) as c:
        meta = c.get("/v2/models/r")
        assert meta.status_code == 200, meta.text
        assert meta.json()["outputs"][0]["name"] == "length"
        assert c.get("/v2/models/r/config").status_code == 200
        assert c.get("/v2/models/r/ready").status_code == 200
        _infer(c, "r", ["x"])
        stats = c.get("/v2/models/r/stats")
        assert stats.status_code == 200, stats.text
        assert "r" in [m["id"] for m in c.get("/v1/models").json()["data"]]


def test_routers_sharing_a_target_share_its_breaker_and_must_agree_on_it() -> None:
    from sokuji.repository.models import ModelRepository

    strict = _router("s", kind="rules", default="a", breaker={"failures": 1})
    plain = _router("p", kind="rules", default="a")
    repo = ModelRepository.load(_config(_model("a"), strict, plain))
    hooks = repo.models["s"].served.hooks  # type: ignore[attr-defined]
    assert hooks is repo.models["p"].served.hooks  # type: ignore[attr-defined]
    assert hooks.breakers["a"].opts.failures == 1  # the defaults take the other's
    lenient = _router("l", kind="rules", default="a", breaker={"failures": 1000})
    with pytest.raises(ConfigError, match=r"models\[2\].options.breaker.*same breaker table"):
        ModelRepository.load(_config(_model("a"), strict, lenient))
