"""The options of the routing kinds, declared as schemas (msgspec) like ``config.py``:
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

Pure: msgspec only. The tables are converted by ``config_errors.convert`` when the config
loads (each kind's ``options``); what needs the other models' names (a router's targets, a
semantic cache's embedder) is checked by the router's kind (``kinds/router``) and by
``parse_semantic_cache``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from msgspec import Meta, field

from sokuji import config_errors
from sokuji.config_types import (
    AtLeast1,
    Fraction,
    MoreThanZero,
    NonEmpty,
    ZeroOrMore,
    ZeroOrMoreS,
    _Table,
    _why,
)
from sokuji.errors import ConfigError

Threshold = Annotated[float | Literal["calibrated"],
                      _why('must be a number or "calibrated"')]


class UpstreamOptions(_Table, frozen=True):
    """A model served by another server. Its address comes from the config only: no value a
    client sends ever reaches the host, port or path."""

    protocol: Literal["v2", "openai"]
    """v2: KServe V2 / Triton HTTP (texts in, one tensor out: an encoder or classifier);
    openai: an OpenAI-compatible server (another Sokuji, llama-server, vLLM)."""
    url: Annotated[str, _why("must be http(s)://host[:port], without a path",
                             pattern=r"\Ahttps?://[^/?#@\s]+/?\Z")]
    """Scheme, host and port only: http://10.0.0.7:8000."""
    upstream_model: Annotated[str, _why("must be a model's name (no '/', '?', '#' or spaces)",
                                        min_length=1, pattern=r"\A[^/?#\s]+\Z")]
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
    max_connections: AtLeast1 = 32
    connect_timeout_ms: MoreThanZero = 1000.0
    timeout_ms: MoreThanZero = 30000.0
    """The most one attempt may take (within the request's own deadline)."""
    keepalive_s: MoreThanZero = 4.0
    """Idle connections are closed after this; below the upstream's idle timeout (uvicorn: 5 s)."""
    max_response_bytes: AtLeast1 = 64 * 1024 * 1024
    dims: ZeroOrMore = 0
    """Output width when the upstream cannot be asked at start (0: ask its metadata)."""


class BreakerOptions(_Table, frozen=True):
    failures: AtLeast1 = 3
    """Failures in a row (errors, timeouts, 5xx) that open the breaker."""
    cooldown_s: MoreThanZero = 5.0
    """How long an open breaker skips its target before one probe may try it."""
    max_cooldown_s: MoreThanZero = 60.0
    """A failed probe doubles the cool-down, up to this."""


class RuleWhen(_Table, frozen=True):
    """Every condition given must hold; none given: always."""

    max_chars: ZeroOrMore | None = None
    min_chars: ZeroOrMore | None = None
    """Characters of the request's text (all items, or the prompt / messages)."""
    tenant: tuple[str, ...] = ()
    task: tuple[Literal["embed", "chat", "completion"], ...] = ()
    """embed (an encoder's texts), chat, completion (a generator's)."""
    header: Mapping[str, str] = field(default_factory=dict)
    """Header name -> the exact value (e.g. {"x-sokuji-route" = "large"})."""


class Rule(_Table, frozen=True):
    target: NonEmpty
    when: RuleWhen = RuleWhen()


class CanaryOptions(_Table, frozen=True):
    stable: NonEmpty
    canary: NonEmpty
    steps: Annotated[tuple[Annotated[float, Meta(gt=0, le=100)], ...],
                     _why("must be a list of percentages (above 0, at most 100), at least "
                          "one", min_length=1)] = (5.0, 25.0, 50.0, 100.0)
    """Canary weights in percent, one per step; promoted after the last."""
    window_s: MoreThanZero = 30.0
    min_samples: AtLeast1 = 50
    """Canary requests a step needs before it can pass (fewer: hold, never fail)."""
    alpha: Annotated[float, _why("must be between 0 and 1 (exclusive)", gt=0, lt=1)] = 0.0001
    """Per check; checks run after every canary completion, so it is small (A/A: 1e-3 rolled
    back ~2% of healthy rollouts, 1e-4 none of 300; a broken canary still goes at 3 errors)."""
    min_failures: AtLeast1 = 3
    """Canary errors (or slow requests) needed before a breach can be declared."""
    error_tolerance: Fraction = 0.01
    """A canary error rate this much above stable's is tolerated."""
    p99_slack: Annotated[float, Meta(ge=1)] = 1.2
    """A canary request is slow when it takes more than stable's p99 times this."""
    max_hold_windows: AtLeast1 = 10
    on_no_traffic: Literal["hold", "promote", "rollback"] = "hold"
    seed: int | None = None


