"""The shared response cache on a real Redis server (make test starts one)."""

from __future__ import annotations

import json
import os
import urllib.request

import pytest

from tests.integration.serving import sokuji_server

pytestmark = pytest.mark.integration
REDIS_URL = os.environ.get("SOKUJI_TEST_REDIS_URL")
needs_redis = pytest.mark.skipif(REDIS_URL is None, reason="SOKUJI_TEST_REDIS_URL not set "
                                 "(make test starts redis-server and sets it)")


def infer(url: str, text: str) -> str:
    body = json.dumps({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1],
                                   "data": [text]}]}).encode()
    req = urllib.request.Request(f"{url}/v2/models/synth/infer", data=body,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        timing = r.headers["server-timing"]
    return timing.split('cache;dur=')[1].split('desc="')[1].split('"')[0]


@needs_redis
def test_two_replicas_share_one_redis_cache() -> None:
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    client.flushdb()
    config = f"""
[cache]
backend = "redis"
redis_url = "{REDIS_URL}"
ttl_s = 60
[[models]]
name = "synth"
runtime = "synthetic"
options = {{base_ms = 1.0}}
"""
    with sokuji_server(config) as one, sokuji_server(config) as two:
        assert infer(one, "shared text") == "miss"
        assert infer(one, "shared text") == "hit"
        assert infer(two, "shared text") == "hit"  # computed by the other replica
        assert infer(two, "another text") == "miss"
    keys = client.keys("sokuji:cache:*")
    assert len(keys) == 2
    assert 0 < client.pttl(keys[0]) <= 60_000


def test_an_unreachable_redis_stops_startup_with_a_clear_message(tmp_path: object) -> None:
    import pathlib
    import subprocess
    import sys

    path = pathlib.Path(str(tmp_path)) / "r.toml"
    path.write_text('[cache]\nbackend = "redis"\nredis_url = "redis://127.0.0.1:1/0"\n'
                    '[[models]]\nname = "s"\nruntime = "synthetic"\n')
    proc = subprocess.run([sys.executable, "-m", "sokuji", "serve", "--config", str(path),
                           "--port", "0"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "cannot reach Redis" in proc.stderr and "cache.redis_url" in proc.stderr
