"""What a Ray cluster needs around Sokuji: the environment, the config's trip, start / attach.

Ray Serve's fast path ("high-throughput mode": ``RAY_SERVE_THROUGHPUT_OPTIMIZED=1`` and
``RAY_SERVE_ENABLE_HA_PROXY=1``) is read by the cluster's processes when they import Serve,
so it can only be chosen for a cluster this command starts: the variables go into our own
environment before ``ray.init`` starts the cluster's processes, which inherit it. For an
existing cluster the mode is asked of the cluster (``cluster_mode``) and reported.

HAProxy keeps five files under ``/tmp/haproxy-serve`` and listens on two fixed ports (stats
8404, metrics 9101) unless told otherwise; two clusters on one machine would share them, so
a local cluster gets its own short directory (HAProxy refuses an admin socket path over 97
characters, and Ray appends a 56-character directory) and free ports. Values already in the
environment win: an operator's setting is never overridden.
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from sokuji import config as cfg
from sokuji.config import ServerConfig
from sokuji.config_scale import RayConfig

FAST_PATH = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1"}
HAPROXY_FILES = {
    "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": "haproxy.cfg",
    "RAY_SERVE_HAPROXY_SOCKET_PATH": "admin.sock",
    "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": "",
    "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": "server-state",
    "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": "metrics.sock",
}
HAPROXY_PORTS = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT")
MAX_HAPROXY_BASE = 36
"""Characters of the HAProxy directory's path at most (97 - Ray's 56 - '/admin.sock')."""


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free now (all held open while choosing, so none repeats)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def cluster_env(rc: RayConfig, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables a local cluster for ``rc`` starts with (those already in ``environ``,
    default ``os.environ``, are left out: they win)."""
    environ = os.environ if environ is None else environ
    env: dict[str, str] = {"RAY_USAGE_STATS_ENABLED": "0"}
    if rc.fast_path:
        env.update(FAST_PATH)
        base = Path(tempfile.mkdtemp(prefix="sokuji-h", dir="/tmp"))
        if len(str(base)) > MAX_HAPROXY_BASE:  # a long TMPDIR is not used: see above
            base.rmdir()
            base = Path(tempfile.mkdtemp(prefix="skh", dir="/tmp"))
        for var, name in HAPROXY_FILES.items():
            env[var] = str(base / name) if name else str(base)
        for var, port in zip(HAPROXY_PORTS, free_ports(len(HAPROXY_PORTS)), strict=True):
            env[var] = str(port)
        env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] = str(rc.draining_period_s)
        if rc.retry_lost:
            # A replica that died with the request: HAProxy resends it to another one
            # (inference is idempotent); connection failures are retried anyway.
            env["RAY_SERVE_HAPROXY_RETRY_ON"] = "conn-failure empty-response"
            env["RAY_SERVE_HAPROXY_RETRIES"] = "2"
    return {k: v for k, v in env.items() if k not in environ}


def haproxy_dir(environ: Mapping[str, str] | None = None) -> str:
    environ = os.environ if environ is None else environ
    return environ.get("RAY_SERVE_HAPROXY_SERVER_STATE_BASE", "")


def config_builtins(config: ServerConfig) -> dict[str, Any]:
    """The config as plain data, for a replica (pickled by Ray; no file needed there)."""
    out: dict[str, Any] = msgspec.to_builtins(config)
    return out


def config_from_builtins(data: Mapping[str, Any]) -> ServerConfig:
    """A replica's config, validated as the command's was (``config.validate``)."""
    return cfg.validate(msgspec.convert(dict(data), ServerConfig, strict=False))


def cluster_mode() -> dict[str, Any]:
    """The cluster's Serve mode, asked of a worker process (it has the cluster's
    environment, which a driver attaching to an existing cluster does not)."""
    import ray

    @ray.remote(num_cpus=0)
    def _probe() -> dict[str, Any]:
        keys = (*FAST_PATH, "RAY_SERVE_HAPROXY_RETRY_ON")
        return {k: os.environ.get(k, "") for k in keys}

    flags: dict[str, Any] = ray.get(_probe.remote(), timeout=60)
    flags["fast_path"] = all(flags.get(k) == v for k, v in FAST_PATH.items())
    return flags


def check_shared_state(config: ServerConfig) -> list[str]:
    """What several replicas would not share, as errors (first) or warnings.

    Jobs in a replica's SQLite file would be invisible to the others (a poll landing on
    another replica: 404; a dead replica's jobs lost), so several replicas need the Redis
    job store. A memory cache is merely per replica (correct, less effective): a warning.
    Returns ``["error: ...", "warning: ..."]``."""
    rc = config.ray
    several = rc.replicas > 1 or rc.max_replicas > 1
    out = []
    if several and config.jobs.enabled and config.jobs.backend != "redis":
        out.append("error: jobs.backend must be \"redis\" with more than one replica (a "
                   "replica's SQLite jobs are invisible to the others); or jobs.enabled = "
                   "false")
    if several and config.cache.enabled and config.cache.backend != "redis":
        out.append("warning: cache.backend is \"memory\": each replica caches only what it "
                   "served; set cache.backend = \"redis\" to share the cache")
    return out
