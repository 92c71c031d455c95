"""The shared response cache on a real Redis server (make test starts one), and what happens
when that Redis stops answering: the tests below start their own redis-server to stop it."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from tests.integration.serving import free_port, sokuji_server

pytestmark = pytest.mark.integration
REDIS_URL = os.environ.get("SOKUJI_TEST_REDIS_URL")
needs_redis = pytest.mark.skipif(REDIS_URL is None, reason="SOKUJI_TEST_REDIS_URL not set "
                                 "(make test starts redis-server and sets it)")


def infer(url: str, text: str) -> str:
    """The cache's verdict on one request (``desc`` of its ``cache`` stage); any status but
    200 raises (urllib's HTTPError)."""
    body = json.dumps({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1],
                                   "data": [text]}]}).encode()
    req = urllib.request.Request(f"{url}/v2/models/synth/infer", data=body,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200
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
    import sys

    path = pathlib.Path(str(tmp_path)) / "r.toml"
    path.write_text('[cache]\nbackend = "redis"\n'
                    'redis_url = "redis://sokuji:s3cret-pw@127.0.0.1:1/0"\n'
                    '[[models]]\nname = "s"\nruntime = "synthetic"\n')
    proc = subprocess.run([sys.executable, "-m", "sokuji", "serve", "--config", str(path),
                           "--port", "0"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "cannot reach Redis" in proc.stderr and "cache.redis_url" in proc.stderr
    assert "redis://sokuji:***@127.0.0.1:1/0" in proc.stderr
    assert "s3cret-pw" not in proc.stderr + proc.stdout


# --- outages: a real redis-server behind a proxy that can go silent --------------------------

needs_redis_server = pytest.mark.skipif(shutil.which("redis-server") is None,
                                        reason="redis-server is not installed")


class RedisProcess:
    """A redis-server of our own, to stop and start again on the same port."""

    def __init__(self) -> None:
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        import redis

        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no"], stdout=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=1)
        deadline = time.monotonic() + 30
        while True:  # polling a child process's start-up
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise
                time.sleep(0.05)
            finally:
                client.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


class Proxy:
    """TCP proxy to ``upstream_port`` in its own thread. ``silent = True`` makes it a network
    partition: it accepts and reads, and nothing comes back."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.silent = False
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._handle, "127.0.0.1", 0), self.loop).result(10)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_writer = None
        try:
            if not self.silent:
                up_reader, up_writer = await asyncio.open_connection("127.0.0.1",
                                                                     self.upstream_port)

            async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter | None) -> None:
                while data := await src.read(65536):
                    if dst is not None and not self.silent:  # silent: swallowed
                        dst.write(data)
                        await dst.drain()

            if up_writer is None:
                await pump(reader, None)
            else:
                await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))
        except OSError:
            pass  # upstream refused or reset: close the client's side too
        finally:
            for w in (writer, up_writer):
                if w is not None:
                    w.close()

    def close(self) -> None:
        async def shutdown() -> None:
            self.server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@contextmanager
def redis_behind_proxy() -> Iterator[tuple[RedisProcess, Proxy]]:
    redis_proc = RedisProcess()
    redis_proc.start()
    proxy = Proxy(redis_proc.port)
    try:
        yield redis_proc, proxy
    finally:
        proxy.close()
        redis_proc.stop()


def cache_errors(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("sokuji_cache_errors_total{"):
            op = line.split('op="')[1].split('"')[0]
            out[op] = float(line.rsplit(" ", 1)[1])
    return out


# The breaker's settings for these tests: a short cooldown, so that waiting one out (time by
# design) costs a fraction of a second, not the default 5 s.
BREAKER_FAILURES, BREAKER_COOLDOWN_S = 3, 0.5
POLL_S = BREAKER_COOLDOWN_S / 10


def misses_until(url: str, done: Callable[[], bool], what: str) -> int:
    """Send requests (each must be a 200 computed afresh: a miss) until ``done()``; bounded
    in time. Waits out the cache's breaker cooldown, which is time by design."""
    deadline = time.monotonic() + 60
    sent = 0
    while not done():
        assert time.monotonic() < deadline, what
        assert infer(url, f"poll {sent}") == "miss"
        sent += 1
        time.sleep(POLL_S)
    return sent


@needs_redis_server
def test_a_redis_outage_turns_lookups_into_misses_not_errors() -> None:
    with redis_behind_proxy() as (redis_proc, proxy):
        config = f"""
[cache]
backend = "redis"
redis_url = "redis://127.0.0.1:{proxy.port}/0"
redis_timeout_s = 0.2
breaker_failures = {BREAKER_FAILURES}
breaker_cooldown_s = {BREAKER_COOLDOWN_S}
[[models]]
name = "synth"
runtime = "synthetic"
options = {{base_ms = 1.0}}
"""
        with sokuji_server(config) as url:
            assert infer(url, "before") == "miss"
            assert infer(url, "before") == "hit"
            assert cache_errors(url) == {"get": 0.0, "set": 0.0}

            redis_proc.stop()  # Redis gone: connections refused or reset
            t0 = time.monotonic()
            assert [infer(url, "down") for _ in range(8)] == ["miss"] * 8  # 200s, computed
            down_s = time.monotonic() - t0
            down = cache_errors(url)
            assert down["get"] >= 1 and down["set"] >= 1
            # Failing calls stop after a few: BREAKER_FAILURES in a row open the breaker,
            # which then skips Redis for its cooldown; after each cooldown one call tries
            # again and its failure reopens it. So however long these 8 requests took on
            # this machine, at most this many of their 16 calls failed (without a breaker:
            # all 16).
            assert down["get"] + down["set"] <= BREAKER_FAILURES + down_s / BREAKER_COOLDOWN_S \
                + 1, (down, down_s)

            redis_proc.start()
            proxy.silent = True  # now it hangs: the next try runs into the timeout
            misses_until(url, lambda: sum(cache_errors(url).values()) > sum(down.values()),
                         "the breaker never tried Redis again")

            proxy.silent = False  # healthy again (and empty): hits once the breaker closes
            deadline = time.monotonic() + 60
            while True:  # bounded poll: the breaker's cooldown is time by design
                assert infer(url, "after") in ("miss", "hit")
                if infer(url, "after") == "hit":
                    break
                assert time.monotonic() < deadline, "the cache never came back"
                time.sleep(POLL_S)


@needs_redis_server
def test_a_redis_that_hangs_at_start_up_stops_it_within_the_timeout(tmp_path: object) -> None:
    import pathlib
    import sys

    with redis_behind_proxy() as (_, proxy):
        proxy.silent = True
        path = pathlib.Path(str(tmp_path)) / "r.toml"
        path.write_text(f'[cache]\nbackend = "redis"\n'
                        f'redis_url = "redis://:pw-in-url@127.0.0.1:{proxy.port}/0"\n'
                        '[[models]]\nname = "s"\nruntime = "synthetic"\n')
        proc = subprocess.run([sys.executable, "-m", "sokuji", "serve", "--config", str(path),
                               "--port", "0"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "cannot reach Redis" in proc.stderr and "TimeoutError" in proc.stderr
    assert "pw-in-url" not in proc.stderr + proc.stdout
