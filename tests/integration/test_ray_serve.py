"""``sokuji serve --ray``: the real command on a real Ray cluster (``ray_cluster.py``).

Through Serve's HTTP port (HAProxy in the fast path) the replicas must answer exactly as
single-process Sokuji does: the same bodies and errors, Sokuji's own admission (429 with its
``Retry-After``, not Serve's backpressure text), a Redis cache shared by the replicas, the
official clients unchanged. The command refuses configs the replicas could not share.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from sokuji import config as cfg
from sokuji.cli import main
from tests.conftest import CACHE_DIR, client_for
from tests.integration.ray_cluster import (
    SOKUJI_BIN,
    RayHead,
    _started,
    ray_env,
    sokuji_ray,
)

pytest.importorskip("ray.serve", reason="the ray extra is not installed")
REDIS_URL = os.environ.get("SOKUJI_TEST_REDIS_URL")
KEY = "ray-test-key-one"


def post(url: str, path: str, body: bytes, key: str | None = KEY,
         ) -> tuple[int, dict[str, str], bytes]:
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url + path, data=body, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


def v2(*texts: str) -> bytes:
    return json.dumps({"inputs": [{"name": "text", "datatype": "BYTES",
                                   "shape": [len(texts)], "data": list(texts)}]}).encode()


MINILM = f"""
cache_dir = "{CACHE_DIR}"
metrics_require_key = false  # (scraped without a key below)
[[api_keys]]
key = "{KEY}"
tenant = "one"
[jobs]
enabled = false
[cache]
backend = "redis"
redis_url = "{REDIS_URL}"
ttl_s = 60
[[models]]
name = "minilm"
intra_op_threads = 1
[ray]
replicas = 2
num_cpus = 0
metrics_push_s = 0.5
"""


@pytest.mark.skipif(REDIS_URL is None, reason="SOKUJI_TEST_REDIS_URL not set (make redis)")
def test_replicas_answer_as_one_sokuji_and_share_the_redis_cache(ray_head: RayHead) -> None:
    import openai
    import redis

    redis.Redis.from_url(REDIS_URL).flushdb()
    config = cfg.validate(cfg.load(_file(MINILM)))
    with sokuji_ray(ray_head, MINILM) as serving, client_for(config) as single:
        url = serving.url
        assert serving.started["fast_path"] is True  # HAProxy straight to the replicas
        assert len(ray_head.our_pids("ray::ServeReplica:sokuji:Sokuji")) == 2
        # The same body as single-process Sokuji (identical model, identical codec).
        status, headers, body = post(url, "/v2/models/minilm/infer", v2("ray serve", "two"))
        assert status == 200, body
        want = single.post("/v2/models/minilm/infer", content=v2("ray serve", "two"),
                           headers={"authorization": f"Bearer {KEY}"}).json()
        got = json.loads(body)
        assert got["model_name"] == want["model_name"] and \
            got["outputs"][0]["shape"] == want["outputs"][0]["shape"]
        np.testing.assert_allclose(got["outputs"][0]["data"], want["outputs"][0]["data"],
                                   atol=1e-5)
        assert "total;dur=" in headers["server-timing"] and headers["x-sokuji-replica"]
        # Requests spread over both replicas; a text one replica computed is a hit on the
        # other (one Redis behind both).
        verdicts: dict[str, list[str]] = {}
        for _ in range(12):
            status, headers, body = post(url, "/v2/models/minilm/infer", v2("shared text"))
            assert status == 200, body
            timing = headers["server-timing"]
            verdict = timing.split('cache;dur=')[1].split('desc="')[1].split('"')[0]
            verdicts.setdefault(headers["x-sokuji-replica"], []).append(verdict)
        assert len(verdicts) == 2, verdicts
        assert sorted(v for vs in verdicts.values() for v in vs) == ["hit"] * 11 + ["miss"]
        # Errors are Sokuji's, with the same bodies.
        for path, payload, key, code in [
                ("/v2/models/minilm/infer", v2("x"), None, 401),
                ("/v2/models/minilm/infer", b"{not json", KEY, 400),
                ("/v2/models/nope/infer", v2("x"), KEY, 404),
                ("/v2/models/minilm/infer", b"x" * (5 * 1024 * 1024), KEY, 413)]:
            status, _, body = post(url, path, payload, key)
            headers_single = {"authorization": f"Bearer {key}"} if key else {}
            mine = single.post(path, content=payload, headers=headers_single)
            assert (status, body) == (code, mine.content) == (mine.status_code, body)
        # One /metrics for the deployment, whichever replica answers: both replicas'
        # series, labelled; ?scope=replica: the answering replica's own.
        deadline = time.monotonic() + 30
        while True:
            replicas = _metric_replicas(url, "")
            if len(replicas) == 2 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert replicas == set(verdicts), replicas
        assert _metric_replicas(url, "?scope=replica") == set()
        status, _, body = _get(url + "/metrics?scope=everything")
        assert status == 400 and b"scope must be" in body
        # The official OpenAI client, unchanged.
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        emb = client.embeddings.create(model="minilm", input=["ray serve"])
        np.testing.assert_allclose(emb.data[0].embedding, want["outputs"][0]["data"][:384],
                                   atol=1e-5)


SLOW = """
[jobs]
enabled = false
[cache]
enabled = false
[[models]]
name = "slow"
runtime = "synthetic"
max_batch_size = 1
max_queue_depth = 1
options = { base_ms = 400 }
[ray]
replicas = 1
num_cpus = 0
"""


def check_overload_gets_sokujis_429(url: str) -> None:
    """Concurrent requests past the queue bound: Sokuji's own 429 (its reason, its
    Retry-After) at once, not Serve's backpressure text; nothing lost, no 5xx."""
    def one(_: int) -> tuple[int, dict[str, str], bytes, float]:
        t0 = time.monotonic()
        status, headers, body = post(url, "/v2/models/slow/infer", v2("x"), None)
        return status, headers, body, time.monotonic() - t0

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    statuses = sorted(r[0] for r in results)
    assert statuses.count(200) >= 2 and statuses.count(429) >= 4, statuses
    assert set(statuses) <= {200, 429}, statuses
    served = min(r[3] for r in results if r[0] == 200)
    for status, headers, body, took in results:
        if status == 429:
            assert "max_queue_depth 1" in json.loads(body)["error"]  # Sokuji's own words
            assert int(headers["retry-after"]) >= 1
            assert took < served  # refused at once, not after a model call


