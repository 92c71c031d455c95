"""The pieces of ``sokuji serve --ray`` that need no cluster: the environment a local
cluster gets, the config's trip to a replica, what several replicas must share, the
autoscaling arithmetic, the replica header. (The command on a real cluster:
tests/integration/test_ray_serve.py.)"""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from sokuji import config as cfg
from sokuji.scale import ray_env


def _config(**ray: Any) -> cfg.ServerConfig:
    return cfg.validate(cfg.ServerConfig(
        models=(cfg.ModelConfig(name="s", runtime="synthetic"),),
        ray=cfg.RayConfig(**ray)))


def test_a_local_cluster_gets_the_fast_path_in_its_own_directory() -> None:
    env = ray_env.cluster_env(cfg.RayConfig(), environ={})
    assert env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    base = Path(env["RAY_SERVE_HAPROXY_SERVER_STATE_BASE"])
    try:
        # Short enough for HAProxy's 97-character socket path after Ray's 56-char hash dir,
        # and private: Ray's admin socket is mode 666 (whoever reaches it controls HAProxy).
        assert len(str(base)) <= ray_env.MAX_HAPROXY_BASE
        assert stat.S_IMODE(os.stat(base).st_mode) == 0o700
        for var in ray_env.HAPROXY_FILES:
            assert env[var].startswith(str(base))
        ports = [int(env[v]) for v in ray_env.HAPROXY_PORTS]
        assert len(set(ports)) == len(ports)  # stats and metrics never share one
        assert env["RAY_SERVE_HAPROXY_RETRY_ON"] == "conn-failure empty-response"
        assert env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "2.0"
    finally:
        base.rmdir()


def test_an_operators_environment_wins_and_options_are_honoured() -> None:
    env = ray_env.cluster_env(cfg.RayConfig(retry_lost=False),
                              environ={"RAY_SERVE_HAPROXY_STATS_PORT": "9000",
                                       "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": "/x"})
    Path(env["RAY_SERVE_HAPROXY_SOCKET_PATH"]).parent.rmdir()
    assert "RAY_SERVE_HAPROXY_STATS_PORT" not in env
    assert "RAY_SERVE_HAPROXY_SERVER_STATE_BASE" not in env
    assert "RAY_SERVE_HAPROXY_RETRY_ON" not in env  # only Ray's conn-failure retries
    assert ray_env.cluster_env(cfg.RayConfig(fast_path=False), environ={}) == {
        "RAY_USAGE_STATS_ENABLED": "0"}


def test_the_config_reaches_a_replica_whole() -> None:
    config = cfg.validate(cfg.ServerConfig(
        models=(cfg.ModelConfig(name="s", runtime="synthetic", options={"base_ms": 3.0}),),
        api_keys=(cfg.ApiKey(key="k" * 16, tenant="t"),),
        ray=cfg.RayConfig(replicas=3, max_replicas=5)))
    data = ray_env.config_builtins(config)
    assert ray_env.config_from_builtins(msgspec.json.decode(msgspec.json.encode(data))) \
        == config


@pytest.mark.parametrize(("ray", "jobs", "cache", "want"), [
    ({"replicas": 1}, "sqlite", "memory", []),
    ({"replicas": 2}, "sqlite", "redis", ["error"]),
    ({"max_replicas": 3}, "redis", "memory", ["warning"]),
    ({"replicas": 2}, "redis", "redis", []),
])
def test_several_replicas_need_what_they_share(ray: dict[str, int], jobs: str, cache: str,
                                               want: list[str]) -> None:
    config = msgspec.structs.replace(
        _config(**ray), jobs=cfg.JobsConfig(backend=jobs),  # type: ignore[arg-type]
        cache=cfg.CacheConfig(backend=cache))  # type: ignore[arg-type]
    assert [line.split(":")[0] for line in ray_env.check_shared_state(config)] == want


def test_the_config_names_bad_ray_values(tmp_path: Path) -> None:
    for body, key in [('app_name = "../x"', "ray.app_name"), ("replicas = 0", "ray.replicas"),
                      ("num_cpus = -1", "ray.num_cpus"), ("http_port = 70000", "ray.http_port")]:
        path = tmp_path / "c.toml"
        path.write_text(f"[ray]\n{body}\n")
        with pytest.raises(cfg.ConfigError, match=key.replace(".", r"\.")):
            cfg.load(path)


def _ctx(waiting: list[float], replicas: int) -> SimpleNamespace:
    return SimpleNamespace(
        aggregated_metrics={"sokuji_queue_depth": {str(i): w for i, w in enumerate(waiting)}},
        current_num_replicas=replicas, policy_state={})


def test_autoscaling_follows_sokujis_queue_depth() -> None:
    ray_app = pytest.importorskip("sokuji.scale.ray_app")
    policy = ray_app.QueueDepthPolicy(target=4.0)
    assert policy(_ctx([0.0], 1))[0] == 1  # idle: one
    assert policy(_ctx([9.0], 1))[0] == 3  # ceil(9 / 4)
    assert policy(_ctx([1.0, 0.0, 0.0], 3))[0] == 3  # never below now while any waits
    assert policy(_ctx([0.0, 0.0, 0.0], 3))[0] == 1  # drained: back down (Serve's delays)
    assert policy(_ctx([9.0], 1))[1]["sokuji_waiting"] == 9.0


def test_every_reply_names_its_replica() -> None:
    ray_app = pytest.importorskip("sokuji.scale.ray_app")
    sent: list[dict[str, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    named = ray_app._NamedReplies(app, "r1")
    asyncio.run(named({"type": "http"}, None, send))
    assert sent[0]["headers"] == [(b"content-type", b"text/plain"), (b"x-sokuji-replica", b"r1")]
    assert sent[1]["body"] == b"ok"


def test_one_metrics_page_for_every_replica() -> None:
    ray_metrics = pytest.importorskip("sokuji.scale.ray_metrics")
    from prometheus_client import CollectorRegistry, Counter, Histogram
    from prometheus_client.exposition import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    def exposition(n: int) -> bytes:
        reg = CollectorRegistry()
        Counter("sokuji_requests", "requests", ["model"], registry=reg).labels("m").inc(n)
        Histogram("sokuji_latency_seconds", "latency", registry=reg,
                  buckets=(0.1, 1.0)).observe(0.5)
        return generate_latest(reg)

    merged = ray_metrics.merge({"a": exposition(2), "b": exposition(5)}).decode()
    assert merged.count("# TYPE sokuji_requests_total counter") == 1  # one family, not two
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    totals = {s.labels["replica"]: s.value for s in families["sokuji_requests"].samples
              if s.name == "sokuji_requests_total"}
    assert totals == {"a": 2.0, "b": 5.0}
    buckets = [s for s in families["sokuji_latency_seconds"].samples
               if s.name.endswith("_bucket") and s.labels["le"] == "1.0"]
    assert sorted(s.labels["replica"] for s in buckets) == ["a", "b"]
