"""The ingress deployment: one Ray Serve replica is one whole Sokuji.

Each replica loads the configured models and serves Sokuji's own ASGI app, exactly as
``sokuji serve`` does: admission (429 with the drain-rate ``Retry-After``), deadlines,
batching, ``Server-Timing``, auth and metrics all run in the replica's process, next to the
batchers. Ray adds replicas, placement, restarts and autoscaling around it. Measured
(docs/research/issue17-ray.md): every design that puts a Python hop between HTTP and the
batcher (Serve's proxy, a handle from a front end) costs 3-12 ms at idle and 2x the CPU a
request on two cores; HAProxy straight to the replica's own HTTP server costs ~1 ms.

Serve's own limits stay above Sokuji's admission (``max_ongoing_requests`` 4096, no
``max_queued_requests``), so Serve never holds a request Sokuji would have refused or
batched. Autoscaling reads Sokuji's queue depth (``record_autoscaling_stats``) through
``QueueDepthPolicy``; Serve's health check asks the repository whether every model is
alive. Every response names its replica (``x-sokuji-replica``), for operators and tests.

``app(args)`` builds the application for ``serve run sokuji.scale.ray_app:app
config=FILE`` (users who drive Serve themselves); ``sokuji serve --ray`` uses
``application(config)``.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from typing import Any

from ray import serve
from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, BackpressureConfig
from ray.serve.exceptions import RayServeException

from sokuji.config import ServerConfig
from sokuji.scale.ray_env import config_builtins, config_from_builtins

log = logging.getLogger(__name__)
REPLICA_HEADER = b"x-sokuji-replica"


class _NamedReplies:
    """Adds ``x-sokuji-replica: <id>`` to every response (one header on the start
    message; nothing else touched)."""

    def __init__(self, app: Any, replica: str) -> None:
        self.app = app
        self.header = (REPLICA_HEADER, replica.encode())

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def named(message: Any) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), self.header]
            await send(message)

        await self.app(scope, receive, named)


@serve.deployment(name="Sokuji")
@serve.ingress()
class SokujiReplica:
    """One whole Sokuji: its models, batchers, engines and HTTP app."""

    def __init__(self, config: Mapping[str, Any],
                 llm: Mapping[str, Any] | None = None) -> None:
        from sokuji.observability.metrics import Metrics
        from sokuji.repository.models import ModelRepository

        self.config = config_from_builtins(config)
        logging.basicConfig(level=self.config.log_level.upper()
                            if self.config.log_level != "trace" else "DEBUG")
        served = None
        if llm:  # generators in deployments of their own (prefix affinity)
            from sokuji.scale.ray_llm import remote_generators

            served = remote_generators(self.config, llm)
        self.metrics = Metrics()
        self.repo = ModelRepository.load(self.config, on_batch=self.metrics.batch_observer,
                                         served=served)
        try:
            ctx = serve.get_replica_context()
            self.replica, self.app_name = ctx.replica_id.unique_id, ctx.app_name
        except RayServeException:  # outside Serve (unit use): the pid names it
            self.replica, self.app_name = f"pid-{os.getpid()}", self.config.ray.app_name
        self.cluster: Any = None

    def __serve_build_asgi_app__(self) -> Any:
        from sokuji.scale.ray_metrics import ClusterMetrics
        from sokuji.server.app import create_app

        app = create_app(self.config, self.repo, self.metrics)
        self.cluster = ClusterMetrics(self.app_name, self.replica, self.metrics,
                                      self.config.ray.metrics_push_s)
        if app.control is not None:  # /metrics: every replica's, labelled
            app.control.cluster_metrics = self.cluster.render
        self.cluster.start()  # (called on the replica's event loop)
        return _NamedReplies(app, self.replica)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Sokuji's own load, for ``QueueDepthPolicy``: requests waiting in its queues
        (encoders' batchers, generators' engines) and running."""
        waiting = running = 0
        for model in self.repo.every():
            cap = model.served.capacity()
            waiting += cap.num_waiting
            running += cap.num_running
        return {"sokuji_queue_depth": float(waiting), "sokuji_running": float(running)}

    def check_health(self) -> None:
        """Serve's health check: a model whose worker or engine died fails the replica,
        and Serve replaces it."""
        dead = [m.name for m in self.repo.every() if m.started and not m.served.alive]
        if dead:
            raise RuntimeError(f"models not alive: {', '.join(dead)}")

    def describe(self) -> dict[str, Any]:
        """Which process this replica is (tests, operators)."""
        return {"replica": self.replica, "pid": os.getpid(),
                "models": sorted(self.repo.models)}


