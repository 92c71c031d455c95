"""The options of the routing runtimes, declared as a schema (msgspec) like ``config.py``:
``runtime = "upstream"`` (a model that is another server) and ``runtime = "router"`` (a model
that picks one of other models per request), and a model's ``semantic_cache`` table.

They sit in a model's ``options`` table, so a router or an upstream is configured, named,
listed, authorised and addressed like any other model::

    [[models]]
    name = "far-minilm"
    runtime = "upstream"
    options = { protocol = "v2", url = "http://10.0.0.7:8000", upstream_model = "minilm" }

    [[models]]
    name = "intent"
    runtime = "router"
    options = { kind = "cascade", targets = ["intent-small", "intent-large"], threshold = 0.1 }

Pure: msgspec only. ``parse_*`` raise ``ConfigError`` naming the key (``models[3].options.
url``) and the value.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct, field

from sokuji.errors import ConfigError

Positive = Annotated[float, Meta(gt=0)]
NonNegative = Annotated[float, Meta(ge=0)]
Count = Annotated[int, Meta(ge=1)]
Fraction = Annotated[float, Meta(ge=0, le=1)]


class _Options(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


class UpstreamOptions(_Options, frozen=True):
    """A model served by another server. Its address comes from the config only: no value a
    client sends ever reaches the host, port or path."""

    protocol: Literal["v2", "openai"]
    """v2: KServe V2 / Triton HTTP (texts in, one tensor out: an encoder or classifier);
    openai: an OpenAI-compatible server (another Sokuji, llama-server, vLLM)."""
    url: Annotated[str, Meta(pattern=r"\Ahttps?://[^/?#@\s]+/?\Z")]
    """Scheme, host and port only: http://10.0.0.7:8000."""
    upstream_model: Annotated[str, Meta(min_length=1, pattern=r"\A[^/?#\s]+\Z")]
    """The model's name on the upstream."""
    task: Literal["embeddings", "chat"] = "embeddings"
    """openai only: embeddings (an encoder) or chat (a generator: /v1/chat/completions and
    /v1/completions, streamed through)."""
    api_key_env: str = ""
    """Environment variable holding the upstream's API key (sent as a bearer token). The
    client's own key is never forwarded."""
    tenant_keys_env: Mapping[str, str] = field(default_factory=dict)
    """tenant -> environment variable with that tenant's key on the upstream, so a Sokuji
    upstream keeps tenants apart (its caches are per key's tenant); tenants without one use
    ``api_key_env``."""
    max_connections: Count = 32
    connect_timeout_ms: Positive = 1000.0
    timeout_ms: Positive = 30000.0
    """The most one attempt may take (within the request's own deadline)."""
    keepalive_s: Positive = 4.0
    """Idle connections are closed after this; below the upstream's idle timeout (uvicorn: 5 s)."""
    max_response_bytes: Count = 64 * 1024 * 1024
    dims: Annotated[int, Meta(ge=0)] = 0
    """Output width when the upstream cannot be asked at start (0: ask its metadata)."""


class BreakerOptions(_Options, frozen=True):
    failures: Count = 3
    """Failures in a row (errors, timeouts, 5xx) that open the breaker."""
    cooldown_s: Positive = 5.0
    """How long an open breaker skips its target before one probe may try it."""
    max_cooldown_s: Positive = 60.0
    """A failed probe doubles the cool-down, up to this."""


class RuleWhen(_Options, frozen=True):
    """Every condition given must hold; none given: always."""

    max_chars: Annotated[int, Meta(ge=0)] | None = None
    min_chars: Annotated[int, Meta(ge=0)] | None = None
    """Characters of the request's text (all items, or the prompt / messages)."""
    tenant: tuple[str, ...] = ()
    task: tuple[Literal["embed", "chat", "completion"], ...] = ()
    """embed (an encoder's texts), chat, completion (a generator's)."""
    header: Mapping[str, str] = field(default_factory=dict)
    """Header name -> the exact value (e.g. {"x-sokuji-route" = "large"})."""


class Rule(_Options, frozen=True):
    target: Annotated[str, Meta(min_length=1)]
    when: RuleWhen = RuleWhen()


class CanaryOptions(_Options, frozen=True):
    stable: Annotated[str, Meta(min_length=1)]
    canary: Annotated[str, Meta(min_length=1)]
    steps: Annotated[tuple[Annotated[float, Meta(gt=0, le=100)], ...],
                     Meta(min_length=1)] = (5.0, 25.0, 50.0, 100.0)
    """Canary weights in percent, one per step; promoted after the last."""
    window_s: Positive = 30.0
    min_samples: Count = 50
    """Canary requests a step needs before it can pass (fewer: hold, never fail)."""
    alpha: Annotated[float, Meta(gt=0, lt=1)] = 0.0001
    """Per check; checks run after every canary completion, so it is small (A/A: 1e-3 rolled
    back ~2% of healthy rollouts, 1e-4 none of 300; a broken canary still goes at 3 errors)."""
    min_failures: Count = 3
    """Canary errors (or slow requests) needed before a breach can be declared."""
    error_tolerance: Fraction = 0.01
    """A canary error rate this much above stable's is tolerated."""
    p99_slack: Annotated[float, Meta(ge=1)] = 1.2
    """A canary request is slow when it takes more than stable's p99 times this."""
    max_hold_windows: Count = 10
    on_no_traffic: Literal["hold", "promote", "rollback"] = "hold"
    seed: int | None = None


