"""The operating side of the config: service-level objectives and tracing.

An SLO (``SloConfig``) is a latency target (p99) and an error-rate target over a rolling
window, for one model (``[[models]] slo = {...}``) or for a tenant (``[[slos]]`` with
``tenant``, optionally narrowed to one model). Sokuji uses it twice: to report (status, error
budget and burn rate in ``/metrics`` and the dashboard: ``observability/slo.py``) and, with
``admission = true``, to admit by time: a request is queued only if its predicted wait plus
service fits the tightest target that applies to it (``core/slo_admission.py``, given the
targets ``budgets_for`` makes).

Tracing (``TracingConfig``): OpenTelemetry spans exported over OTLP/HTTP, sampled
(``observability/tracing.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Literal

from msgspec import field

from sokuji.config_types import AtLeast1, MoreThanZero, _Table, _why
from sokuji.core.slo_budgets import SloBudgets

Ratio = Annotated[float, _why("must be between 0 and 1", ge=0.0, le=1.0)]


class SloConfig(_Table, frozen=True):
    p99_ms: MoreThanZero
    """The latency target: 99% of answered requests within it. For an encoder, media model
    or pipeline the whole request (arrival to reply); for a generator the time to the first
    token."""
    error_rate: Annotated[float, _why("must be between 0 and 1 (exclusive)", ge=0.0, lt=1.0)] \
        = 0.001
    """The error-rate target (5xx and 504 answers over all answered requests; 429 refusals
    are counted apart, as shed load). 1 - availability."""
    window_s: MoreThanZero = 300.0
    """The rolling window the status, the error budget and the burn rate are computed over."""
    admission: bool = True
    """Admit by time: refuse (429) a request whose predicted wait plus service would exceed
    ``p99_ms`` (or its own deadline, if sooner)."""
    batch_share: Annotated[float, _why("must be between 0 and 1", ge=0.0, le=1.0)] = 0.25
    """With admission: the most of ``p99_ms`` one batch may take (its positions capped at
    the measured rate), so that a long batch leaves room for queueing; 0: no cap."""
    tenant: str = ""
    """In ``[[slos]]``: the tenant (as in ``[[api_keys]]``) this SLO is for."""
    model: str = ""
    """In ``[[slos]]``: narrow a tenant's SLO to one model; empty: every model it uses."""


def budgets_for(model: str, own: SloConfig | None, tenant_slos: Iterable[SloConfig]
                ) -> SloBudgets:
    """The admission targets of ``model``: its own SLO's and, per tenant, the tightest of
    the tenant SLOs that cover it (those with ``admission`` only)."""
    tenants: dict[str, float] = {}
    shares = [own.batch_share] if own is not None and own.admission else []
    for s in tenant_slos:
        if s.admission and s.model in ("", model):
            tenants[s.tenant] = min(s.p99_ms, tenants.get(s.tenant, s.p99_ms))
            shares.append(s.batch_share)
    return SloBudgets(own.p99_ms if own is not None and own.admission else None, tenants,
                      min(shares, default=0.0))


class TracingConfig(_Table, frozen=True):
    enabled: bool = False
    endpoint: Annotated[str, _why("must be an http:// or https:// URL",
                                  pattern=r"\Ahttps?://\S+\Z")] = \
        "http://127.0.0.1:4318/v1/traces"
    """The OTLP/HTTP (protobuf) traces endpoint of a collector."""
    sample_ratio: Ratio = 0.01
    """The share of requests traced when the client sends no sampled ``traceparent`` (a
    sampled parent is always honoured, an unsampled one never: parent-based sampling)."""
    service_name: str = "sokuji"
    headers: Mapping[str, str] = field(default_factory=dict)
    """Extra HTTP headers for the collector (e.g. an authorization token)."""
    # -- export (the SDK's BatchSpanProcessor: a thread sends batches; a full queue drops)
    export_delay_ms: MoreThanZero = 1000.0
    """At most this long between a span's end and its export (unless a batch fills)."""
    export_batch_size: AtLeast1 = 512
    """Spans per export request."""
    queue_size: AtLeast1 = 8192
    """Spans waiting for export; beyond it new spans are dropped (never the request)."""
    export_timeout_ms: MoreThanZero = 10000.0
    """One export request's timeout."""
    tenant_attribute: Literal["hash", "name", "off"] = "hash"
    """How a span names the request's tenant (``sokuji.tenant``): ``hash`` (a keyed BLAKE2b
    of the name, 16 hex digits, so traces of one tenant can be found without the collector
    learning who it is), ``name`` (as in ``[[api_keys]]``) or ``off``."""
    tenant_secret: str = ""
    """The key of the tenant hash (its first 64 bytes). Empty: a random key drawn at each
    start, so the hash is opaque but matches only within one process (not across restarts
    or replicas); set a secret to correlate a tenant's traces across them."""

    def __repr__(self) -> str:  # the collector's headers may hold a credential
        return (f"TracingConfig(enabled={self.enabled!r}, endpoint={self.endpoint!r}, "
                f"sample_ratio={self.sample_ratio!r})")

    def __rich_repr__(self) -> list[tuple[str, Any]]:  # msgspec's own would show them
        return [("enabled", self.enabled), ("endpoint", self.endpoint),
                ("sample_ratio", self.sample_ratio)]