class QueueDepthPolicy:
    """Autoscaling on Sokuji's own load: replicas = ceil(requests waiting in every
    replica's queues / ``target`` per replica), and never fewer than now while any request
    waits (a replica is not taken away from under a queue). Serve applies min/max, the
    delays and the factors around it. (A class: Serve passes ``policy_kwargs`` only to a
    class, and keeps one instance.)"""

    def __init__(self, target: float = 8.0) -> None:
        self.target = target

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        per_replica = (ctx.aggregated_metrics or {}).get("sokuji_queue_depth", {})
        waiting = float(sum(per_replica.values()))
        want = 1
        if waiting > 0:
            want = max(math.ceil(waiting / self.target), ctx.current_num_replicas)
        state = dict(ctx.policy_state or {})
        state["sokuji_waiting"] = waiting
        return want, state


def application(config: ServerConfig, llm: Mapping[str, Any] | None = None) -> Any:
    """The bound Serve application for ``config`` (its ``[ray]`` table)."""
    rc = config.ray
    options: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": rc.num_cpus},
        "max_ongoing_requests": rc.max_ongoing_requests,
        # A guard only (Sokuji's admission refuses first): if Serve itself ever refuses,
        # the client still gets a 429 with a Retry-After, never a 503.
        "backpressure_config": BackpressureConfig(status_code=429, retry_after_s=1),
        "health_check_period_s": rc.health_check_period_s,
        "health_check_timeout_s": rc.health_check_timeout_s,
        "graceful_shutdown_timeout_s": rc.graceful_shutdown_timeout_s,
        "graceful_shutdown_wait_loop_s": min(2.0, max(0.1, rc.graceful_shutdown_timeout_s)),
    }
    if rc.max_replicas > rc.replicas or rc.max_replicas > rc.min_replicas:
        options["autoscaling_config"] = AutoscalingConfig(
            min_replicas=min(rc.min_replicas, rc.replicas),
            initial_replicas=rc.replicas,
            max_replicas=max(rc.max_replicas, rc.replicas),
            look_back_period_s=rc.look_back_s,
            # Ray 2.60 pushes replica metrics every metrics_interval_s (default 10 s: an
            # 11 s scale-up measured, 2.4 s at 0.5 s); its push-interval variables are unread.
            metrics_interval_s=min(1.0, rc.look_back_s / 2),
            upscale_delay_s=rc.upscale_delay_s,
            downscale_delay_s=rc.downscale_delay_s,
            policy=AutoscalingPolicy(
                policy_function="sokuji.scale.ray_app:QueueDepthPolicy",
                policy_kwargs={"target": rc.target_queue_per_replica}))
    else:
        options["num_replicas"] = rc.replicas
    deployment: Any = SokujiReplica  # (Serve's decorators hide .options from mypy)
    return deployment.options(**options).bind(config_builtins(config), dict(llm or {}))


def app(args: dict[str, str]) -> Any:
    """``serve run sokuji.scale.ray_app:app config=FILE``: the config file (or
    ``$SOKUJI_CONFIG``, or the built-in one) as ``sokuji serve`` reads it. Generators stay
    in the replicas here (``sokuji serve --ray`` deploys the affinity tier)."""
    from sokuji import config as cfg

    config = cfg.load(args.get("config"))
    return application(config)