class ShadowOptions(_Options, frozen=True):
    target: Annotated[str, Meta(min_length=1)]
    fraction: Fraction = 1.0


class RouterOptions(_Options, frozen=True):
    kind: Literal["rules", "cascade", "canary"]
    targets: tuple[str, ...] = ()
    """cascade: [small, large]; rules: optional (the rules' targets and default count)."""
    rules: tuple[Rule, ...] = ()
    default: str = ""
    """rules: the target when no rule matches (default: the first rule's)."""
    threshold: float | Literal["calibrated"] = "calibrated"
    """cascade: escalate when the small model's margin (top1 - top2 score) is below this;
    calibrated: the value `sokuji route calibrate` wrote for this router."""
    fallbacks: tuple[str, ...] = ()
    """Tried in order when the chosen target fails, times out, refuses (429) or is open."""
    breaker: BreakerOptions = BreakerOptions()
    attempt_timeout_ms: NonNegative = 0.0
    """The most one attempt at a target may take before the next is tried (0: no bound
    but the target's own; upstreams have ``timeout_ms``)."""
    reserve_ms: NonNegative = 0.0
    """Of the request's deadline, at least this much is kept for the fallbacks (0: the
    next target's measured median latency)."""
    canary: CanaryOptions | None = None
    shadow: ShadowOptions | None = None

    def all_targets(self) -> tuple[str, ...]:
        names: list[str] = [*self.targets, *(r.target for r in self.rules)]
        if self.default:
            names.append(self.default)
        if self.canary is not None:
            names += [self.canary.stable, self.canary.canary]
        names += self.fallbacks
        if self.shadow is not None:
            names.append(self.shadow.target)
        return tuple(dict.fromkeys(names))


class SemanticCacheConfig(_Options, frozen=True):
    """A cache of answers to requests asked before in other words: after the exact cache, per
    tenant; off by default."""

    enabled: bool = False
    embedder: str = "minilm"
    """The encoder model whose embeddings are compared."""
    threshold: float | Literal["calibrated"] = 0.95
    """Cosine similarity at or above which the nearest entry is a hit; calibrated: the value
    `sokuji cache calibrate` wrote for this model."""
    guards: bool = True
    """Refuse hits whose words are the same in another order, or whose numbers differ."""
    audit_rate: Fraction = 0.0
    """Share of hits also computed afresh in the background and compared (the live
    false-hit rate)."""
    max_entries: Count = 10000
    """Entries of this model, across its tenants (least recently used evicted first)."""
    max_bytes: Count = 64 * 1024 * 1024
    tenant_share: Annotated[float, Meta(gt=0, le=1)] = 0.25
    """The most of ``max_entries`` one tenant may hold (past it, its own oldest entries
    go): a busy tenant cannot flush everyone else's."""


def _convert(options: Mapping[str, Any], kind: type[Any], at: str) -> Any:
    try:
        return msgspec.convert(dict(options), kind, strict=False)
    except msgspec.ValidationError as exc:
        reason, _, path = str(exc).partition(" - at `$")
        key = f"{at}{path.rstrip('`')}"
        raise ConfigError(f"Config '{key}': {reason}", param=key) from None


def parse_upstream(options: Mapping[str, Any], at: str) -> UpstreamOptions:
    return _convert(options, UpstreamOptions, at)


def parse_router(options: Mapping[str, Any], at: str, models: Mapping[str, Any]) -> RouterOptions:
    """The router's options, its targets checked against ``models`` (name -> runtime)."""
    opts: RouterOptions = _convert(options, RouterOptions, at)
    if opts.kind == "cascade" and len(opts.targets) != 2:
        raise ConfigError(f"Config '{at}.targets': a cascade has two targets [small, large]",
                          param=f"{at}.targets")
    if opts.kind == "rules" and not opts.rules and not opts.default:
        raise ConfigError(f"Config '{at}.rules': a rules router needs rules or a default",
                          param=f"{at}.rules")
    if opts.kind == "canary" and opts.canary is None:
        raise ConfigError(f"Config '{at}.canary': a canary router needs a canary table",
                          param=f"{at}.canary")
    if isinstance(opts.threshold, float) and not math.isfinite(opts.threshold):
        raise ConfigError(f"Config '{at}.threshold': must be finite", param=f"{at}.threshold")
    for name in opts.all_targets():
        if name not in models:
            raise ConfigError(f"Config '{at}': target '{name}' is not a configured model",
                              param=at)
        if models[name] == "router":
            raise ConfigError(f"Config '{at}': target '{name}' is a router (routers do not "
                              "nest)", param=at)
    return opts


def parse_semantic_cache(table: Mapping[str, Any], at: str,
                         models: Mapping[str, Any]) -> SemanticCacheConfig:
    cfg: SemanticCacheConfig = _convert(table, SemanticCacheConfig, at)
    if cfg.enabled and cfg.embedder not in models:
        raise ConfigError(f"Config '{at}.embedder': '{cfg.embedder}' is not a configured "
                          "model", param=f"{at}.embedder")
    if isinstance(cfg.threshold, float) and not -1.0 <= cfg.threshold <= 1.0:
        raise ConfigError(f"Config '{at}.threshold': a cosine similarity is within [-1, 1]",
                          param=f"{at}.threshold")
    return cfg
