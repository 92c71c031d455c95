"""``sokuji serve --ray``: deploy the configured Sokuji on Ray Serve and keep it up.

1. Checks what several replicas must share (``ray_env.check_shared_state``: the job store
   must be Redis; a memory cache is per replica, a warning).
2. Starts a local cluster in Ray's high-throughput mode (``ray_env.cluster_env``), or joins
   the one at ``[ray] address`` / ``--ray-address`` and asks it which mode it runs.
3. Starts Serve's HTTP entry on ``host:port`` (HAProxy in the fast path), deploys the
   generators' affinity tier (``ray_llm.py``) and the ingress replicas (``ray_app.py``),
   waits until a request through that port is answered ready, and says so on stdout.
4. On SIGINT / SIGTERM: deletes its application (a joined cluster keeps running) or shuts
   the local cluster down.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import threading
import time
from typing import Any

from sokuji import http_client
from sokuji.config import ServerConfig
from sokuji.errors import ConfigError
from sokuji.kinds.generator.kind import generators
from sokuji.scale import ray_env

log = logging.getLogger("sokuji.ray")
READY_TIMEOUT_S = 300.0


def _ready(url: str, timeout_s: float) -> None:
    """Poll ``url`` until it answers 200 (HAProxy learns the replicas a moment after
    Serve reports them running)."""
    until = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < until:
        try:
            status = http_client.request("GET", url, timeout_s=5, max_bytes=4096).status
        except http_client.Unreachable as exc:
            last = str(exc)
        else:
            if status == 200:
                return
            last = f"HTTP {status}"
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready after {timeout_s:.0f} s ({last})")


def _check_port(host: str, port: int) -> None:
    """Refuse a port something listens on. ``SO_REUSEADDR``, as the listener Serve starts
    (and uvicorn) sets it: the TIME_WAIT sockets a server that just stopped leaves for a
    minute do not stop it listening, so they must not fail this probe either."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from None


def _connect(config: ServerConfig, address: str) -> tuple[bool, str]:
    """ray.init: a local cluster (returns True and the HAProxy directory made for it) or
    the existing one at ``address``."""
    import ray

    rc = config.ray
    if address:
        ray.init(address=address, log_to_driver=False)
        return False, ""
    env = ray_env.cluster_env(rc)
    os.environ.update(env)  # the cluster's processes inherit it (read at their import)
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
    if rc.temp_dir:
        kwargs["_temp_dir"] = rc.temp_dir
    ray.init(**kwargs)
    return True, env.get("RAY_SERVE_HAPROXY_SERVER_STATE_BASE", "")


def serve_on_ray(config: ServerConfig, address: str | None = None) -> int:
    from ray import serve

    from sokuji.scale.ray_app import application

    rc = config.ray
    for line in ray_env.check_shared_state(config):
        kind, _, message = line.partition(": ")
        if kind == "error":
            raise ConfigError(message)
        log.warning("%s", message)
    address = rc.address if address is None else address
    host = rc.http_host or config.host
    port = rc.http_port or config.port
    if not address:
        _check_port(host, port)  # before minutes of cluster start; HAProxy would only crash
    local, haproxy_dir = _connect(config, address)
    try:
        mode = ray_env.cluster_mode()
        if not mode["fast_path"]:
            log.warning("the cluster runs without Ray Serve's high-throughput mode: requests "
                        "go through Serve's Python proxy (+7-12 ms a request measured); "
                        "start it with RAY_SERVE_THROUGHPUT_OPTIMIZED=1 and "
                        "RAY_SERVE_ENABLE_HA_PROXY=1 in its environment")
        serve.start(http_options={"host": host, "port": port})
        llm: dict[str, Any] = {}
        if rc.llm_affinity and generators(config):
            from sokuji.scale.ray_llm import llm_deployments

            llm = llm_deployments(config, ray_env.config_builtins(config))
        t0 = time.monotonic()
        serve.run(application(config, llm), name=rc.app_name, route_prefix="/",
                  blocking=False)
        shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        base = f"http://{shown}:{port}"
        _ready(f"{base}/v2/health/ready", READY_TIMEOUT_S)
        print(json.dumps({"sokuji": "serving on ray", "url": base, "app": rc.app_name,
                          "fast_path": mode["fast_path"], "local_cluster": local,
                          "replicas": rc.replicas, "max_replicas": max(rc.max_replicas,
                                                                       rc.replicas),
                          "llm_affinity": bool(llm), "deploy_s": round(
                              time.monotonic() - t0, 2)}), flush=True)
        _wait_for_signal()
        log.info("stopping: deleting application %s", rc.app_name)
        serve.delete(rc.app_name)
        return 0
    finally:
        _disconnect(local, haproxy_dir)


def _wait_for_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass


def _disconnect(local: bool, haproxy_dir: str) -> None:
    import ray
    from ray import serve

    try:
        if local:
            serve.shutdown()
    finally:
        ray.shutdown()
        if haproxy_dir and os.path.isdir(haproxy_dir):
            shutil.rmtree(haproxy_dir, ignore_errors=True)