def _get(url: str) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def _metric_replicas(url: str, query: str) -> set[str]:
    """The replica labels on sokuji_requests_total samples of one scrape."""
    from prometheus_client.parser import text_string_to_metric_families

    status, _, body = _get(f"{url}/metrics{query}")
    assert status == 200, body
    return {s.labels["replica"] for f in text_string_to_metric_families(body.decode())
            if f.name == "sokuji_requests" for s in f.samples if "replica" in s.labels}


def _file(text: str) -> str:
    fd, path = tempfile.mkstemp(suffix=".toml")
    os.write(fd, text.encode())
    os.close(fd)
    return path


def test_refuses_what_replicas_could_not_share(capsys: pytest.CaptureFixture[str]) -> None:
    path = _file("[[models]]\nname = \"s\"\nruntime = \"synthetic\"\n[ray]\nreplicas = 2\n")
    assert main(["serve", "--ray", "--config", path]) == 2  # jobs in SQLite, per replica
    assert 'jobs.backend must be "redis"' in capsys.readouterr().err
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        path = _file("[jobs]\nenabled = false\n[[models]]\nname = \"s\"\n"
                     "runtime = \"synthetic\"\n")
        assert main(["serve", "--ray", "--config", path, "--port", str(port)]) == 2
        assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
    assert main(["serve", "--ray", "--replicas", "0", "--config", path]) == 2


def test_starts_and_stops_its_own_local_cluster() -> None:
    """Without an address the command starts a cluster in the fast path, serves (overload
    included: Sokuji's 429), and on SIGTERM leaves nothing behind: no process, no HAProxy
    directory."""
    base = Path(tempfile.mkdtemp(prefix="skl", dir="/tmp"))
    env = {**os.environ, **ray_env(base)}
    for var in [k for k in env if k.startswith("RAY_SERVE_HAPROXY_") or
                k in ("RAY_SERVE_THROUGHPUT_OPTIMIZED", "RAY_SERVE_ENABLE_HA_PROXY")]:
        del env[var]  # the command sets them itself
    port = socket.socket()
    port.bind(("127.0.0.1", 0))
    number = port.getsockname()[1]
    port.close()
    config = base / "c.toml"
    config.write_text(SLOW + f'temp_dir = "{base / "rt"}"\n')
    log = base / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([str(SOKUJI_BIN), "serve", "--ray", "--config", str(config),
                                 "--port", str(number)], env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        started = _started(proc, log, 180)
        assert started["local_cluster"] is True and started["fast_path"] is True
        check_overload_gets_sokujis_429(f"http://127.0.0.1:{number}")
        ours = RayHead("", {}, 0, base).our_pids("")
        assert ours  # the cluster's processes carry its directory in their environment
        haproxy = _haproxy_dirs(ours)
        assert haproxy and all(d.startswith("/tmp/sokuji-h") for d in haproxy)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0, log.read_text()[-2000:]
    # Its processes are gone within a second of the command's exit (polled, not slept).
    deadline = time.monotonic() + 1
    while (RayHead("", {}, 0, base).our_pids("") or any(os.path.exists(d) for d in haproxy)
           ) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert RayHead("", {}, 0, base).our_pids("") == []
    assert not any(os.path.exists(d) for d in haproxy)


def _haproxy_dirs(pids: list[int]) -> set[str]:
    out = set()
    for pid in pids:
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for entry in environ:
            if entry.startswith(b"RAY_SERVE_HAPROXY_SERVER_STATE_BASE="):
                out.add(entry.split(b"=", 1)[1].decode())
    return out