class ShadowOptions(_Table, frozen=True):
    target: NonEmpty
    fraction: Fraction = 1.0


class RouterOptions(_Table, frozen=True):
    kind: Literal["rules", "cascade", "canary"]
    targets: tuple[str, ...] = ()
    """cascade: [small, large]; rules: optional (the rules' targets and default count)."""
    rules: tuple[Rule, ...] = ()
    default: str = ""
    """rules: the target when no rule matches (default: the first rule's)."""
    threshold: Threshold = "calibrated"
    """cascade: escalate when the small model's margin (top1 - top2 score; generators: its
    answer's mean token log-probability) is below this; calibrated: the value `sokuji route
    calibrate` wrote for this router."""
    fallbacks: tuple[str, ...] = ()
    """Tried in order when the chosen target fails, times out, refuses (429) or is open."""
    breaker: BreakerOptions = BreakerOptions()
    attempt_timeout_ms: ZeroOrMoreS = 0.0
    """The most one attempt at a target may take before the next is tried (0: no bound
    but the target's own; upstreams have ``timeout_ms``)."""
    reserve_ms: ZeroOrMoreS = 0.0
    """Of the request's deadline, at least this much is kept for the fallbacks (0: the
    next target's measured median latency)."""
    canary: CanaryOptions | None = None
    shadow: ShadowOptions | None = None

    def all_targets(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(name for _, name in self.named_targets()))

    def named_targets(self) -> list[tuple[str, str]]:
        """(the key that names it, under ``options``; the target) for every target named."""
        named = [("targets", t) for t in self.targets]
        named += [(f"rules[{i}].target", r.target) for i, r in enumerate(self.rules)]
        if self.default:
            named.append(("default", self.default))
        if self.canary is not None:
            named += [("canary.stable", self.canary.stable), ("canary.canary", self.canary.canary)]
        named += [("fallbacks", f) for f in self.fallbacks]
        if self.shadow is not None:
            named.append(("shadow.target", self.shadow.target))
        return named


class SemanticCacheConfig(_Table, frozen=True):
    """A cache of answers to requests asked before in other words: after the exact cache, per
    tenant; off by default."""

    enabled: bool = False
    embedder: str = "minilm"
    """The encoder model whose embeddings are compared."""
    threshold: Annotated[Annotated[float, Meta(ge=-1, le=1)] | Literal["calibrated"],
                         _why('must be a cosine similarity (from -1 to 1) or "calibrated"')] \
        = 0.95
    """Cosine similarity at or above which the nearest entry is a hit; calibrated: the value
    `sokuji cache calibrate` wrote for this model."""
    guards: bool = True
    """Refuse hits whose words are the same in another order, or whose numbers differ."""
    audit_rate: Fraction = 0.0
    """Share of hits also computed afresh in the background and compared (the live
    false-hit rate)."""
    max_entries: AtLeast1 = 10000
    """Entries of this model, across its tenants (least recently used evicted first)."""
    max_bytes: AtLeast1 = 64 * 1024 * 1024
    tenant_share: Annotated[float, _why("must be above 0 and at most 1", gt=0, le=1)] = 0.25
    """The most of ``max_entries`` one tenant may hold (past it, its own oldest entries
    go): a busy tenant cannot flush everyone else's."""


def parse_semantic_cache(table: Mapping[str, Any], at: str,
                         models: Mapping[str, Any]) -> SemanticCacheConfig:
    """A model's ``semantic_cache`` table (``at``: ``models[i].semantic_cache``), its
    embedder checked against ``models`` (name -> runtime)."""
    cfg = config_errors.convert(table, SemanticCacheConfig, at)
    if cfg.enabled and cfg.embedder not in models:
        raise ConfigError.for_key(f"{at}.embedder", cfg.embedder, "no such model")
    return cfg
