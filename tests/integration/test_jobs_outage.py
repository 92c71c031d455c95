"""A Redis job store that goes away: submissions and polls get 503 with a reason (never 500,
never a hang past ``jobs.redis_timeout_s``, never the store's address or password), and the
runner carries on once Redis is back. The test runs its own redis-server, to kill it."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from sokuji import config as cfg
from tests.conftest import client_for
from tests.integration.serving import free_port

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(shutil.which("redis-server") is None,
                                 reason="redis-server is not installed")]
PASSWORD = "job-store-pw-0451"
INFER = "/v2/models/synth/infer"
BODY = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["abc"]}]}
ASYNC = {"prefer": "respond-async"}


@contextmanager
def redis_server(port: int) -> Iterator[subprocess.Popen[bytes]]:
    import redis

    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no", "--requirepass", PASSWORD],
                            stdout=subprocess.DEVNULL)
    client = redis.Redis(port=port, password=PASSWORD, socket_connect_timeout=1)
    deadline = time.monotonic() + 30
    try:
        while True:  # polling a child process's start-up
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.05)
        yield proc
    finally:
        client.close()
        proc.kill()
        proc.wait(timeout=10)


def assert_unavailable(r: Any, port: int) -> None:
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    error = r.json()["error"]
    assert "job store is unavailable" in error
    assert str(port) not in error and PASSWORD not in error and "127.0.0.1" not in error


def test_a_redis_outage_is_a_503_and_the_runner_waits_it_out() -> None:
    port = free_port()
    jobs = cfg.JobsConfig(backend="redis", redis_url=f"redis://:{PASSWORD}@127.0.0.1:{port}/0",
                          redis_timeout_s=0.5)
    model = cfg.ModelConfig(name="synth", runtime="synthetic", options={"base_ms": 1.0})
    config = cfg.validate(cfg.ServerConfig(models=(model,), jobs=jobs,
                                           cache_dir=tempfile.mkdtemp()))
    with redis_server(port) as proc, client_for(config) as client:
        r = client.post(INFER, json=BODY, headers=ASYNC)
        assert r.status_code == 202
        location = r.headers["location"]
        proc.kill()
        proc.wait(timeout=10)
        # Refused connections: at once.
        assert_unavailable(client.post(INFER, json=BODY, headers=ASYNC), port)
        assert_unavailable(client.get(location), port)
        # A Redis that accepts and never answers (a partition): bounded by redis_timeout_s.
        with socket.socket() as hole:
            hole.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past TIME_WAIT
            hole.bind(("127.0.0.1", port))
            hole.listen(64)
            assert_unavailable(client.post(INFER, json=BODY, headers=ASYNC), port)
        with redis_server(port):
            r = client.post(INFER, json=BODY, headers=ASYNC)
            assert r.status_code == 202  # a fresh connection, after the broken ones
            deadline = time.monotonic() + 30
            while client.get(r.headers["location"]).json()["status"] != "done":
                assert time.monotonic() < deadline  # the runner found it again
