"""Routing's metrics: which target answered each routed request and why, circuit breakers,
canaries, shadow traffic, upstream attempts and the semantic cache. Counters and gauges are
cheap enough on the request path (one ``inc`` a request); created lazily per label set."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from sokuji.routing.load import RoutingHooks

SIMILARITY_BUCKETS = (0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.92, 0.94, 0.95, 0.96, 0.97, 0.98,
                      0.99, 0.995, 1.0)
UPSTREAM_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                    5.0, 10.0, 30.0)


class RoutingMetrics:
    def __init__(self, r: CollectorRegistry) -> None:
        self.route = Counter(
            "sokuji_route_requests", "Requests a router answered, by the target that answered "
            "and why (rule:N, default, cascade_kept, cascade_escalated, canary, stable, "
            "fallback:<cause>).", ["router", "target", "reason"], registry=r)
        self.breaker_state = Gauge(
            "sokuji_breaker_state", "A target's circuit breaker: 0 closed, 1 half-open, 2 open.",
            ["target"], registry=r)
        self.breaker_transitions = Counter(
            "sokuji_breaker_transitions", "Circuit breaker state changes.", ["target", "to"],
            registry=r)
        self.canary_weight = Gauge(
            "sokuji_canary_weight", "Percent of a canary router's traffic sent to the canary.",
            ["router"], registry=r)
        self.canary_events = Counter(
            "sokuji_canary_events", "Canary steps, promotions, holds and rollbacks.",
            ["router", "event"], registry=r)
        self.canary_rollbacks = Counter(
            "sokuji_canary_rollbacks", "Canaries rolled back automatically, by reason.",
            ["router", "reason"], registry=r)
        self.shadow = Counter(
            "sokuji_shadow_requests", "Copies sent to a shadow target, by outcome (ok, error, "
            "dropped: the target could not admit it at once).", ["router", "target", "outcome"],
            registry=r)
        self.shadow_disagree = Counter(
            "sokuji_shadow_disagreements", "Shadow answers that differ from the client's.",
            ["router", "target"], registry=r)
        self.shadow_seconds = Histogram(
            "sokuji_shadow_duration_seconds", "Shadow copies' latency.", ["router", "target"],
            buckets=UPSTREAM_BUCKETS, registry=r)
        self.upstream = Counter(
            "sokuji_upstream_requests", "HTTP attempts at upstream servers, by status code or "
            "error.", ["upstream", "code"], registry=r)
        self.upstream_seconds = Histogram(
            "sokuji_upstream_request_duration_seconds", "Upstream attempts' duration.",
            ["upstream"], buckets=UPSTREAM_BUCKETS, registry=r)
        self.semantic = Counter(
            "sokuji_semantic_cache_lookups", "Semantic cache lookups (hit, miss, guarded: near "
            "enough but refused by a guard, empty).", ["model", "result"], registry=r)
        self.semantic_nearest = Histogram(
            "sokuji_semantic_cache_nearest_similarity", "Cosine similarity of every semantic "
            "lookup's nearest entry.", ["model"], buckets=SIMILARITY_BUCKETS, registry=r)
        self.semantic_audits = Counter(
            "sokuji_semantic_cache_audits", "Semantic hits also computed afresh: agree or "
            "disagree (a false hit).", ["model", "outcome"], registry=r)

    def connect(self, hooks: RoutingHooks) -> None:
        hooks.on_route = lambda router, target, reason: self.route.labels(
            router, target, reason).inc()
        hooks.on_breaker = self._breaker
        hooks.on_canary = self._canary
        hooks.on_shadow = self._shadow
        for name in hooks.breakers:
            self.breaker_state.labels(name).set(0)
        for name, router in hooks.routers.items():
            if router.canary is not None:
                self.canary_weight.labels(name).set(router.canary.weight)
            if router.shadow is not None:
                router.shadow.on_result = self._shadow

    def _breaker(self, target: str, state: Any) -> None:
        self.breaker_state.labels(target).set(int(state))
        self.breaker_transitions.labels(target, state.name.lower()).inc()

    def _canary(self, event: Any) -> None:
        self.canary_weight.labels(event.router).set(event.weight)
        self.canary_events.labels(event.router, event.kind).inc()
        if event.kind == "rolled_back":
            self.canary_rollbacks.labels(event.router, event.reason.split(":")[0]).inc()

    def _shadow(self, router: str, target: str, outcome: str, agreed: bool | None,
                seconds: float) -> None:
        self.shadow.labels(router, target, outcome).inc()
        if outcome == "ok":
            self.shadow_seconds.labels(router, target).observe(seconds)
        if agreed is False:
            self.shadow_disagree.labels(router, target).inc()

    def upstream_attempt(self, upstream: str, code: int | str, seconds: float) -> None:
        self.upstream.labels(upstream, str(code)).inc()
        self.upstream_seconds.labels(upstream).observe(seconds)
