"""The response cache when its backend fails: misses, never errors; counted, logged sparingly,
and skipped for a while after repeated failures. Real sockets for the Redis client's part."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import numpy as np
import pytest

from sokuji.core.cache import (
    WARN_INTERVAL_S,
    BackendUnavailable,
    Breaker,
    CacheResult,
    Entry,
    ResponseCache,
)
from sokuji.stores.cache_memory import MemoryBackend
from sokuji.stores.cache_redis import RedisBackend
from tests.integration.serving import free_port


def entry() -> Entry:
    return Entry(np.ones((1, 4), dtype=np.float32), 4)


class FlakyBackend(MemoryBackend):
    """A memory backend that raises ``BackendUnavailable`` while ``down``; counts calls."""

    def __init__(self) -> None:
        super().__init__(1 << 20, 60)
        self.down = False
        self.calls = 0

    async def get(self, key: str) -> Entry | None:
        self.calls += 1
        if self.down:
            raise BackendUnavailable("Redis GET: ConnectionError: refused")
        return await super().get(key)

    async def set(self, key: str, entry: Entry) -> None:
        self.calls += 1
        if self.down:
            raise BackendUnavailable("Redis SET: TimeoutError: no answer within 100 ms")
        await super().set(key, entry)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_cache(backend: FlakyBackend, clock: Clock, errors: list[str],
               results: list[str] | None = None) -> ResponseCache:
    return ResponseCache(backend, on_error=errors.append, clock=clock,
                         on_result=None if results is None else
                         (lambda _m, r: results.append(r)),
                         breaker=Breaker(threshold=3, cooldown_s=5.0, clock=clock))


async def compute() -> Entry:
    return entry()


async def test_a_failing_backend_gives_misses_and_counts_each_failure() -> None:
    backend, errors, results = FlakyBackend(), [], []
    cache = make_cache(backend, Clock(), errors, results)
    backend.down = True
    got, result = await cache.get_or_compute("m", "k", compute)
    assert result is CacheResult.MISS and got.num_tokens == 4
    assert errors == ["get", "set"]  # the lookup failed, and so did storing the result
    assert results == ["miss"]
    backend.down = False
    assert (await cache.get_or_compute("m", "k", compute))[1] is CacheResult.MISS  # not stored
    assert (await cache.get_or_compute("m", "k", compute))[1] is CacheResult.HIT


async def test_identical_requests_still_coalesce_while_the_backend_is_down() -> None:
    backend, errors = FlakyBackend(), []
    cache = make_cache(backend, Clock(), errors)
    backend.down = True
    gate, calls = asyncio.Event(), []

    async def slow() -> Entry:
        calls.append(1)
        await gate.wait()
        return entry()

    tasks = [asyncio.create_task(cache.get_or_compute("m", "k", slow)) for _ in range(4)]
    await asyncio.sleep(0)
    gate.set()
    results = sorted(r for _, r in await asyncio.gather(*tasks))
    assert len(calls) == 1
    assert results == sorted([CacheResult.MISS] + [CacheResult.COALESCED] * 3)


async def test_the_breaker_skips_a_failing_backend_then_tries_again() -> None:
    backend, errors, clock = FlakyBackend(), [], Clock()
    cache = make_cache(backend, clock, errors)
    backend.down = True
    await cache.get_or_compute("m", "a", compute)  # get + set fail: 2 failures
    await cache.get_or_compute("m", "b", compute)  # get fails: 3rd, the breaker opens
    assert backend.calls == 3 and not cache.breaker.allow()
    for i in range(20):  # skipped: no timeout paid, no error counted
        assert (await cache.get_or_compute("m", f"x{i}", compute))[1] is CacheResult.MISS
    assert backend.calls == 3 and len(errors) == 3
    clock.now += 5.0  # cooldown over: the next call tries; one more failure re-opens
    await cache.get_or_compute("m", "c", compute)
    assert backend.calls == 4 and not cache.breaker.allow()
    clock.now += 5.0
    backend.down = False  # the backend is back: success closes the breaker
    assert (await cache.get_or_compute("m", "d", compute))[1] is CacheResult.MISS
    assert (await cache.get_or_compute("m", "d", compute))[1] is CacheResult.HIT
    assert cache.breaker.failures == 0 and cache.breaker.allow()


async def test_failures_are_logged_at_most_once_per_interval_with_a_count(
        caplog: pytest.LogCaptureFixture) -> None:
    backend, errors, clock = FlakyBackend(), [], Clock()
    cache = ResponseCache(backend, on_error=errors.append, clock=clock,
                          breaker=Breaker(threshold=10**9, clock=clock))  # never opens
    backend.down = True
    with caplog.at_level(logging.WARNING, logger="sokuji.core.cache"):
        for i in range(50):
            await cache.get_or_compute("m", f"k{i}", compute)
            clock.now += 0.01
        assert len(caplog.records) == 1
        assert "serving misses" in caplog.records[0].getMessage()
        clock.now += WARN_INTERVAL_S
        await cache.get_or_compute("m", "late", compute)
    assert len(errors) == 102
    assert len(caplog.records) == 2
    assert "(100 cache error(s) since the last warning)" in caplog.records[1].getMessage()


# --- the Redis client's part: real sockets, no Redis needed --------------------------------

@pytest.fixture
async def silent_listener() -> AsyncIterator[tuple[int, list[int]]]:
    """A TCP listener that accepts and never answers (a hung Redis, a partition)."""
    accepted: list[int] = []
    held: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        held.append(writer)
        while await reader.read(4096):
            pass

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    yield port, accepted
    for w in held:
        w.close()
    server.close()


async def test_a_redis_that_never_answers_is_a_timeout_not_a_hang(
        silent_listener: tuple[int, list[int]]) -> None:
    port, accepted = silent_listener
    backend = RedisBackend(f"redis://:pw@127.0.0.1:{port}/0", ttl_s=60, timeout_s=0.05)
    errors: list[str] = []
    cache = ResponseCache(backend, on_error=errors.append)
    try:
        # The outer bound only catches a hang (no timeout at all); the inner one is 50 ms.
        got, result = await asyncio.wait_for(cache.get_or_compute("m", "k", compute), 30)
        assert result is CacheResult.MISS and got.num_tokens == 4
        assert errors == ["get", "set"] and accepted
        with pytest.raises(BackendUnavailable, match="TimeoutError") as info:
            await asyncio.wait_for(backend.ping(), 30)
        assert "pw" not in str(info.value)
    finally:
        await backend.close()


async def test_a_refused_connection_is_a_miss() -> None:
    backend = RedisBackend(f"redis://127.0.0.1:{free_port()}/0", ttl_s=60, timeout_s=0.5)
    errors: list[str] = []
    cache = ResponseCache(backend, on_error=errors.append)
    try:
        assert (await cache.get_or_compute("m", "k", compute))[1] is CacheResult.MISS
        assert errors == ["get", "set"]
    finally:
        await backend.close()


def test_a_bad_redis_url_is_a_config_error_without_its_password() -> None:
    from sokuji import config as cfg
    from sokuji.errors import ConfigError
    from sokuji.observability.metrics import Metrics
    from sokuji.server.backends import build_cache

    config = cfg.ServerConfig(
        models=(cfg.ModelConfig(name="s", runtime="synthetic"),),
        cache=cfg.CacheConfig(backend="redis", redis_url="http://:pw-secret@h/0"))
    with pytest.raises(ConfigError, match=r"cache\.redis_url") as info:
        build_cache(config, Metrics())
    assert "pw-secret" not in info.value.message and ":***@h" in info.value.message
