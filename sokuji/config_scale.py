"""The scale-out side of the config: ``[ray]``, read only by ``sokuji serve --ray``.

One Ray Serve replica is one whole Sokuji (its HTTP app, batchers, LLM engines): Ray adds
replicas, placement, restarts and autoscaling around it (``sokuji/scale/``). With
``fast_path`` (the default) Ray's high-throughput mode is on: HAProxy on the HTTP port
forwards each request straight to a replica's own HTTP server, so no Python proxy sits in
the request path. Generators may instead live in deployments of their own, reached from the
replicas through handles that route a conversation to the replica holding its prefix.
"""

from __future__ import annotations

from typing import Annotated

from sokuji.config_types import AtLeast1, MoreThanZero, _Table, _why

ZeroOrMore = Annotated[float, _why("must be >= 0", ge=0.0)]


class RayConfig(_Table, frozen=True):
    address: str = ""
    """The Ray cluster: empty starts a local one for this command (and stops it on exit);
    ``auto`` or ``host:port`` joins an existing one (the command then deploys and, on exit,
    deletes only its own application)."""
    app_name: Annotated[str, _why("must be letters, digits, '-' or '_'",
                                  pattern=r"\A[A-Za-z0-9_-]{1,64}\Z")] = "sokuji"
    """The Serve application's name (one Sokuji per cluster route prefix ``/``)."""
    replicas: AtLeast1 = 1
    """Replicas at start (``initial_replicas`` when autoscaling)."""
    max_replicas: Annotated[int, _why("must be >= 0", ge=0)] = 0
    """Above ``replicas``: autoscale between ``min_replicas`` and this on Sokuji's own queue
    depth; 0: a fixed ``replicas``."""
    min_replicas: AtLeast1 = 1
    target_queue_per_replica: MoreThanZero = 8.0
    """Autoscaling target: requests waiting in Sokuji's queues per replica (summed over the
    replicas and averaged over ``look_back_s``)."""
    look_back_s: MoreThanZero = 10.0
    upscale_delay_s: ZeroOrMore = 5.0
    downscale_delay_s: ZeroOrMore = 60.0
    num_cpus: ZeroOrMore = 1.0
    """CPUs Ray reserves per replica (0: pack replicas regardless of cores)."""
    http_host: str = ""
    """Where Serve's HTTP port listens (HAProxy in the fast path); empty: ``host``."""
    http_port: Annotated[int, _why("must be between 0 and 65535", ge=0, le=65535)] = 0
    """0: ``port``."""
    fast_path: bool = True
    """Ray's high-throughput mode (HAProxy + direct ingress); only settable for a cluster
    this command starts (an existing cluster's mode is reported, not changed)."""
    retry_lost: bool = True
    """In the fast path, HAProxy resends a request whose replica closed the connection
    without answering (it died), and always one that could not connect. With Ray 2.60 this
    saves some, not all, of the requests a killed replica held (``benchmarks/ray_faults.py``,
    2026-12-03: 0-3 lost per kill against 4-5 without it): clients should retry idempotent
    requests on a dropped connection. A stream that started is lost."""
    max_ongoing_requests: AtLeast1 = 4096
    """Serve's per-replica limit, kept above Sokuji's own admission so that the 429 a
    client sees is Sokuji's (with its drain-rate ``Retry-After``), not Serve's."""
    health_check_period_s: MoreThanZero = 2.0
    health_check_timeout_s: MoreThanZero = 10.0
    graceful_shutdown_timeout_s: ZeroOrMore = 5.0
    draining_period_s: ZeroOrMore = 2.0
    """How long a stopping replica keeps answering so that HAProxy notices it is gone."""
    llm_affinity: bool = True
    """Serve generators from deployments of their own (``llm_replicas`` each) behind a
    consistent-hash router keyed by conversation, so a conversation's later turns find its
    prompt prefix cached; false: each replica runs its own generators."""
    llm_replicas: AtLeast1 = 1
    llm_max_ongoing_requests: AtLeast1 = 64
    """Per LLM replica; a full replica's conversations spill to the next on the ring."""
    metrics_push_s: MoreThanZero = 5.0
    """How often each replica sends its metrics to the application's hub, so that
    ``/metrics`` (whichever replica answers it) covers every replica."""
    temp_dir: str = ""
    """A local cluster's session directory (Ray's default when empty)."""
